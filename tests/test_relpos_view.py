"""The position view of relative-position models (``relpos``, the analogue of Fig. 7 centre): a hand-built BEiT
table comes back exactly by offset; for every query/key patch pair the view equals the bias the block adds
(get_bias() / table[index]) and, end to end, the attention of a block with zero queries and keys; a model without
a relative bias says why in one line; and analyze, the report, the survey and the app offer it from the registry."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.views.relpos import RelativePositionBiasResult
from vitlens import figures
from vitlens.views import registry
from vitlens.views.relpos import bias_by_offset, offset_structure

TINY = dict(depth=2, embed_dim=32, num_heads=4)


def timm_model(name: str, img_size, **kwargs) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, img_size=img_size, **{**TINY, **kwargs}).eval()


def pairs(grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (query, key) pair of patches (row-major indices) and its offset, key minus query."""
    gh, gw = grid
    q, k = np.meshgrid(np.arange(gh * gw), np.arange(gh * gw), indexing="ij")
    q, k = q.ravel(), k.ravel()
    return q, k, k // gw - q // gw, k % gw - q % gw


def fill_beit_table(table: torch.Tensor, index: torch.Tensor, grid: tuple[int, int], value) -> None:
    """Write ``value(dy, dx, head)`` into a BEiT table through the model's own index: for every patch pair the
    entry the block will read for it (prefix entries: value("class->patch"/"patch->class"/"class->class", head))."""
    gh, gw = grid
    heads = table.shape[1]
    index = index.reshape(gh * gw + 1, gh * gw + 1)
    with torch.no_grad():
        for q, k, dy, dx in zip(*pairs(grid)):
            table[index[q + 1, k + 1]] = torch.tensor([value(int(dy), int(dx), h) for h in range(heads)])
        for where, kind in (((0, 1), "class->patch"), ((1, 0), "patch->class"), ((0, 0), "class->class")):
            table[index[where]] = torch.tensor([value(kind, None, h) for h in range(heads)])


def known(block: int):
    """The hand-built bias: 100 * block + 10 * dy + dx + head on the grid; 1000/2000/3000 + head for the class pairs
    (small integers: exact in float32)."""
    prefix = {"class->patch": 1000, "patch->class": 2000, "class->class": 3000}
    return lambda dy, dx, h: float(prefix[dy] + h) if dx is None else float(100 * block + 10 * dy + dx + h)


# ------------------------------------------------------------------ (1) a hand-built known answer
def test_a_hand_built_beit_table_comes_back_exactly_by_offset_with_the_class_biases_apart():
    model = timm_model("beit_base_patch16_224", (64, 96))  # 4x6 patches: rows and columns cannot be swapped
    grid = (4, 6)
    for i, block in enumerate(model.blocks):
        fill_beit_table(block.attn.relative_position_bias_table, block.attn.relative_position_index, grid, known(i))
    r = vl.relative_position_bias(vl.load_model(model))
    dy, dx = np.meshgrid(np.arange(-3, 4), np.arange(-5, 6), indexing="ij")
    for layer in range(2):
        for h in range(4):
            np.testing.assert_array_equal(r.bias[layer, h], 100 * layer + 10 * dy + dx + h)
    assert r.bias.shape == (2, 4, 7, 11) and r.grid == grid and r.prefix_labels == ("class",)
    heads = np.arange(4)
    np.testing.assert_array_equal(r.prefix_to_patch[:, :, 0], np.stack([1000 + heads] * 2))
    np.testing.assert_array_equal(r.patch_to_prefix[:, :, 0], np.stack([2000 + heads] * 2))
    np.testing.assert_array_equal(r.prefix_to_prefix[:, :, 0, 0], np.stack([3000 + heads] * 2))
    assert r.at(1, 2, -3, 5) == 100 - 30 + 5 + 2 and np.all(r.offset_spread == 0)
    rows = r.to_rows()
    assert rows[0] == {"layer": 1, "head": 1, "query": "patch", "key": "patch", "dy": -3, "dx": -5, "bias": -35.0}
    assert {"layer": 2, "head": 3, "query": "class", "key": "patch", "dy": None, "dx": None, "bias": 1002.0} in rows
    assert r.prefix_rows(0)[1] == {"head": 2, "class -> patch": 1001.0, "patch -> class": 2001.0,
                                   "class -> class": 3001.0}
    # the figure draws block 1's heads over (dx, dy), dy = -3 (keys above the query) at the top
    fig = figures.relpos_figure(r, layer=0)
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert len(heat) == 4 and list(heat[0].x) == list(range(-5, 6)) and list(heat[0].y) == list(range(-3, 4))
    np.testing.assert_array_equal(np.asarray(heat[3].z), 10 * dy + dx + 3)
    assert fig.layout.yaxis.range[0] > fig.layout.yaxis.range[1]  # reversed: dy < 0 at the top
    assert fig.layout.coloraxis.colorbar.title.text == "bias (logits)"
    # centred on 0 and reaching the block's largest |bias|: -35 (dy = -3, dx = -5, head 1) to 38 (3, 5, head 4)
    assert (fig.layout.coloraxis.cmin, fig.layout.coloraxis.cmax) == (-38, 38)
    slider = figures.relpos_figure(r)  # every block, a slider between them, one colour scale
    assert len(slider.data) == 2 * 2 * 4 and [t.visible for t in slider.data[:8]] == [True] * 8
    assert (slider.layout.coloraxis.cmin, slider.layout.coloraxis.cmax) == (-138, 138)  # block 2: 100 + 38
    assert [s.label for s in slider.layout.sliders[0].steps] == ["1", "2"]


