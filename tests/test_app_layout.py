"""The app as pages (issue 44, item 4): ``app.py`` is a thin shell over ``vitlens_app/``; no file of it is long,
and no module of it but the one adapter (``vitlens_app/library.py``) reaches into the library past its public API
(the names of ``vitlens``'s lazy list, and ``vitlens.figures``). Read from the source with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vitlens as vl

ROOT = Path(__file__).resolve().parents[1]
APP_FILES = [ROOT / "app.py", ROOT / "serve.py", *sorted((ROOT / "vitlens_app").rglob("*.py"))]
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


def kind_comparisons(path: Path) -> list[str]:
    """Each comparison in the module that reads a model spec's ``kind`` (``spec.kind == ...``, ``... in ...``)."""
    source = path.read_text()
    return [ast.get_source_segment(source, node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Attribute) and n.attr == "kind" and (
                    (isinstance(n.value, ast.Attribute) and n.value.attr == "spec")
                    or (isinstance(n.value, ast.Name) and n.value.id == "spec"))
                for side in [node.left, *node.comparators] for n in ast.walk(side))]


def test_the_app_never_branches_on_a_kinds_name():
    """No file of the app compares ``spec.kind`` with anything: its choices by kind are the functions of
    ``kind_choices``, each read from the kind's record in the registry (the old app.py had 8 such branches)."""
    found = {str(p.relative_to(ROOT)): c for p in APP_FILES if (c := kind_comparisons(p))}
    assert found == {}


#: what the app chose for each kind before its choices were one module (app.py's branches, issue 44): the answers
#: kind_choices must keep, whatever they are derived from
CHOSEN = {  # kind: (distance pass, filters of the CNN, distance by stage, distance without prefix, rollout discards,
    #          maps by window, maps of class attention, attributions by stage)
    "vit": (("distance", "prefix"), False, False, False, True, False, False, False),
    "hybrid": (("distance", "prefix"), True, False, False, True, False, False, False),
    "hierarchical": (("distance",), False, True, False, False, True, False, True),
    "class-attention": (("distance",), False, False, True, False, False, True, False),
}


@pytest.mark.parametrize("kind", list(CHOSEN))
def test_the_kind_choices_are_the_apps_branches(kind):
    from types import SimpleNamespace

    from vitlens_app import kind_choices as kc

    spec = SimpleNamespace(kind=kind)
    got = (kc.distance_pass_views(spec), kc.filters_read_the_cnn(spec), kc.distance_by_stage(spec),
           kc.distance_without_prefix(spec), kc.rollout_discards(spec), kc.maps_by_window(spec),
           kc.maps_of_class_attention(spec), kc.attributions_by_stage(spec))
    assert got == CHOSEN[kind]
