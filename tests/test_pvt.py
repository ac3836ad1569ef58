"""Hugging Face PVT v1 and PVT v2 (spatial-reduction attention: keys pooled by a strided convolution, or v2's linear
7x7 adaptive pooling; a strided patch embedding at each stage; v1's class token in its last stage): the capture
against each block's attention written out here in float64 from its weights and against the model's own
``output_attentions``, the outputs bit-identical with capture on, the grids, centres and transports against
hand-written poolings, the distance in pixels against a dense float64 computation whose key grid is not the query
grid, and the rollout against a brute-force composition of dense matrices with the stated transports (the keys'
pooling, the stage embeddings) written out here."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from vitlens.views.distance import FLOAT32_RTOL
from vitlens.views.windowed import WindowedDistanceResult

transformers = pytest.importorskip("transformers")

#: the tiny models: 64 px, stages of 16x16, 8x8, 4x4, 2x2 tokens (strides 4, 8, 16, 32), depths 1, 2, 1, 1
TINY = dict(image_size=64, hidden_sizes=[8, 16, 16, 16], depths=[1, 2, 1, 1], num_attention_heads=[1, 2, 2, 2],
            mlp_ratios=[2, 2, 2, 2])


def tiny_pvt(version: str = "v2", classifier: bool = True, seed: int = 0, **cfg) -> torch.nn.Module:
    """A tiny random PVT (``version`` "v1" or "v2"), keys reduced by 4, 2, 1, 1, with large random query and key
    weights so the attention is far from uniform."""
    torch.manual_seed(seed)
    if version == "v1":
        config = transformers.PvtConfig(**TINY, sequence_reduction_ratios=[4, 2, 1, 1], num_labels=5, **cfg)
        cls = transformers.PvtForImageClassification if classifier else transformers.PvtModel
    else:
        config = transformers.PvtV2Config(**TINY, sr_ratios=[4, 2, 1, 1], num_labels=5, **cfg)
        cls = transformers.PvtV2ForImageClassification if classifier else transformers.PvtV2Model
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in self_attentions(model):
            for lin in (attn.query, attn.key):
                lin.weight.normal_(0.0, 0.6, generator=g)
    return model


def self_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = ("PvtEfficientSelfAttention", "PvtV2SelfAttention")
    return [mod for mod in model.modules() if type(mod).__name__ in names]


def load(model: torch.nn.Module) -> vl.LoadedModel:
    return vl.LoadedModel.from_module(model, name="tiny-pvt")


def images(n: int = 3, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def recording_attention_inputs(model: torch.nn.Module) -> tuple[list, list]:
    """Hooks that record what every block's self-attention is fed in a forward: (hidden states, height, width)."""
    feeds: list = []

    def hook(_m, args, kwargs):
        names = ("hidden_states", "height", "width")
        values = list(args) + [kwargs[n] for n in names[len(args):]]
        feeds.append(tuple(values[:3]))

    hooks = [a.register_forward_pre_hook(hook, with_kwargs=True) for a in self_attentions(model)]
    return feeds, hooks


