"""CaiT (timm ``cait_*``): talking-heads self-attention blocks over the patches, then class-attention layers.

The capture against the attention written out here in float64 from each block's weights (the talking heads'
softmax after ``proj_l``, before ``proj_w``; the class token's one query over [class, patches]), the outputs
bit-identical under side capture, the distance against a numpy reference, the rollout against a brute-force
composition of dense (1 + N) x (1 + N) token-to-token matrices, and a CaiT through ``vl.analyze``, the report,
``vitlens compare`` and the app."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.class_attention import ClassAttentionDistanceResult
from vitlens.views.distance import AttentionDistanceAccumulator
from view_references import forward_with_feeds

NAME = "vitlens_test_tiny_cait"
DEPTH, TOKEN_ONLY, HEADS, GRID, STRIDE = 2, 2, 2, (4, 4), 8


def tiny_cait(fused: bool = False, global_pool: str = "token") -> torch.nn.Module:
    """2 talking-heads blocks and 2 class-attention layers on a 4x4 grid of 8 px patches, with large random q/k and
    head-mixing weights (and layer scales of 1) so the attention is far from uniform and each block matters."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("cait_xxs24_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=DEPTH, num_heads=HEADS, depth_token_only=TOKEN_ONLY, num_classes=5,
                              init_values=1.0, global_pool=global_pool).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.5, generator=g)
            block.attn.proj_l.weight.normal_(0.0, 1.0, generator=g)
            block.attn.proj_w.weight.normal_(0.0, 1.0, generator=g)
            block.attn.proj_w.bias.normal_(0.0, 0.5, generator=g)
        for block in model.blocks_token_only:
            block.attn.q.weight.normal_(0.0, 0.5, generator=g)
            block.attn.k.weight.normal_(0.0, 0.5, generator=g)
            block.attn.fused_attn = fused
    return model


def images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def talking_heads_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A TalkingHeadAttn's softmax written out in float64 from its weights: softmax over keys of
    proj_l(q * scale @ k^T) (proj_l mixes the heads before the softmax), [B, heads, N, N]."""
    b, n, c = x.shape
    qkv = torch.nn.functional.linear(x.double(), attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    scores = (q * attn.scale) @ k.transpose(-2, -1)  # [B, h, N, N]
    mixed = torch.einsum("gh,bhqk->bgqk", attn.proj_l.weight.double(), scores) + \
        attn.proj_l.bias.double()[None, :, None, None]
    return mixed.softmax(-1)


def class_attention_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A ClassAttn's attention written out in float64: the class token's query over every token,
    softmax(q(x_cls) * scale @ k(x)^T), [B, heads, 1, 1 + N]."""
    b, n, c = x.shape
    h = attn.num_heads
    q = torch.nn.functional.linear(x[:, :1].double(), attn.q.weight.double(),
                                   None if attn.q.bias is None else attn.q.bias.double())
    k = torch.nn.functional.linear(x.double(), attn.k.weight.double(),
                                   None if attn.k.bias is None else attn.k.bias.double())
    q = q.reshape(b, 1, h, -1).transpose(1, 2)
    k = k.reshape(b, n, h, -1).transpose(1, 2)
    return ((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1)


def capture_with_feeds(model: torch.nn.Module, x: torch.Tensor, mode: str) -> tuple:
    """(plain output, output under capture, captured maps, what each attention module was fed)."""
    m = vl.LoadedModel.from_module(model, name="tiny-cait")
    return forward_with_feeds(m, m.family.attention_modules(model), x, mode)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_each_blocks_own_attention_and_leaves_the_outputs(fused, mode):
    model = tiny_cait(fused=fused)
    plain, out, maps, feeds = capture_with_feeds(model, images(), mode)
    if mode == "side" or not fused:
        assert torch.equal(out, plain)  # the talking heads' own tensor read; the class attention's path kept
    else:
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)  # inline: the non-fused class attention
    assert len(maps) == len(feeds) == DEPTH + TOKEN_ONLY
    for block, feed, got in zip(model.blocks, feeds[:DEPTH], maps[:DEPTH]):
        want = talking_heads_probs(block.attn, feed)
        assert got.shape == (3, HEADS, 16, 16) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    for block, feed, got in zip(model.blocks_token_only, feeds[DEPTH:], maps[DEPTH:]):
        want = class_attention_probs(block.attn, feed)
        assert got.shape == (3, HEADS, 1, 17)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    # as the family's definition says: not uniform, and the post-softmax mixing is no distribution
    assert max(float((p - 1.0 / p.shape[-1]).abs().max()) for p in maps) > 0.1
    mixed = model.blocks[0].attn.proj_w(maps[0].permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert float(mixed.min()) < 0 and float((mixed.sum(-1) - 1).abs().max()) > 1e-2


def test_the_spec_and_every_blocks_kind_and_tokens():
    m = vl.LoadedModel.from_module(tiny_cait(), name="tiny-cait")
    s = m.spec
    assert (s.kind, s.family, s.num_layers, s.num_heads, s.grid, s.stride_px) == (
        "class-attention", "timm-cait", DEPTH + TOKEN_ONLY, HEADS, GRID, (STRIDE, STRIDE))
    assert s.num_prefix_tokens == 1 and s.has_class_token and s.pos_embed_prefix == 0
    assert "class-attention" in s.describe()["kind"]
    layout = m.family.block_layout(m.model)
    assert [b["kind"] for b in layout] == ["global"] * DEPTH + ["class-attention"] * TOKEN_ONLY
    assert layout[0]["queries"] == layout[0]["keys"] == "4x4 patch grid"
    assert layout[-1]["queries"] == "the class token" and "class token + the 4x4" in layout[-1]["keys"]


def numpy_distance(maps: list[torch.Tensor]) -> np.ndarray:
    """Mean over images of each self-attention head's distance: mean over patch queries of
    sum_k A d / sum_k A, float64 numpy, [DEPTH, HEADS]."""
    rows, cols = np.meshgrid(np.arange(GRID[0]), np.arange(GRID[1]), indexing="ij")
    pos = np.stack([rows.ravel(), cols.ravel()], -1) * STRIDE
    d = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1))
    out = []
    for a in maps[:DEPTH]:
        a = a.double().numpy()
        per_query = (a * d).sum(-1) / a.sum(-1)  # [B, H, N]
        out.append(per_query.mean(-1).mean(0))
    return np.stack(out)


