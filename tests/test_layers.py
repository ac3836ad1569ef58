"""The package's layers point one way (issue 19): ``core`` imports nothing of vitlens but its
errors and the kind registry (which imports only the errors), ``families`` imports nothing of ``loading`` (or of the views, reports and surveys above it)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vitlens"


def imported_subpackages(folder: str) -> dict[str, set[str]]:
    """{file: vitlens subpackages/modules it imports, relative or absolute}."""
    out = {}
    for path in (PKG / folder).glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 2 and node.module:  # from ..x import
                    names.add(node.module.split(".")[0])
                elif node.level == 2:
                    names.update(a.name for a in node.names)
                elif node.level == 0 and node.module and node.module.startswith("vitlens"):
                    names.add(node.module.split(".")[1] if "." in node.module else "vitlens")
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("vitlens."))
        out[path.name] = names
    return out


def test_families_import_nothing_of_loading_or_the_layers_above():
    for name, imports in imported_subpackages("families").items():
        assert not imports & {"loading", "views", "report", "survey", "attribution", "compare", "figures"}, name


def test_core_imports_nothing_of_vitlens_but_its_errors_and_the_kind_registry():
    for name, imports in imported_subpackages("core").items():
        assert imports <= {"errors", "kinds"}, (name, imports)
    kinds = PKG / "kinds.py"  # the kind registry sits below core: it imports nothing of vitlens but its errors
    below = {n.module for n in ast.walk(ast.parse(kinds.read_text())) if isinstance(n, ast.ImportFrom) and n.level}
    assert below <= {"errors"}, below


def _target_subpackage(path: Path, node: ast.ImportFrom) -> str:
    """The first part of what ``node`` in ``path`` imports from, below vitlens ("" if not vitlens)."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts[1] if parts[0] == "vitlens" and len(parts) > 1 else ""
    here = list(path.relative_to(PKG).parts[:-1])
    base = here[:len(here) - (node.level - 1)]
    parts = base + (node.module.split(".") if node.module else [])
    return parts[0] if parts else ""


def test_no_private_name_crosses_a_subpackage():
    crossing = []
    for path in PKG.rglob("*.py"):
        own = path.relative_to(PKG).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _target_subpackage(path, node)
                if target and target != own:
                    crossing += [f"{path.relative_to(PKG)}: {a.name} from {target}" for a in node.names
                                 if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, crossing