def reference_probs(attn: torch.nn.Module, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The block's spatial-reduction attention written out in float64 from its weights: q from the tokens, k from
    the tokens reduced (a strided convolution then LayerNorm; v2 linear: a 7x7 adaptive average pool, a 1x1
    convolution, LayerNorm, GELU), softmax(q k^T / sqrt(d)), [B, heads, Nq, Nk]."""
    x = x.double()
    b, n, c = x.shape
    heads = attn.num_attention_heads
    q = F.linear(x, attn.query.weight.double(), attn.query.bias.double())
    kv = x
    ratio = getattr(attn, "sequences_reduction_ratio", getattr(attn, "spatial_reduction_ratio", 1))
    linear = getattr(attn, "linear_attention", False)
    if linear or ratio > 1:
        conv = attn.sequence_reduction if hasattr(attn, "sequence_reduction") else attn.spatial_reduction
        grid = x.transpose(1, 2).reshape(b, c, h, w)
        if linear:
            grid = F.adaptive_avg_pool2d(grid, 7)
        grid = F.conv2d(grid, conv.weight.double(), conv.bias.double(), stride=conv.stride)
        kv = F.layer_norm(grid.flatten(2).transpose(1, 2), (c,), attn.layer_norm.weight.double(),
                          attn.layer_norm.bias.double(), attn.layer_norm.eps)
        kv = F.gelu(kv) if linear else kv
    k = F.linear(kv, attn.key.weight.double(), attn.key.bias.double())
    q, k = (t.reshape(b, -1, heads, c // heads).transpose(1, 2) for t in (q, k))
    return (q @ k.transpose(-2, -1) / (c // heads) ** 0.5).softmax(-1)


def pool_matrix(fine: tuple[int, int], kernel: int, stride: int, padding: int) -> np.ndarray:
    """[coarse tokens, fine tokens]: each pooled token the mean of the fine tokens its kernel covers inside the grid,
    written out (the stated transport of a reduction or a stage embedding)."""
    h, w = fine
    oh, ow = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    out = np.zeros((oh * ow, h * w))
    for i in range(oh):
        for j in range(ow):
            cells = [(y, x) for y in range(i * stride - padding, i * stride - padding + kernel)
                     for x in range(j * stride - padding, j * stride - padding + kernel) if 0 <= y < h and 0 <= x < w]
            for y, x in cells:
                out[i * ow + j, y * w + x] = 1.0 / len(cells)
    return out


def adaptive_matrix(fine: tuple[int, int], size: int = 7) -> np.ndarray:
    """[size * size, fine tokens]: PyTorch's own adaptive average pooling applied to every one-hot grid."""
    n = fine[0] * fine[1]
    basis = torch.eye(n, dtype=torch.float64).reshape(n, 1, *fine)
    return F.adaptive_avg_pool2d(basis, size).reshape(n, -1).T.numpy()


GRIDS = [(16, 16), (8, 8), (4, 4), (2, 2)]
STRIDES = [4, 8, 16, 32]
#: each block's stage, its keys' pooling (kernel, stride, padding) or None, whether it starts its stage
BLOCKS = [(0, (4, 4, 0), True), (1, (2, 2, 0), True), (1, (2, 2, 0), False), (2, None, True), (3, None, True)]
#: each version's stage embeddings after the first (kernel, stride, padding): v1 plain, v2 overlapping
EMBEDDINGS = {"v1": (2, 2, 0), "v2": (3, 2, 1), "v2-linear": (3, 2, 1)}


def hand_geometry(version: str) -> list[dict]:
    """Each block's grids, query and key centres in pixels and its transports, written out: a stage's tokens at
    (r + 0.5) x its stride, a key at the mean of the centres of the tokens its pooling covers."""
    out = []
    for stage, key_pool, first in BLOCKS:
        grid, s = GRIDS[stage], STRIDES[stage]
        ys, xs = np.meshgrid((np.arange(grid[0]) + 0.5) * s, (np.arange(grid[1]) + 0.5) * s, indexing="ij")
        centres = np.stack([ys.ravel(), xs.ravel()], 1)
        n = grid[0] * grid[1]
        if version == "v2-linear":
            kp = adaptive_matrix(grid)
        else:
            kp = np.eye(n) if key_pool is None else pool_matrix(grid, *key_pool)
        emb = pool_matrix(GRIDS[stage - 1], *EMBEDDINGS[version]) if first and stage else None
        out.append(dict(stage=stage, grid=grid, q_centres=centres, k_centres=kp @ centres, kp=kp, emb=emb,
                        prefix=int(version == "v1" and stage == 3), pooled=version == "v2-linear" or bool(key_pool)))
    return out


def build(version: str, **kw) -> torch.nn.Module:
    if version == "v2-linear":
        return tiny_pvt("v2", linear_attention=True, **kw)
    return tiny_pvt(version, **kw)


VERSIONS = ["v1", "v2", "v2-linear"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_grids_centres_and_transports_are_the_hand_written_poolings(version):
    m = load(build(version))
    assert m.spec.kind == "hierarchical" and m.family.name == "hf-pvt"
    assert m.spec.image_size == (64, 64) and m.spec.grid == (16, 16) and m.spec.stride_px == (4, 4)
    windows = m.family.windows(m.model, m.spec.image_size)
    hand = hand_geometry(version)
    assert len(windows) == len(hand) == 5
    for g, want in zip(windows, hand):
        p = want["prefix"]
        assert (g.stage, g.grid, g.stride_px, g.in_grid, g.prefix_tokens) == (
            want["stage"], want["grid"], (STRIDES[want["stage"]],) * 2, want["grid"], p)
        assert g.kind == ("pooled" if want["pooled"] else "global")
        assert g.num_windows == 1 and g.allowed.all()
        nq, nk = want["kp"].shape[1], want["kp"].shape[0]
        np.testing.assert_array_equal(g.index, np.r_[[-1] * p, np.arange(nq)][None])
        np.testing.assert_array_equal(g.keys, np.r_[[-1] * p, np.arange(nk)][None])
        assert g.keys_grid[0] * g.keys_grid[1] == nk
        np.testing.assert_allclose(g.query_centres, want["q_centres"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(g.key_centres, want["k_centres"], rtol=0, atol=1e-12)
        kp = np.eye(nq) if g.key_from is None else g.key_from.dense()
        np.testing.assert_allclose(kp, want["kp"], rtol=0, atol=1e-15)
        assert g.query_from is None  # the residual is the identity
        if want["emb"] is None:
            assert g.stage_from is None
        else:
            np.testing.assert_allclose(g.stage_from.dense(), want["emb"], rtol=0, atol=1e-15)
    assert [g.keys_grid for g in windows] == (
        [(7, 7)] * 5 if version == "v2-linear" else [(4, 4), (4, 4), (4, 4), (4, 4), (2, 2)])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_the_blocks_own_attention_and_leaves_the_outputs(version, mode):
    model = build(version)
    m = load(model)
    x = images()
    with torch.no_grad():
        plain = model(x).logits
        own = model(x, output_attentions=True).attentions  # the model's own eager attention
        feeds, hooks = recording_attention_inputs(model)
        with vl.capture_attention(m, mode=mode) as cap:
            out = model(x).logits
        for h in hooks:
            h.remove()
    assert torch.equal(out, plain)  # bit for bit: both modes read the model's own probabilities
    own = [a for stage in own for a in (stage if isinstance(stage, tuple) else (stage,))]  # v2: per stage
    windows = m.family.windows(m.model, m.spec.image_size)
    assert len(cap.maps) == len(feeds) == len(own) == len(windows) == 5
    for attn, (feed, h, w), got, theirs, g in zip(self_attentions(model), feeds, cap.maps, own, windows):
        want = reference_probs(attn, feed, h, w)
        assert got.shape == (3, attn.num_attention_heads, g.window_tokens, g.key_tokens) == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        assert torch.equal(got, theirs)
    assert max(float(p.max()) for p in cap.maps) > 0.5  # far from uniform


def test_inline_capture_without_detach_hands_over_the_probabilities_the_output_is_computed_from():
    model = tiny_pvt("v1")
    m = load(model)
    x = images(1).requires_grad_(True)
    with vl.capture_attention(m, mode="inline", detach=False) as cap:
        out = model(x).logits
    assert all(p.requires_grad for p in cap.maps)
    grad = torch.autograd.grad(out[0, 0], cap.maps[-1])[0]
    assert grad.abs().sum() > 0  # the output depends on the captured maps


@pytest.mark.parametrize("version", VERSIONS)
def test_distance_in_pixels_equals_a_dense_float64_computation(version, tmp_path):
    """``vl.attention_distance`` against float64 over each block's dense [query tokens, key tokens] maps (the class
    token's row and column left out, the weights renormalised over the grid's keys) and the pixel distances
    between the hand-placed centres (key grid != query grid); the uniform distance against even attention over
    the grid's keys."""
    m = load(build(version))
    x = images(3)
    got = vl.attention_distance(m, x)
    assert isinstance(got, WindowedDistanceResult) and got.n_images == 3
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    for layer, (probs, hand) in enumerate(zip(cap.maps, hand_geometry(version))):
        p = hand["prefix"]
        d = np.linalg.norm(hand["q_centres"][:, None] - hand["k_centres"][None], axis=-1)  # [Tq, Tk]
        a = probs.double().numpy()[:, :, p:, p:]  # [B, heads, Tq, Tk] on the grids
        per_image = ((a * d).sum(-1) / a.sum(-1)).mean(-1)
        heads = a.shape[1]
        np.testing.assert_allclose(got.mean_px[layer, :heads], per_image.mean(0), rtol=FLOAT32_RTOL, atol=1e-12)
        np.testing.assert_allclose(got.std_px[layer, :heads], per_image.std(0), rtol=1e-8, 
                                   atol=max(1e-10, FLOAT32_RTOL * per_image.max()))
        assert np.isnan(got.mean_px[layer, heads:]).all()
        assert got.window_uniform_px[layer] == pytest.approx(d.mean(), rel=1e-12)
    assert got.stages.tolist() == [0, 1, 1, 2, 3]
    kinds = ("pooled",) * 5 if version == "v2-linear" else ("pooled", "pooled", "pooled", "global", "global")
    assert got.kinds == kinds
    assert np.nanmax(got.of_window) - np.nanmin(got.of_window) > 0.05  # peaky weights: heads differ
    rows = got.to_rows()
    keys = ["7x7"] * 5 if version == "v2-linear" else ["4x4", "4x4", "4x4", "4x4", "2x2"]
    assert [(r["queries"], r["keys"]) for r in rows if r["head"] == 1] == list(zip(
        ["16x16", "8x8", "8x8", "4x4", "2x2"], keys))
    again = vl.load_result(got.save(tmp_path / "distance.json"))
    assert again.equals(got) and again.to_rows() == rows


def test_known_answer_zero_queries_give_the_uniform_distance_over_the_pooled_keys():
    """With q = 0 (zero query weights and biases) every score is 0: each query spreads evenly over its keys, exactly
    the uniform distance (v1's class token, left out, holds as much as any key)."""
    for version in ("v1", "v2"):
        model = build(version)
        with torch.no_grad():
            for attn in self_attentions(model):
                attn.query.weight.zero_(), attn.query.bias.zero_()
        got = vl.attention_distance(load(model), images(2))
        np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=1.0), 1.0, rtol=0, atol=FLOAT32_RTOL)


def brute_force_rollout(maps: list[torch.Tensor], hand: list[dict], i: int) -> np.ndarray:
    """Image ``i``'s rollout by dense matrices: per block (A K + I) / rowsum over the block's tokens (v1's class
    token first in its last stage, where K is the identity), K the keys' pooling written out; the source the class
    token (v1) or the mean over the last stage's tokens (v2); at each stage's first block the stage embedding E
    (each embedded token the mean of the tokens its kernel covers) carries the row back onto the previous stage's
    tokens, the class token's share dropped there (it enters as a parameter)."""
    last = hand[-1]
    n = last["kp"].shape[1] + last["prefix"]
    v = np.zeros(n)
    if last["prefix"]:
        v[0] = 1.0
    else:
        v[:] = 1.0 / n
    for probs, g in reversed(list(zip(maps, hand))):
        a = probs[i].mean(0).double().numpy()  # heads fused by their mean
        p = g["prefix"]
        k = np.zeros((p + g["kp"].shape[0], p + g["kp"].shape[1]))
        k[:p, :p] = np.eye(p)
        k[p:, p:] = g["kp"]
        mix = a @ k + np.eye(a.shape[0])
        v = v @ (mix / mix.sum(1, keepdims=True))
        if g["emb"] is not None:
            v = v[p:] @ g["emb"]
    return v


@pytest.mark.parametrize("version", VERSIONS)
def test_rollout_through_the_poolings_and_stage_embeddings_equals_a_brute_force_dense_composition(version):
    m = load(build(version))
    x = images(2)
    got = vl.attention_rollout(m, x)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    hand = hand_geometry(version)
    want = np.zeros((2, 16, 16))
    for i in range(2):
        v = brute_force_rollout(cap.maps, hand, i)
        want[i] = v.reshape(16, 16) / v.max()
    np.testing.assert_allclose(got.maps, want, rtol=1e-10, atol=1e-12)
    assert got.grid == (16, 16) and got.image_size == (64, 64) and "stage embeddings (stated transport" in got.source_token
    assert got.source_token.startswith("the class token" if version == "v1" else "mean over the last stage's tokens")


def test_the_rollout_source_without_a_classifier_is_what_the_model_hands_on():
    """A ``PvtModel``'s output read as its class token, a ``PvtV2Model``'s as the mean of its last stage: the
    sources the rollouts start from."""
    x = images(1)
    for version in ("v1", "v2"):
        model = tiny_pvt(version, classifier=False)
        m = load(model)
        assert m.spec.num_classes == 0
        with torch.no_grad():
            last = model(pixel_values=x).last_hidden_state
            want = last[:, 0] if version == "v1" else last.flatten(2).mean(-1)
            assert torch.equal(m.logits(x), want)
        assert vl.attention_rollout(m, x).maps.shape == (1, 16, 16)


def test_one_querys_attention_is_on_its_pooled_keys():
    from vitlens.views.windowed_rollout import query_window_attention, window_maps

    m = load(tiny_pvt("v1"))
    x = images(1)
    maps = window_maps(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    got = query_window_attention(maps[1], windows[1], 3, 5)  # stage 1: 8x8 queries over 4x4 keys
    assert got.shape == (2, 4, 4)
    np.testing.assert_allclose(got.reshape(2, -1), maps[1][0, :, 3 * 8 + 5].double().numpy())
    last = query_window_attention(maps[-1], windows[-1], 1, 0)  # the class-token stage: the grid's keys shown
    np.testing.assert_allclose(last.reshape(2, -1), maps[-1][0, :, 1 + 2, 1:].double().numpy())


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_analyze_and_the_html_report_run(version):
    from vitlens.report.data import ReportData, distance_reading
    from vitlens.report.html import model_figures, report_html

    m = load(tiny_pvt(version))
    x = images(2)
    a = vl.analyze(m, x)
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 16, 16)
    assert a.filters is not None
    if version == "v1":
        assert a.position is not None
    else:
        assert a.position is None and "depthwise convolution" in a.position_note
    shown = [np.asarray(i) for i in m.display(x)]
    figs = model_figures(a, shown)
    assert {"filters", "distance", "rollout"} <= set(figs)
    assert "stage 4" in distance_reading(a.distance, "tiny-pvt")
    data = ReportData(models=["tiny-pvt"], analyses=[a], image_set={"count": 2}, environment={})
    page = report_html(data, [shown])
    assert "<h2>tiny-pvt</h2>" in page and "stage 4: median head" in page


def test_a_vit_view_is_refused_in_one_line():
    m = load(tiny_pvt("v2"))
    with pytest.raises(vl.UnsupportedModelError, match="attention_maps.*hierarchical"):
        vl.attention_maps(m, images(1))


def test_loads_by_hf_name_and_refuses_what_it_does_not_read(tmp_path):
    from vitlens.loading.external import sdpa_request

    for version in ("v1", "v2"):
        model = tiny_pvt(version)
        model.save_pretrained(tmp_path / version)
        assert sdpa_request(model.config) == {}  # their one implementation, eager: none other is asked for
        m = vl.load_model(f"hf:{tmp_path / version}", device="cpu")
        assert m.family.name == "hf-pvt" and m.spec.kind == "hierarchical" and m.spec.num_classes == 5
        assert m.data_config["mean"] == (0.485, 0.456, 0.406)
        x = images(1)
        saved, read = model.state_dict(), m.model.state_dict()
        assert saved.keys() == read.keys() and all(torch.equal(saved[k], read[k]) for k in saved)  # the saved weights
        with torch.no_grad():
            ours, theirs = m.logits(x), model(x).logits
            assert torch.equal(ours, m.model(x).logits)  # vitlens's logits are the loaded module's own forward
        # two module objects with the same weights may round differently on some CPUs (seen: 3.7e-9 apart, its
        # BLAS's paths depend on the tensors' memory): within float32's rounding of this shallow net, ~100 ulps
        torch.testing.assert_close(ours, theirs, rtol=0, atol=100 * torch.finfo(torch.float32).eps * theirs.abs().max())
    backbone = transformers.PvtV2Backbone(transformers.PvtV2Config(**TINY, sr_ratios=[4, 2, 1, 1]))
    with pytest.raises(vl.UnsupportedModelError, match="PvtV2Backbone") as err:
        vl.LoadedModel.from_module(backbone)
    assert "\n" not in str(err.value)
    # PVT v1 with a reduction in its class-token stage: transformers' own forward cannot run it
    bad = transformers.PvtModel(transformers.PvtConfig(**TINY, sequence_reduction_ratios=[4, 2, 1, 2]))
    with pytest.raises(vl.UnsupportedModelError, match="class token") as err:
        vl.LoadedModel.from_module(bad)
    assert "\n" not in str(err.value)


def test_gradcam_of_pvt_v2_reads_its_last_stages_final_norm_and_pvt_v1_refuses_cams_in_one_line():
    """PVT v2: Grad-CAM on the last stage's 2x2 grid (32 px cells) from the final norm of that stage, which the
    classifier averages; PVT v1: the CAM refused in one line (its classifier reads the class token alone), its
    input methods and rollout kept."""
    m = load(tiny_pvt("v2"))
    x = images(1)
    r = vl.attribute(m, x, method="gradcam")
    assert r.params["target_layer"] == "pvt_v2.encoder.layers.3.layer_norm"
    assert r.grid == (2, 2) and tuple(r.stride_px) == (32, 32) and np.isfinite(r.maps).all()
    v1 = load(tiny_pvt("v1"))
    with pytest.raises(vl.ViewNotAvailableError, match="class token") as err:
        vl.attribute(v1, x, method="gradcam")
    assert "\n" not in str(err.value)
    assert vl.attribute(v1, x, method="rollout").maps.shape[-2:] == (16, 16)
    saliency = vl.attribute(v1, x, method="saliency")  # captum's input methods, on the first stage's grid
    assert saliency.maps.shape[-2:] == tuple(saliency.grid) == (16, 16) and np.abs(saliency.maps).sum() > 0
