"""No part of vitlens imports another by a string the import graph cannot see, and the analyses import public names
only (issue 44, item 5).

The one mechanism that imports vitlens modules by name is ``vitlens/_lazy.py`` (PEP 562): a lazy package's public
names are read from its ``TYPE_CHECKING`` block, where they are written as ordinary ``from .x import y`` statements
that the import graph (``tests/test_import_graph.py``) reads; ``_lazy`` imports exactly those on first use.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vitlens"

#: the PEP 562 lazy names: it imports the modules named in a lazy package's ``TYPE_CHECKING`` block (and a
#: package's submodule when asked for it by attribute), the one allowed way to import vitlens by name
LAZY = "vitlens/_lazy.py"
#: imports by a name held in a variable outside ``_lazy``, each of a third-party module (never vitlens's)
THIRD_PARTY = {
    "vitlens/families/swin.py": "timm's module of the family's classes (``SwinFamily.module``, a timm path)",
    "vitlens/loading/external.py": "an optional dependency, by its package name (``_optional('transformers', ...)``)",
}


def _modules() -> set[str]:
    out = set()
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
    return found


def import_by_name(source: str, path: str, modules: set[str]) -> list[str]:
    """What in ``source`` imports a vitlens module by a string: ``importlib.import_module`` / ``__import__`` of a
    vitlens or relative name, such a call on a name held in a variable (outside ``_lazy`` and the third-party sites
    of ``THIRD_PARTY``), and a string that spells a vitlens module's dotted path outside a docstring (a table of
    modules to import later, as ``results._LAZY_KINDS`` was)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name not in ("import_module", "__import__") or not node.args:
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value.startswith(("vitlens", ".")):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            elif path != LAZY and path not in THIRD_PARTY:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)} (a name held in a variable)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and "." in node.value and node.value in modules and path != LAZY:
            found.append(f"{path}:{node.lineno}: the string {node.value!r}")
    return found


def test_no_vitlens_module_imports_another_by_a_string():
    modules = _modules()
    found = [hit for path in sorted(PKG.rglob("*.py"))
             for hit in import_by_name(path.read_text(), str(path.relative_to(ROOT)), modules)]
    assert found == [], found


def test_the_check_finds_what_it_should():
    modules = {"vitlens.report.data", "vitlens.results"}
    assert import_by_name('import importlib\nimportlib.import_module("vitlens.report.data")\n', "vitlens/x.py",
                          modules)
    assert import_by_name('__import__(".data", globals(), level=1)\n', "vitlens/x.py", modules)
    assert import_by_name('KINDS = {"report": "vitlens.report.data"}\n', "vitlens/x.py", modules)  # a hidden table
    assert import_by_name('import importlib\nm = "x"\nimportlib.import_module(m)\n', "vitlens/x.py", modules)
    # what is allowed: the lazy names' own imports, a third-party module, a docstring that names a module
    assert not import_by_name('import importlib\nimportlib.import_module(module, package)\n', LAZY, modules)
    assert not import_by_name('__import__("pytorch_grad_cam")\n', "vitlens/attribution/cam.py", modules)
    assert not import_by_name('"""Read by ``vitlens.report.data``."""\n', "vitlens/x.py", modules)


def test_the_lazy_names_import_only_what_their_type_checking_blocks_name():
    """``_lazy``'s imports are the ones its packages write as import statements: each exported name resolves to the
    attribute of the module its ``TYPE_CHECKING`` block names."""
    import importlib

    from vitlens._lazy import exported

    for package in ("vitlens", "vitlens.report"):
        pkg = importlib.import_module(package)
        for name, (module, attribute) in exported(pkg.__file__).items():
            target = importlib.import_module(module, package)
            assert getattr(pkg, name) is getattr(target, attribute), (package, name)


def test_every_result_kind_loads_in_a_fresh_process():
    """Every ``Result`` kind a vitlens module defines is found by ``load_result`` in a process that computed none
    (``results._load_every_kind`` walks the public names; no list of modules is kept beside them)."""
    kinds = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["kind"] \
                            and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                        kinds.add(stmt.value.value)
    code = ("import vitlens.results as r; r._load_every_kind(); print(' '.join(sorted(r._REGISTRY)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert {"report", "comparison"} <= loaded
    assert kinds - loaded == set(), kinds - loaded


@pytest.mark.parametrize("path", sorted((ROOT / "analyses").glob("*.py")), ids=lambda p: p.name)
def test_analyses_import_no_private_name_of_vitlens(path):
    private = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vitlens"):
            private += [f"{node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            private += [node.module] if any(part.startswith("_") and part != "__init__"
                                            for part in node.module.split(".")) else []
        elif isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("vitlens")
                        and any(part.startswith("_") for part in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and isinstance(node.value, ast.Name) and node.value.id in ("vl", "vitlens"):
            private.append(f"{node.value.id}.{node.attr}")
    assert private == [], private


def test_the_top_level_is_narrow_and_written_once():
    """``vitlens.__all__`` is the verbs and the few types a user names (at most 66: the SAE's six verbs of issue 66
    joined the 60), read from the one list (the lazy block); no result class or accumulator is among them (they live
    in their modules)."""
    import vitlens as vl
    from vitlens._lazy import exported

    assert vl.__all__ == sorted(exported(vl.__file__)) and len(vl.__all__) <= 66
    assert not [n for n in vl.__all__ if n.endswith(("Result", "Accumulator")) and n != "Result"]  # the base stays
    for name in vl.__all__:
        assert getattr(vl, name) is not None


def test_a_name_that_left_the_top_level_still_resolves_and_says_where_it_lives(recwarn):
    """Every name public before the top level was narrowed (issue 61) is the object of its module, with one
    FutureWarning line that names that module (what a user's old import reads)."""
    import importlib
    import warnings

    import vitlens as vl

    assert {"AnalysisResult", "AttentionDistanceAccumulator", "ATTRIBUTION_METHODS", "register_kind"} <= set(vl.MOVED)
    assert not set(vl.MOVED) & set(vl.__all__)
    for name, (module, attribute) in vl._lazy_moved.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(vl, name)
        target = importlib.import_module(module, "vitlens")
        assert value is getattr(target, attribute) or value == getattr(target, attribute), name
        (w,) = caught
        text = str(w.message)
        assert w.category is FutureWarning and "\n" not in text and f"vitlens{module}" in text, text
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        vl.no_such_name  # noqa: B018