def test_a_shared_beit_bias_is_added_to_each_blocks_own(tmp_path):
    model = timm_model("beit_base_patch16_224", 48, use_shared_rel_pos_bias=True)
    grid = (3, 3)
    for i, block in enumerate(model.blocks):
        fill_beit_table(block.attn.relative_position_bias_table, block.attn.relative_position_index, grid, known(i))
    shared = model.rel_pos_bias
    fill_beit_table(shared.relative_position_bias_table, shared.relative_position_index, grid,
                    lambda dy, dx, h: 0.5 if dx is None else 0.25 * dy)
    r = vl.relative_position_bias(vl.load_model(model))
    dy, dx = np.meshgrid(np.arange(-2, 3), np.arange(-2, 3), indexing="ij")
    np.testing.assert_array_equal(r.bias[1, 3], 100 + 10 * dy + dx + 3 + 0.25 * dy)
    np.testing.assert_array_equal(r.prefix_to_prefix[0, :, 0, 0], 3000.5 + np.arange(4))
    assert "shared by every block" in r.sources[0] and "blocks.0.attn" in r.sources[0]
    back = vl.load_result(r.save(tmp_path / "relpos.npz"))
    assert back.equals(r) and vl.load_result(r.save(tmp_path / "relpos.json")).equals(r)


def test_a_hugging_face_beit_table_comes_back_exactly_by_offset():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, use_relative_position_bias=True)
    model = transformers.BeitModel(cfg).eval()
    grid = (4, 4)
    for i, layer in enumerate(model.layers):
        bias = layer.relative_position_bias
        fill_beit_table(bias.relative_position_bias_table, bias.generate_relative_position_index(grid), grid, known(i))
    r = vl.relative_position_bias(model)  # read from the module: the views do not load HF BEiT
    dy, dx = np.meshgrid(np.arange(-3, 4), np.arange(-3, 4), indexing="ij")
    np.testing.assert_array_equal(r.bias[1, 1], 100 + 10 * dy + dx + 1)
    np.testing.assert_array_equal(r.patch_to_prefix[0, :, 0], [2000, 2001])
    assert r.sources[0].startswith("layers.0.relative_position_bias (BeitRelativePositionBias")


