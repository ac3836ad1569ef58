"""The module import graph of ``vitlens/`` (every import statement, function-local ones and
``TYPE_CHECKING`` blocks included, read with ``ast``) has no cycle, and no numeric module imports
the figures (issue 30, sections 1 and 3)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1] / "vitlens"
APP = ROOT.parent / "vitlens_app"


def _modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the package at ``root`` (``vitlens/``, or the app's ``vitlens_app/``) it names in any
    import statement. ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``; importing
    ``a.b`` is not counted as importing ``a``'s ``__init__`` (Python runs it, but a package's own re-exports would make
    every package a cycle)."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
                hits = [n for n in names if n in mods]
                if len(hits) < len(names) and target in mods:
                    hits.append(target)
            elif isinstance(node, ast.Import):
                hits = [a.name for a in node.names if a.name in mods]
            else:
                continue
            edges[mod].update(h for h in hits if h != mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_hand_built_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_and_relative_imports():
    edges = import_graph()
    assert "vitlens.attribution.methods" in edges["vitlens.attribution.faithfulness"]  # top level, relative
    assert "vitlens.attribution.perturbation" in edges["vitlens.attribution.deletion"]  # inside a function
    assert "vitlens.families.hf" in edges["vitlens.families"]  # ``from . import hf``


def test_vitlens_imports_have_no_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles in vitlens/: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_app_imports_have_no_cycle():
    """The app's pages sit above its contexts (``vitlens_app.context``: an image set's and a clip's), so a page module
    and the module that picks pages never import each other (the clip page and the video header once did)."""
    edges = import_graph(APP)
    assert "vitlens_app.context" in edges["vitlens_app.views.spacetime"]  # the graph reads the app's imports
    found = cycles(edges)
    assert found == [], "import cycles in vitlens_app/: " + "; ".join(" <-> ".join(c) for c in found)


NUMERIC = ("vitlens.attribution", "vitlens.compare", "vitlens.core", "vitlens.views", "vitlens.survey",
           "vitlens.loading", "vitlens.families", "vitlens.results")


def test_nothing_numeric_imports_a_figure():
    bad = {m: sorted(t for t in targets if t == "vitlens.figures") for m, targets in import_graph().items()
           if m.startswith(NUMERIC)}
    assert {m: t for m, t in bad.items() if t} == {}


def test_lrp_uses_no_private_name_of_methods():
    tree = ast.parse((ROOT / "attribution" / "lrp.py").read_text())
    private = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.name.startswith("_")]
    assert private == []


def test_upsample_map_lives_with_the_numbers_and_figures_reexport_it():
    from vitlens import figures
    from vitlens.core.resample import pixels_to_grid, upsample_map

    assert figures.upsample_map is upsample_map
    # a constant map stays constant; a 2x2 map upsampled to 4x4 keeps its corners' quadrant order
    # (interpolation weights w and 1 - w: a constant is kept up to a few float64 roundings of its size)
    np.testing.assert_allclose(upsample_map(np.full((3, 3), 2.5), (12, 9)), 2.5, rtol=0, atol=8 * 2.5 * 2.0 ** -52)
    up = upsample_map(np.array([[0.0, 1.0], [2.0, 3.0]]), (4, 4))
    assert up[0, 0] == 0.0 and up[-1, -1] == 3.0 and up[0, -1] == 1.0 and up[-1, 0] == 2.0
    # pixels_to_grid sums channels and each token's block: a one-hot pixel lands in its token
    attr = torch.zeros(1, 3, 8, 8, dtype=torch.float64)
    attr[0, 1, 5, 2] = 4.0
    attr[0, 2, 5, 3] = 1.0
    grid = pixels_to_grid(attr, (2, 2))
    np.testing.assert_array_equal(grid, [[[0.0, 0.0], [5.0, 0.0]]])
    np.testing.assert_array_equal(pixels_to_grid(attr, (2, 2), reduce="mean"), grid / 16)


@pytest.mark.parametrize("name", ["AttentionConsumer", "BatchInfo", "query_rows"])
def test_the_engine_exports_the_consumer_protocol(name):
    import vitlens
    from vitlens import engine
    from vitlens.engine import consumer, stream

    assert getattr(engine, name) is getattr(consumer, name) is getattr(stream, name)
    if name != "query_rows":
        assert getattr(vitlens, name) is getattr(consumer, name)
