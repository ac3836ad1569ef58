"""The kind registry (``vitlens.kinds``, issue 44 item 1) is the one source of what a kind of model is: no kind's
name is written anywhere else in the library or the analyses, and a kind registered here, in this file alone, is
listed, refused in its own words and described everywhere."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.attribution.methods import METHOD_TABLE, methods_for, preselected_methods
from vitlens.compare.cka import refuse_unread_blocks
from vitlens.engine import AttentionConsumer, stream_attention
from vitlens.kinds import (CLASS_ATTENTION, HIERARCHICAL, HYBRID, VIT, Kind, all_kinds, kind_names, kind_of,
                           register_kind, registered_kind)
from vitlens.survey.stats import Predictions
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.views.registry import VIEWS, available_views
from vitlens.views.rollout import RolloutAccumulator
from vitlens.views.rollout_stats import RolloutStats

ROOT = Path(__file__).resolve().parents[1]
#: the top-level folders that are not the app: the library, the analyses, and what is neither library nor app
NOT_APP = {"vitlens", "analyses", "tests", "scripts", "tutorials", "docs"}
#: files of the app: app.py and any package beside it (the pages).
#: the app is held to it too (its choices by kind read the registry: vitlens_app/kind_choices.py)
APP_ALLOWED = False
#: (file, literal) -> why that file writes a string spelled like a kind's name that does not name a kind of model
NOT_A_KIND = {
    ("vitlens/families/hf.py", "vit"): "a Hugging Face model_type and the attribute of its ViT tower",
    ("vitlens/families/common/hf.py", "vit"): "the attribute of ViTMAE's ViT tower (vision_tower)",
    ("vitlens/components/layout.py", "vit"): "the attribute of a Hugging Face ViT classifier's tower (model.vit)",
    ("vitlens/components/towers.py", "vit"): "the attribute of a Hugging Face ViT classifier's tower (model.vit)",
    ("vitlens/families/cait.py", "class-attention"): "a block's kind in CaiT's block layout (Family.block_layout)",
    ("vitlens/views/class_attention.py", "class-attention"): "a block's kind in CaiT's block layout",
    ("analyses/locality_sweep.py", "vit"): "a key of the result rows it has written (the ViT's metrics)",
    ("analyses/locality_sweep.py", "hybrid"): "a key of the result rows it has written (the hybrid's origin)",
    ("analyses/hierarchical_screens.py", "hierarchical"): "its output folder and a word of the app's page it waits "
                                                          "for (the script imports nothing of vitlens)",
}


def scanned_files() -> list[Path]:
    """Every Python file of the library, the analyses and the app (app.py and the top-level packages beside it)."""
    files = sorted((ROOT / "vitlens").rglob("*.py")) + sorted((ROOT / "analyses").rglob("*.py"))
    files += sorted(ROOT.glob("*.py"))
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if folder.name not in NOT_APP and (folder / "__init__.py").exists():
            files += sorted(folder.rglob("*.py"))
    return files


def is_app(path: Path) -> bool:
    rel = path.relative_to(ROOT)
    return rel.parts[0] not in NOT_APP


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (a module's, a class's, a function's first statement)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                   str):
                out.add(id(first.value))
    return out


def kind_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string constant in ``source`` equal to one of ``names``, docstrings excluded
    (comments are not in the tree)."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in skip]


def test_the_scan_finds_a_kind_literal_and_passes_over_docstrings_and_comments():
    source = ('"""A module about "vit" models."""\n'
              'def f(spec):\n'
              '    """Is it "hierarchical"?"""\n'
              '    # spec.kind == "hybrid"\n'
              '    return spec.kind == "hierarchical" or f"{spec.kind}" == "vitx"\n')
    assert kind_literals(source, set(kind_names())) == [(5, "hierarchical")]


def test_no_kind_is_named_outside_the_kind_registry():
    names = set(kind_names())
    assert {"vit", "hybrid", "hierarchical", "class-attention"} <= names
    found = {}
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "vitlens/kinds.py" or (APP_ALLOWED and is_app(path)):
            continue
        hits = [(line, lit) for line, lit in kind_literals(path.read_text(encoding="utf-8"), names)
                if (rel, lit) not in NOT_A_KIND]
        if hits:
            found[rel] = hits
    assert found == {}, ("kind names written outside vitlens/kinds.py (read the record: kind_of(m).<field>, or "
                         f"the constant's .name): {found}")
    scanned = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "app.py" in scanned and "vitlens/attribution/methods.py" in scanned  # the app is scanned, and allowed
    assert {rel for rel, _ in NOT_A_KIND} <= scanned  # no stale allowance


def test_the_built_in_kinds_say_what_they_are():
    assert [k.name for k in all_kinds()[:4]] == ["vit", "hybrid", "hierarchical", "class-attention"]
    assert kind_of("hybrid") is HYBRID and HYBRID.cnn_stem and not VIT.cnn_stem
    assert VIT.token_attention and HYBRID.token_attention
    assert not HIERARCHICAL.token_attention and HIERARCHICAL.stages and HIERARCHICAL.cam_layer
    assert not CLASS_ATTENTION.token_attention and not CLASS_ATTENTION.cam_layer
    # the lists the methods and views used to spell out, now read from the records
    assert METHOD_TABLE["saliency"].kinds == tuple(k.name for k in all_kinds() if not k.clips)
    assert "space-time" in kind_names() and "space-time" not in METHOD_TABLE["saliency"].kinds  # a clip is no image
    assert METHOD_TABLE["gradcam"].kinds[:3] == ("vit", "hybrid", "hierarchical")
    assert "class-attention" not in METHOD_TABLE["gradcam"].kinds
    assert METHOD_TABLE["grad_rollout"].kinds == ("vit", "hybrid")
    assert VIEWS["prefix"].kinds == ("vit", "hybrid")
    # what the app's Attention distance page runs in one pass, asked of a spec
    assert [available_views(k, ("distance", "prefix")) for k in ("vit", "hybrid", "hierarchical", "class-attention")
            ] == [("distance", "prefix")] * 2 + [("distance",)] * 2
    assert VIEWS["distance"].kinds[:4] == VIEWS["rollout"].kinds[:4] == ("vit", "hybrid", "hierarchical",
                                                                         "class-attention")
    with pytest.raises(vl.UnsupportedModelError, match="No kind of model is called 'nope'; vitlens reads vit, hybrid"):
        kind_of("nope")
    with pytest.raises(ValueError, match="registered already"):
        register_kind(VIT)


#: a toy kind of this test alone: blocks that attend within horizontal stripes of the grid
STRIPED = Kind(
    "striped", "striped attention (a toy: blocks attend within stripes)", "striped", reader="reads_stripes",
    maps="attends within horizontal stripes (its blocks' maps are [B * stripes, heads, N, N])",
    use="a consumer of stripes",
    refusal="{what} reads a ViT's attention over one token grid; {name} attends within stripes",
    method_refusal="{method} reads a ViT's attention over one grid; {name} attends within stripes",
    blocks_refusal="its blocks attend within stripes", cam_layer=False)


class StripeCounter(AttentionConsumer):
    """A consumer that says it reads striped maps: it counts the blocks handed to it."""

    reads_stripes = True

    def __init__(self) -> None:
        self.blocks = 0

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.blocks += rows is None or rows.stop == attn.shape[-1]


def test_a_kind_registered_here_is_listed_refused_and_described(ref_vit):
    x = torch.randn(2, 3, *ref_vit.spec.image_size, generator=torch.Generator().manual_seed(0))
    with registered_kind(STRIPED):
        m = dataclasses.replace(ref_vit, spec=dataclasses.replace(ref_vit.spec, kind="striped"))
        # listed: among the kinds, and in the kinds of every method defined for any differentiable model
        assert kind_of(m) is STRIPED and "striped" in kind_names()
        anywhere = {"integrated_gradients", "saliency", "input_x_gradient", "occlusion"}
        assert {name for name, mt in METHOD_TABLE.items() if "striped" in mt.kinds} == anywhere
        assert set(methods_for(m)) == anywhere and preselected_methods(m) == ("saliency",)
        # the weight views of images (a video model's weight views read its clips' tubelets and tables)
        assert available_views(m) == tuple(n for n, v in VIEWS.items() if v.kind == "weights" and v.for_kind is None)
        assert available_views(m.spec) == available_views("striped") == available_views(m)
        # described
        assert m.spec.describe()["kind"] == STRIPED.label
        # refused in its own words: by a consumer that does not read stripes, by a method, by a reading of one grid
        with pytest.raises(vl.UnsupportedModelError) as stream_refusal:
            stream_attention(m, x, [AttentionDistanceAccumulator.for_model(m)])
        said = str(stream_refusal.value)
        assert said.startswith(f"{m.spec.name} {STRIPED.maps}, which AttentionDistanceAccumulator would read")
        assert "use a consumer of stripes" in said and "reads_stripes = True" in said
        with pytest.raises(vl.UnsupportedModelError, match="grad_rollout reads a ViT's attention over one grid; "
                                                           "ref-vit attends within stripes; the methods defined"):
            vl.attribute(m, x, "grad_rollout")
        with pytest.raises(vl.UnsupportedModelError, match="^attention_maps reads a ViT's attention over one token "
                                                           "grid; ref-vit attends within stripes$"):
            vl.attention_maps(m, x[:1])
        with pytest.raises(vl.UnsupportedModelError, match="not compared here: its blocks attend within stripes"):
            refuse_unread_blocks(m.spec)
        with pytest.raises(vl.ViewNotAvailableError, match="The distance view is not defined for ref-vit"):
            VIEWS["distance"].build(m, None)
        # read by a consumer that says it reads stripes
        counter = StripeCounter()
        assert stream_attention(m, x, [counter], batch_size=2) == 2
        assert counter.blocks == ref_vit.spec.num_layers
        # a consumer of the logits alone reads every kind's model (the survey's predictions), and the survey's
        # rollout statistics read what their accumulator reads, for this kind's flag too
        assert STRIPED.reads(Predictions(True)) and not STRIPED.reads(AttentionDistanceAccumulator)
        assert getattr(RolloutStats(counter), "reads_stripes") is True
        assert getattr(RolloutStats(RolloutAccumulator.for_model(ref_vit)), "reads_stripes") is False
        # and the input methods run
        res = vl.attribute(m, x, "saliency")
        assert res.maps.shape == (2, *ref_vit.spec.grid) and np.isfinite(res.maps).all()
    assert "striped" not in kind_names() and "striped" not in METHOD_TABLE["saliency"].kinds