@pytest.mark.parametrize("kind", ["BeitModel", "Data2VecVisionModel"])
def test_a_hugging_face_models_attention_with_zero_queries_and_keys_is_the_softmax_of_the_views_bias(kind):
    """End to end at a non-square window, where these models resample their own table before adding it (a
    transposed reshape): the view states what they add (their attention), not their table's entries."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, kind.replace("Model", "Config"))(
        image_size=(32, 64), patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, use_relative_position_bias=True, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, kind)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.copy_(torch.randn(p.shape))
            elif any(part in name for part in ("q_proj.", "k_proj.", "query.", "key.")):
                p.zero_()
    r = vl.relative_position_bias(model)
    assert r.grid == (4, 8) and np.all(r.offset_spread == 0)
    with torch.no_grad():
        attentions = model(torch.randn(1, 3, 32, 64), output_attentions=True).attentions
    for layer, probs in enumerate(attentions):
        want = torch.softmax(torch.from_numpy(rebuilt(r, layer)), dim=-1)
        assert (probs[0].double() - want).abs().max().item() <= (probs.shape[-1] + 2) * 2.0 ** -24
    table = next(m for n, m in model.named_modules() if n.endswith("0.attention.attention.relative_position_bias")
                 or n == "layers.0.relative_position_bias").relative_position_bias_table.detach().double()
    dy, dx = np.meshgrid(np.arange(-3, 4), np.arange(-7, 8), indexing="ij")
    entries = table[torch.from_numpy((-dy + 3) * 15 + (-dx + 7))].permute(2, 0, 1).numpy()  # HF's own index rule
    assert np.abs(entries - r.bias[0]).max() > 0.5  # not the table's entries: resampled by the model itself


# ------------------------------------------------------------------ (2) independent checks
def full_bias(model: nn.Module) -> list[torch.Tensor]:
    """Each block's [heads, T, T] bias as the attention adds it, computed here from the modules: timm relpos
    ``rel_pos.get_bias()`` (or the shared one), BEiT ``table[index]`` (+ the shared table[index])."""
    out = []
    for block in model.blocks:
        attn = block.attn
        with torch.no_grad():
            if hasattr(attn, "rel_pos"):
                source = attn.rel_pos if attn.rel_pos is not None else model.shared_rel_pos
                out.append(source.get_bias()[0])
            else:
                t = attn.relative_position_index.shape[0]
                b = attn.relative_position_bias_table[attn.relative_position_index.view(-1)].view(t, t, -1)
                out.append(b.permute(2, 0, 1))
    return out


CASES = {
    "relpos mlp cr": ("vit_relpos_small_patch16_224", (48, 64), {}),
    "relpos mlp swin, class token": ("vit_relpos_medium_patch16_cls_224", (64, 48), dict(rel_pos_type="mlp_swin")),
    "relpos table, class token": ("vit_relpos_small_patch16_224", 48,
                                  dict(rel_pos_type="bias", class_token=True, global_pool="token")),
    "srelpos (shared)": ("vit_srelpos_small_patch16_224", 48, {}),
    "beit": ("beit_base_patch16_224", (48, 64), {}),
}


def randomised(model: nn.Module) -> nn.Module:
    """BEiT's tables start at zero and timm's RelPosBias table near it: random values so that any mix-up shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_every_query_key_pair_gets_the_views_bias_at_its_offset(case):
    name, size, kwargs = CASES[case]
    model = randomised(timm_model(name, size, **kwargs))
    m = vl.load_model(model)
    r = vl.relative_position_bias(m)
    grid, p = m.spec.grid, m.spec.num_prefix_tokens
    q, k, dy, dx = pairs(grid)
    for layer, bias in enumerate(full_bias(model)):
        b = bias.double().numpy()
        # the view's numbers are the float32 bias, indexed and widened to float64 (both exact): tolerance zero
        np.testing.assert_array_equal(r.bias[layer][:, dy + grid[0] - 1, dx + grid[1] - 1], b[:, p + q, p + k])
        if p:
            np.testing.assert_array_equal(np.broadcast_to(r.prefix_to_patch[layer, :, :1], b[:, 0, p:].shape),
                                          b[:, 0, p:])
            np.testing.assert_array_equal(np.broadcast_to(r.patch_to_prefix[layer, :, :1], b[:, p:, 0].shape),
                                          b[:, p:, 0])
            np.testing.assert_array_equal(r.prefix_to_prefix[layer], b[:, :p, :p])
    assert np.all(r.offset_spread == 0) and r.bias.shape == (2, 4, 2 * grid[0] - 1, 2 * grid[1] - 1)