def test_distance_is_the_numpy_reference_over_the_self_attention_blocks(tmp_path):
    model = tiny_cait()
    m = vl.LoadedModel.from_module(model, name="tiny-cait")
    x = images()
    _plain, _out, maps, _feeds = capture_with_feeds(model, x, "side")
    d = vl.attention_distance(m, x, batch_size=2)  # two batches: the moments merge
    assert isinstance(d, ClassAttentionDistanceResult) and d.mean_px.shape == (DEPTH, HEADS)
    np.testing.assert_allclose(d.mean_px, numpy_distance(maps), rtol=1e-5)
    assert d.block_kinds == ("global",) * DEPTH + ("class-attention",) * TOKEN_ONLY
    assert "class token" in d.note and "no position in the image" in d.note and d.note in d.summary()
    assert len(d.to_rows()) == DEPTH * HEADS and {r["attention"] for r in d.to_rows()} == {"global"}
    again = vl.load_result(d.save(tmp_path / "d.json"))
    assert isinstance(again, ClassAttentionDistanceResult) and again.block_kinds == d.block_kinds
    np.testing.assert_allclose(again.mean_px, d.mean_px)
    from vitlens.figures import figure_for

    assert "class-attention layers" in figure_for(d).layout.title.text


def dense_rollout(maps: list[torch.Tensor], fusion: str = "mean", from_class_token: bool = True) -> np.ndarray:
    """The brute-force rollout: every block as an explicit (1 + N) x (1 + N) token-to-token matrix over
    [class token, patches], multiplied first block first; [B, gh, gw], max-normalised.

    A self-attention block: the class token (not yet in the sequence) maps to itself, the patches by
    (A + I) / rowsum(A + I). A class-attention layer: the class row (a + e_cls) / rowsum, the patches the identity.
    The source row is the class token's (its own column, the learned token, dropped), or the mean of the patches'.
    """
    fuse = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    b, n = maps[0].shape[0], maps[0].shape[-1]
    out = []
    for i in range(b):
        r = np.eye(1 + n)
        for layer, a in enumerate(maps):
            dense = np.zeros((1 + n, 1 + n))
            f = fuse(a[i].double().numpy(), axis=0)
            if layer < DEPTH:
                dense[1:, 1:] = f
            else:
                dense[0] = f[0]
            dense = dense + np.eye(1 + n)
            r = (dense / dense.sum(-1, keepdims=True)) @ r
        row = r[0, 1:] if from_class_token else r[1:, 1:].mean(0)
        out.append((row / row.max()).reshape(GRID))
    return np.stack(out)


