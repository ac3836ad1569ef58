"""The app as pages (issue 44, item 4): ``app.py`` is a thin shell over ``vitlens_app/``; no file of it is long,
and no module of it but the one adapter (``vitlens_app/library.py``) reaches into the library past its public API
(the names of ``vitlens``'s lazy list, and ``vitlens.figures``). Read from the source with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vitlens as vl

ROOT = Path(__file__).resolve().parents[1]
APP_FILES = [ROOT / "app.py", *sorted((ROOT / "vitlens_app").rglob("*.py"))]
#: the one module allowed to import the library's non-public parts
ADAPTER = ROOT / "vitlens_app" / "library.py"
MAX_LINES = 300
#: what ``vitlens`` exports: its lazy list, its version, and the figures module
PUBLIC = set(vl.__all__) | {"__version__", "figures"}


def test_no_file_of_the_app_is_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in APP_FILES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(APP_FILES) > 10 and long == {}


def reaches(path: Path) -> list[str]:
    """What a module of the app imports or reads that is not the library's public API, or a private name."""
    tree = ast.parse(path.read_text(), str(path))
    bound = {"vitlens"}  # the names the vitlens package is bound to here (``import vitlens as vl``)
    figures = set()  # and the figures module's
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "vitlens":
                    bound.add(a.asname or a.name)
                elif a.name.startswith("vitlens.") and a.name != "vitlens.figures":
                    out.append(f"import {a.name}")
                elif a.name == "vitlens.figures" and a.asname:
                    figures.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            private = [a.name for a in node.names if a.name.startswith("_") and a.name != "annotations"]
            out += [f"from {'.' * node.level}{module} import {name}" for name in private]
            if node.level == 0 and module == "vitlens":
                out += [f"from vitlens import {a.name}" for a in node.names if a.name not in PUBLIC]
                figures |= {a.asname or a.name for a in node.names if a.name == "figures"}
            elif node.level == 0 and module.startswith("vitlens.") and module != "vitlens.figures":
                out.append(f"from {module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in bound and node.attr not in PUBLIC:
                out.append(f"{node.value.id}.{node.attr}")
            elif node.value.id in figures and node.attr.startswith("_"):
                out.append(f"{node.value.id}.{node.attr}")
    return out


def test_the_pages_use_the_public_api_and_the_figures_only():
    found = {str(p.relative_to(ROOT)): r for p in APP_FILES if p != ADAPTER and (r := reaches(p))}
    assert found == {}
    assert reaches(ADAPTER), "the adapter is the one module allowed to reach further: it should need to"


@pytest.mark.parametrize("source, what", [
    ("from vitlens.views.registry import VIEWS\n", "from vitlens.views.registry import ..."),
    ("import vitlens.engine.capture\n", "import vitlens.engine.capture"),
    ("from vitlens_app.caches import _private\n", "from vitlens_app.caches import _private"),
    ("from vitlens import load_model, stream_attention, engine\n", "from vitlens import engine"),
    ("import vitlens as vl\nvl.load_model('ref-vit')\nvl.views.registry\n", "vl.views"),
    ("from vitlens import figures\nfigures._axis()\n", "figures._axis"),
])
def test_the_scan_finds_each_way_past_the_public_api(tmp_path, source, what):
    module = tmp_path / "page.py"
    module.write_text("from __future__ import annotations\n" + source)
    assert reaches(module) == [what]