def rebuilt(r: RelativePositionBiasResult, layer: int) -> np.ndarray:
    """The [heads, T, T] bias rebuilt from the view alone (its offsets and its prefix numbers)."""
    gh, gw = r.grid
    p = len(r.prefix_labels)
    q, k, dy, dx = pairs(r.grid)
    heads = r.bias.shape[1]
    out = np.zeros((heads, p + gh * gw, p + gh * gw))
    out[:, p + q, p + k] = r.bias[layer][:, dy + gh - 1, dx + gw - 1]
    out[:, :p, p:] = r.prefix_to_patch[layer][:, :, None]
    out[:, p:, :p] = r.patch_to_prefix[layer][:, None, :]
    out[:, :p, :p] = r.prefix_to_prefix[layer]
    return out


@pytest.mark.parametrize("case", ["relpos mlp swin, class token", "beit"])
def test_with_zero_queries_and_keys_the_attention_is_the_softmax_of_the_views_bias(case):
    """End to end: with q = k = 0 the scores are the bias alone, so each block's attention (timm's own non-fused path,
    as it enters attn_drop) is softmax over keys of the bias the view states, query rows and key columns."""
    name, size, kwargs = CASES[case]
    model = randomised(timm_model(name, size, **kwargs))
    r = vl.relative_position_bias(vl.load_model(model))
    maps = []
    with torch.no_grad():
        for block in model.blocks:
            qkv = block.attn.qkv
            keep = slice(0, 2 * qkv.out_features // 3)  # the q and k rows of the fused projection
            qkv.weight[keep] = 0
            for bias in ("bias", "q_bias", "k_bias"):
                if getattr(qkv, bias, None) is not None:
                    getattr(qkv, bias)[keep] = 0
                if getattr(block.attn, bias, None) is not None:
                    getattr(block.attn, bias).zero_()
            block.attn.fused_attn = False
            block.attn.attn_drop.register_forward_hook(lambda _m, inp, _o: maps.append(inp[0][0].double()))
        model(torch.randn(1, 3, *((size, size) if isinstance(size, int) else size)))
    for layer, probs in enumerate(maps):
        want = torch.softmax(torch.from_numpy(rebuilt(r, layer)), dim=-1)
        # float32 softmax of a row of T logits: exp and division one rounding each, the sum at most T - 1
        tol = (probs.shape[-1] + 2) * 2.0 ** -24
        assert (probs - want).abs().max().item() <= tol


def test_bias_by_offset_is_an_independent_scatter_of_a_hand_built_bias():
    # a 2x3 grid, one prefix token, bias = 7 * key row - 3 * query column (not a function of the offset alone)
    gh, gw = 2, 3
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    b = np.zeros((1, 7, 7))
    b[0, 1:, 1:] = 7 * rows[None, :] - 3 * cols[:, None]
    by_offset, *_, spread = bias_by_offset(torch.from_numpy(b), (gh, gw), 1)
    assert spread == 7 + 6 - 0  # e.g. offset (0, 0): 7 * 1 - 3 * 0 (query (1, 0)) vs 0 - 3 * 2 (query (0, 2))
    assert by_offset[0, 1, 2] == 0.0  # offset (0, 0) read at the top-left-most query (0, 0)


# ------------------------------------------------------------------ (3) when there is no relative bias
def test_a_model_without_a_relative_bias_says_why_in_one_line():
    m = vl.load_model("vit_tiny_patch16_224", pretrained=False, device="cpu", img_size=32, depth=1)
    with pytest.raises(vl.ViewNotAvailableError) as e:
        vl.relative_position_bias(m)
    message = str(e.value)
    assert message == ("The relative-position bias view is not available for vit_tiny_patch16_224: it adds no learned "
                       "relative-position bias to its attention scores; its position is a learned absolute table (the "
                       "position view shows it).")
    a = vl.analyze(m, torch.zeros(1, 3, 32, 32), views=("relpos",))
    assert a.view("relpos") is None and a.notes == {"relpos": message}
    with pytest.raises(vl.ViewNotAvailableError, match=r"not available for Linear: it has none of the relative"):
        vl.relative_position_bias(nn.Linear(2, 2))
    import timm

    rope = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=1, use_abs_pos_emb=False)
    with pytest.raises(vl.ViewNotAvailableError, match=r"for eva02: position enters its attention through rotary "
                                                       r"embeddings \(RoPE\) of queries and keys, not an additive "
                                                       r"bias\.$"):
        vl.relative_position_bias(vl.LoadedModel.from_module(rope.eval(), name="eva02", device="cpu"))