@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_rollout_is_the_brute_force_dense_composition(fusion):
    model = tiny_cait()
    m = vl.LoadedModel.from_module(model, name="tiny-cait")
    x = images()
    _plain, _out, maps, _feeds = capture_with_feeds(model, x, "side")
    r = vl.attention_rollout(m, x, head_fusion=fusion, batch_size=2)
    assert r.maps.shape == (3, *GRID) and "class token" in r.source_token
    np.testing.assert_allclose(r.maps, dense_rollout(maps, fusion), rtol=0, atol=1e-6)
    # the class-attention layers' rows matter: with uniform ones in their place the map would differ
    uniform = [torch.full_like(a, 1.0 / a.shape[-1]) for a in maps[DEPTH:]]
    assert np.abs(r.maps - dense_rollout(maps[:DEPTH] + uniform, fusion)).max() > 1e-3
    with pytest.raises(vl.InvalidParameterError, match="discard_ratio"):
        vl.attention_rollout(m, x, discard_ratio=0.1)
    with pytest.raises(vl.ViewNotAvailableError, match="class token"):
        vl.attention_rollout(m, x, source="pool")


def test_an_average_pooled_cait_rolls_out_from_the_mean_of_the_patches():
    model = tiny_cait(global_pool="avg")
    m = vl.LoadedModel.from_module(model, name="tiny-cait-avg")
    x = images(2)
    _plain, _out, maps, _feeds = capture_with_feeds(model, x, "side")
    r = vl.attention_rollout(m, x)
    assert "mean over patch tokens" in r.source_token
    np.testing.assert_allclose(r.maps, dense_rollout(maps, from_class_token=False), rtol=0, atol=1e-6)


def test_analyze_gives_every_view_defined_for_a_cait_and_refuses_the_others_in_one_line():
    from vitlens.views.registry import available_views

    m = vl.LoadedModel.from_module(tiny_cait(), name="tiny-cait")
    x = images(2)
    assert "prefix" not in available_views(m)
    a = vl.analyze(m, x, n_components=4, views=available_views(m))
    assert isinstance(a.distance, ClassAttentionDistanceResult) and a.rollout.maps.shape == (2, *GRID)
    assert a.filters is not None and a.position is not None and a.position.grid == GRID  # pos_embed over patches
    assert "relpos" in a.notes
    for refused in (lambda: vl.attention_maps(m, x), lambda: vl.attribute(m, x, "gradcam"),
                    lambda: vl.attribute(m, x, "grad_rollout"),
                    lambda: vl.head_importance(m, x), lambda: vl.analyze(m, x, views=("prefix",))):
        with pytest.raises(vl.UnsupportedModelError, match="class-attention") as err:
            refused()
        assert "\n" not in str(err.value)
    with pytest.raises(vl.UnsupportedModelError, match="AttentionDistanceAccumulator"):
        vl.stream_attention(m, x, [AttentionDistanceAccumulator.for_model(m.spec)])
    # CKA compares representations: why a CaiT's blocks are not compared, and (in the app) the app's own views
    with pytest.raises(vl.UnsupportedModelError, match="CKA compares.*representations.*class token alone") as err:
        vl.cka(m, vl.load_model("ref-vit"), images(4))
    app_text = err.value.message_for("app")
    assert "Attention distance and Attention maps views" in app_text and "vl." not in app_text


def test_a_cait_has_the_input_methods_and_its_own_rollout_as_attributions():
    """Methods defined for any differentiable model (captum's input methods) run on a CaiT and equal captum called
    directly; the rollout attribution is the class-token rollout; the rest are refused (test above)."""
    from captum.attr import Saliency

    from vitlens.attribution.methods import methods_for
    from vitlens.core.resample import pixels_to_grid

    m = vl.LoadedModel.from_module(tiny_cait(), name="tiny-cait")
    x = images(2)
    assert {"saliency", "integrated_gradients", "rollout"} <= set(methods_for(m))
    assert not {"gradcam", "grad_rollout", "attnlrp"} & set(methods_for(m))
    got = vl.attribute(m, x, "saliency")
    target = m.model(x).argmax(-1)
    grads = Saliency(m.model).attribute(x.clone().requires_grad_(True), target=target, abs=True)
    assert got.maps.shape == (2, *GRID)
    # the same float32 forward and backward on both sides: equal up to the order of float32 sums
    np.testing.assert_allclose(got.maps, pixels_to_grid(grads, GRID), rtol=1e-5, atol=1e-6 * float(got.maps.max()))
    direct = vl.attention_rollout(m, x)
    np.testing.assert_allclose(vl.attribute(m, x, "rollout").maps, direct.maps, rtol=1e-6)


def _register() -> None:
    import timm
    from timm.models import register_model
    from timm.models.cait import _create_cait

    if NAME in timm.list_models(NAME):
        return

    @register_model
    def vitlens_test_tiny_cait(pretrained: bool = False, **kwargs):  # noqa: ANN202 (timm's entry point)
        kwargs.setdefault("num_classes", 5)
        return _create_cait("cait_xxs24_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                            depth=DEPTH, num_heads=HEADS, depth_token_only=TOKEN_ONLY, init_values=1.0, **kwargs)


def test_report_and_compare_draw_a_cait_beside_a_vit(tmp_path):
    from vitlens import figures
    from vitlens.cli import main
    from vitlens.report.data import comparison
    from vitlens.report.html import model_figures

    _register()
    cait = vl.load_model(NAME, pretrained=False)
    assert cait.family.name == "timm-cait"
    vit = vl.load_model("ref-vit")
    pictures = vl.sample_images()[:2]
    data = comparison([vl.attention_distance(vit, pictures), vl.attention_distance(cait, pictures)],
                      ["ref-vit", NAME], kinds=["vit", "class-attention"])
    fig = figures.distance_figure(data.distances, names=data.models, units=data.units)
    assert any(t.name == NAME for t in fig.data) and "class-attention layers" in fig.layout.title.text
    a = vl.analyze(cait, pictures)
    figs = model_figures(a, [np.asarray(i) for i in cait.display(pictures)])
    assert {"filters", "position", "distance", "rollout"} <= set(figs)
    out = tmp_path / "r.html"
    assert main(["report", "--model", NAME, "--random-init", "--samples", "--n-images", "2", "--out", str(out),
                 "--quiet"]) == 0
    assert out.exists() and "class-attention" in out.read_text()
    cmp = tmp_path / "cmp.html"
    assert main(["compare", "--models", "ref-vit", NAME, "--random-init", "--n-images", "2", "--out", str(cmp),
                 "--quiet"]) == 0
    assert vl.load_result(cmp.with_suffix(".json")).kinds == ["vit", "class-attention"]


def test_a_cait_in_the_app_shows_its_views_and_refuses_the_rest_in_one_line():
    from streamlit.testing.v1 import AppTest

    from test_app import APP, problems

    _register()
    app = AppTest.from_file(APP, default_timeout=120)
    app.run()
    app.slider(key="n-shapes").set_value(8).run()
    app.radio(key="m1-source").set_value("Name").run()
    app.text_input(key="m1-timm").set_value(NAME).run()
    assert problems(app) == [] and not app.error, [e.value for e in app.error]
    assert "class-attention" in app.sidebar.table[0].value.to_string()
    app.session_state["n-dist"] = 4
    app.radio(key="view").set_value("Attention distance").run()
    assert problems(app) == [] and any("no position in the image" in i.value for i in app.info)
    app.radio(key="view").set_value("Attention maps").run()
    assert problems(app) == [] and any("class token" in c.value for c in app.caption)
    app.radio(key="view").set_value("Attributions").run()
    assert problems(app) == [] and not app.error
    app.radio(key="view").set_value("Filters").run()
    assert problems(app) == []


def test_a_survey_of_a_cait_merges_exactly_and_equals_its_views():
    """A survey's statistics of a CaiT: the self-attention blocks' distance (per head, per class) and the rollout
    from the class token merge exactly across shards in any order and equal one process's views."""
    from vitlens.survey import shapes_source
    from vitlens.survey.sources import Shard
    from vitlens.survey.stats import merge
    from vitlens.survey.store import distance_result, table_rows
    from vitlens.survey.worker import run_shard
    from vitlens.views.distance import FLOAT32_RTOL

    m = vl.LoadedModel.from_module(tiny_cait(), name="tiny-cait")
    source, n, views = shapes_source(5), 5, ("distance", "rollout", "predictions")
    # one image a batch everywhere: an image's float32 maps then do not depend on the images beside it in its batch
    whole = run_shard(m, source, Shard(0, 0, n), views, batch_size=1)["states"]
    parts = [run_shard(m, source, s, views, batch_size=1)["states"] for s in source.shards(2)]
    for order in (parts, parts[::-1]):
        merged = order[0]
        for p in order[1:]:
            merged = merge(merged, p)
        np.testing.assert_allclose(merged["distance"]["mean"], whole["distance"]["mean"], rtol=FLOAT32_RTOL)
        np.testing.assert_allclose(merged["rollout"]["sums"], whole["rollout"]["sums"], rtol=1e-6)
    images_, _labels, _masks, _skipped = source.read(Shard(0, 0, n))
    direct = vl.attention_distance(m, images_, batch_size=1)
    surveyed = distance_result(whole, m.spec.to_dict(), "tiny-cait")
    assert surveyed.mean_px.shape == direct.mean_px.shape  # the self-attention blocks only
    # the worker's plan may read the maps by blocks of rows: the same numbers within the float32 bound
    np.testing.assert_allclose(surveyed.mean_px, direct.mean_px, rtol=FLOAT32_RTOL)
    rows = table_rows("tiny-cait", m.spec.to_dict(), whole, n, list(source.classes), {})
    assert max(r["layer"] or 0 for r in rows) == direct.mean_px.shape[0]
    assert whole["rollout"]["counts"][1] == n  # the entropy of every image's rollout over the patches