def test_asking_a_timm_vit_for_its_relative_bias_does_not_import_transformers(monkeypatch):
    """The report and the survey ask every model: the Hugging Face reader must not cost a transformers import (seconds)
    for a model that is not one of its."""
    import builtins

    m = vl.load_model("vit_tiny_patch16_224", pretrained=False, device="cpu", img_size=32, depth=1)
    asked, real = [], builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: asked.append(name) or real(name, *a, **k))
    with pytest.raises(vl.ViewNotAvailableError):
        vl.relative_position_bias(m)
    monkeypatch.undo()
    assert asked and not [name for name in asked if name.startswith("transformers")]


def test_a_bias_that_is_not_a_function_of_the_offset_alone_is_refused_by_name(monkeypatch):
    model = timm_model("vit_relpos_small_patch16_224", 32)
    rel_pos = model.blocks[1].attn.rel_pos
    own = rel_pos.get_bias
    # + 0.01 * key index on the 2x2 grid: offset (0, 0) has keys 0 and 3, so its pairs differ by 0.03
    monkeypatch.setattr(rel_pos, "get_bias", lambda: own() + 0.01 * torch.arange(own().shape[-1]).float())
    with pytest.raises(vl.ViewNotAvailableError, match=r"not a function of the offset alone: in block 2 .* differ by "
                                                       r"0\.03 logits"):
        vl.relative_position_bias(vl.load_model(model))


def test_a_bias_mlp_in_training_mode_is_refused():
    model = timm_model("vit_relpos_small_patch16_224", 32).train()
    with pytest.raises(vl.ViewNotAvailableError, match=r"blocks\.0\.attn\.rel_pos is in training mode.*eval\(\)"):
        vl.relative_position_bias(model)


# ------------------------------------------------------------------ (4) offered from the registry
def test_analyze_the_report_and_the_survey_offer_it_from_the_registry():
    from vitlens.report.html import model_figures, model_section
    from vitlens.survey.worker import weight_views

    view = registry.VIEWS["relpos"]
    assert "relpos" in registry.VIEW_NAMES and "relpos" not in registry.DEFAULT_VIEWS  # the paper's four stay default
    assert view.kind == "weights" and view.result_class() is RelativePositionBiasResult
    assert figures.DRAWERS[view.result_type].fn is figures.relpos_figure and view.shown_in == registry.VIEWS["position"].label
    m = vl.load_model(randomised(timm_model("vit_relpos_medium_patch16_cls_224", 32)))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    a = vl.analyze(m, x, views=registry.VIEW_NAMES, n_components=4)  # what `vitlens report` computes
    assert a.view("relpos").equals(vl.relative_position_bias(m)) and "position" in a.notes and "relpos" not in a.notes
    figs = model_figures(a, [np.zeros((32, 32, 3), dtype=np.uint8)] * 2)
    page = model_section(a, figs, {})
    assert "relpos" in figs and "Relative-position bias by offset (analogue of Fig. 7 centre)" in page
    assert page.index("Position embedding similarity") < page.index("Relative-position bias by offset")
    assert "class -&gt; patch" in page  # the class token's biases, stated apart
    survey = weight_views(m)
    assert set(survey) >= {"relpos_self", "relpos_neighbours", "relpos_far_ge3"}
    assert survey["relpos_self"] == offset_structure(a.view("relpos"))["self"]


def test_the_apps_position_page_offers_it_only_for_a_model_with_a_relative_bias():
    from streamlit.testing.v1 import AppTest

    from test_app import APP

    at = AppTest.from_file(APP, default_timeout=90)
    at.run()
    assert "Relative position bias" not in at.radio(key="view").options  # shown on the position page, not its own
    at.radio(key="view").set_value("Position embeddings").run()
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert not at.exception and not at.error and not any("Relative-position bias" in t for t in titles)
    at.radio(key="m1-source").set_value("Name").run()
    at.text_input(key="m1-timm").set_value("vit_srelpos_small_patch16_224").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    charts = [c.proto.spec for c in at.get("plotly_chart")]
    assert len(charts) == 1 and "Relative-position bias by offset, the same in every block" in charts[0]
    assert any("no learned absolute position table" in i.value for i in at.info)
