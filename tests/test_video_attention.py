"""Video transformers (issue 50): VideoMAE, ViViT, V-JEPA 2 (joint space-time attention) and TimeSformer (divided)
read exactly against their own eager attention, capture leaving the outputs bit for bit; the space-time distance
against an independent computation from the maps and the layout, and on hand-built maps with known answers; rollout
through space-time against a brute-force product of dense matrices built token by token in the model's own order
(docs/definitions.md, "Video: space and time")."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import vitlens as vl  # noqa: E402
from vitlens.core.clip_layout import ClipLayout  # noqa: E402
from vitlens.errors import InvalidParameterError, UnsupportedModelError  # noqa: E402
from vitlens.kinds import VIDEO  # noqa: E402
from vitlens.engine.sources import clips_per_forward  # noqa: E402
from vitlens.views.spacetime import SpaceTimeAccumulator, joint_geometry, map_distances, rollout_clips  # noqa: E402

FRAMES, SIZE, PATCH = 4, 32, 8


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed({"videomae": 0, "vivit": 1, "vjepa2": 2, "timesformer": 3}[kind])
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, initializer_range=0.3)  # peaked maps
    if kind == "videomae":
        model = transformers.VideoMAEModel(transformers.VideoMAEConfig(
            image_size=SIZE, patch_size=PATCH, num_frames=FRAMES, tubelet_size=2, intermediate_size=64, **common))
    elif kind == "vivit":
        model = transformers.VivitModel(transformers.VivitConfig(
            image_size=SIZE, num_frames=FRAMES, tubelet_size=[2, PATCH, PATCH], intermediate_size=64, **common))
    elif kind == "vjepa2":
        model = transformers.VJEPA2Model(transformers.VJEPA2Config(
            crop_size=SIZE, patch_size=PATCH, frames_per_clip=FRAMES, tubelet_size=2, hidden_size=48,
            num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0, pred_hidden_size=32, pred_num_hidden_layers=1,
            pred_num_attention_heads=2, num_pooler_layers=1, initializer_range=0.3))
    else:
        model = transformers.TimesformerModel(transformers.TimesformerConfig(
            image_size=SIZE, patch_size=PATCH, num_frames=FRAMES, intermediate_size=64, **common))
    return model.eval()


KINDS = ("videomae", "vivit", "vjepa2", "timesformer")


@pytest.fixture(scope="module")
def clips() -> torch.Tensor:
    return torch.randn(2, FRAMES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def models() -> dict[str, vl.LoadedModel]:
    return {k: vl.LoadedModel.from_module(build(k), name=k, device="cpu") for k in KINDS}


@pytest.fixture(scope="module")
def captured(models: dict, clips: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    out = {}
    for k, m in models.items():
        with vl.capture_attention(m) as cap:
            m.logits(clips)
        out[k] = cap.maps
    return out


def pixels(kind: str, x: torch.Tensor) -> dict:
    return {"pixel_values_videos": x, "skip_predictor": True} if kind == "vjepa2" else {"pixel_values": x}


def eager_maps(m: vl.LoadedModel, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    """The model's own eager attention (``output_attentions``), the implementation put back after."""
    model = m.model
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return list(model(**pixels(kind, x), output_attentions=True).attentions)
    finally:
        model.set_attn_implementation(before)


def timesformer_temporal(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """TimeSformer's temporal probabilities written out in float64 from each block's temporal input and its own
    ``qkv`` weights (transformers does not return them)."""
    inputs: list[torch.Tensor] = []
    hooks = [layer.temporal_attention.register_forward_pre_hook(lambda _m, a: inputs.append(a[0]))
             for layer in model.encoder.layer]
    try:
        with torch.no_grad():
            model(pixel_values=x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for layer, h in zip(model.encoder.layer, inputs):
        attn = layer.temporal_attention.attention
        qkv = torch.nn.functional.linear(h.double(), attn.qkv.weight.double(),
                                         None if attn.qkv.bias is None else attn.qkv.bias.double())
        b, n, _ = h.shape
        qkv = qkv.reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        out.append(((qkv[0] @ qkv[1].transpose(-2, -1)) * attn.scale).softmax(-1))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_capture_equals_the_models_eager_attention_and_leaves_outputs_unchanged(kind, models, clips, captured):
    m = models[kind]
    with torch.no_grad():
        plain = m.model(**pixels(kind, clips)).last_hidden_state
    for mode in ("side", "inline"):
        with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():
            out = m.model(**pixels(kind, clips)).last_hidden_state
        if mode == "side":
            assert torch.equal(out, plain)  # bit for bit
        else:
            assert torch.allclose(out, plain, atol=1e-5)
        maps = cap.maps
        eager = eager_maps(m, kind, clips)
        if kind == "timesformer":
            assert len(maps) == 2 * len(eager)  # temporal, spatial per block
            spatial, temporal = maps[1::2], maps[0::2]
            assert [tuple(a.shape) for a in spatial] == [(2 * FRAMES, 2, 17, 17)] * 2
            assert [tuple(a.shape) for a in temporal] == [(2 * 16, 2, FRAMES, FRAMES)] * 2
            for got, ref in zip(temporal, timesformer_temporal(m.model, clips)):
                assert (got.double() - ref).abs().max() < 1e-5
        else:
            spatial = maps
        assert len(spatial) == len(eager)
        for got, ref in zip(spatial, eager):
            assert got.shape == ref.shape and (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_and_the_spec_say_where_each_token_stands(kind, models):
    m = models[kind]
    layout = m.family.clip_layout(m.model)
    assert m.spec.kind == VIDEO.name and m.spec.family == "hf-video"
    assert m.spec.has_pos_embed == (kind in ("vivit", "timesformer"))  # VideoMAE's is sinusoidal, V-JEPA 2's RoPE
    steps = FRAMES if kind == "timesformer" else FRAMES // 2
    assert (layout.steps, layout.grid, layout.stride_px) == (steps, (4, 4), (PATCH, PATCH))
    assert layout.num_prefix == (1 if kind in ("vivit", "timesformer") else 0)
    assert np.allclose(layout.time_centres(), np.arange(steps) * (FRAMES // steps) + (FRAMES // steps - 1) / 2)
    words = m.spec.describe()["token order"]
    assert ("map 2l is block l's temporal attention" in words) == (kind == "timesformer")
    if kind == "vivit":  # its processor's 1 / 127.5 - 1 rescale, then 0.5 / 0.5: mean 0.75, std 0.25 on [0, 1]
        frame = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
        proc = transformers.VivitImageProcessor(do_resize=False, do_center_crop=False)
        ref = np.asarray(proc([[frame]], return_tensors="np")["pixel_values"])[0, 0]
        mean, std = np.array(m.data_config["mean"]), np.array(m.data_config["std"])
        ours = ((frame / 255.0 - mean) / std).transpose(2, 0, 1)
        np.testing.assert_allclose(ours, ref, atol=1e-5)
    if kind == "timesformer":  # space-major: token 1 + cell * F + frame holds canonical 1 + frame * cells + cell
        order = layout.canonical_order()
        assert order[1 + 2 * 16 + 5] == 1 + 5 * FRAMES + 2


def independent_distances(maps: list[torch.Tensor], kind: str, layout: ClipLayout, batch: int) -> dict:
    """Each map's distances [maps, heads], token by token in the model's own order, from positions written out
    here (not the library's geometry)."""
    cells, gw, steps, tau = 16, 4, layout.steps, layout.tubelet
    p = layout.num_prefix

    def centre(step: int) -> float:
        return step * tau + (tau - 1) / 2

    def where(cell: int) -> tuple[float, float]:
        return (cell // gw) * PATCH, (cell % gw) * PATCH

    out = {"spatial": [], "temporal": [], "within": []}
    for i, a in enumerate(maps):
        a = a.double().numpy()
        role = "joint" if kind != "timesformer" else ("temporal", "spatial")[i % 2]
        heads = a.shape[1]
        res = {k: np.zeros((batch, heads)) for k in out}
        for b in range(batch):
            for h in range(heads):
                sums = {k: [] for k in out}
                if role == "joint":
                    groups = [(a[b, h, p:, p:], [(j // cells, j % cells) for j in range(steps * cells)])]
                elif role == "temporal":
                    groups = [(a[b * cells + c, h], [(s, c) for s in range(steps)]) for c in range(cells)]
                else:
                    groups = [(a[b * steps + s, h, p:, p:], [(s, c) for c in range(cells)]) for s in range(steps)]
                for w, pos in groups:
                    for q in range(len(pos)):
                        row = w[q] / w[q].sum()
                        ds = [math.dist(where(pos[q][1]), where(k[1])) for k in pos]
                        dt = [abs(centre(pos[q][0]) - centre(k[0])) for k in pos]
                        same = [k[0] == pos[q][0] for k in pos]
                        sums["spatial"].append(sum(r * d for r, d in zip(row, ds)))
                        sums["temporal"].append(sum(r * d for r, d in zip(row, dt)))
                        own = sum(r for r, s_ in zip(row, same) if s_)
                        sums["within"].append(sum(r * d for r, d, s_ in zip(row, ds, same) if s_) / own)
                for k in out:
                    res[k][b, h] = np.mean(sums[k])
        for k in out:
            out[k].append(res[k].mean(0))
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_space_time_distance_equals_an_independent_computation_within_bounds(kind, models, clips, captured):
    m = models[kind]
    layout = m.family.clip_layout(m.model)
    d = vl.attention_distance(m, clips, fps=8.0)
    ref = independent_distances(captured[kind], kind, layout, len(clips))
    np.testing.assert_allclose(d.spatial_px, ref["spatial"], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(d.temporal_frames, ref["temporal"], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(d.within_px, ref["within"], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(d.temporal_s, d.temporal_frames / 8.0)
    diagonal = math.hypot(3 * PATCH, 3 * PATCH)
    span = layout.time_centres()[-1] - layout.time_centres()[0]
    assert d.max_spatial_px == pytest.approx(diagonal) and d.max_temporal_frames == pytest.approx(span)
    assert (d.spatial_px >= 0).all() and (d.spatial_px <= diagonal).all()
    assert (d.temporal_frames >= 0).all() and (d.temporal_frames <= span).all()
    if kind == "timesformer":  # by construction: temporal maps have no spatial distance, spatial maps no temporal
        assert d.roles == ("temporal", "spatial") * 2 and d.blocks == (0, 0, 1, 1)
        assert (d.spatial_px[0::2] == 0).all() and (d.temporal_frames[1::2] == 0).all()
    assert len(d.to_rows()) == len(d.roles) * 2 and d.n_clips == 2


def one_hot_joint(layout: ClipLayout, target: callable) -> torch.Tensor:
    """A joint map [1, 1, N, N] whose each cell query puts all its weight on ``target(step, cell)``."""
    n, p, cells = layout.num_tokens, layout.num_prefix, layout.cells
    a = torch.zeros(1, 1, n, n)
    a[0, 0, :p, :p] = torch.eye(p)
    for s in range(layout.steps):
        for c in range(cells):
            ts, tc = target(s, c)
            a[0, 0, p + s * cells + c, p + ts * cells + tc] = 1.0
    return a


def test_hand_built_maps_give_their_known_distances():
    frames = ClipLayout(frames=2, tubelet=1, grid=(1, 2), stride_px=(8, 8))
    geometry = joint_geometry(frames)
    other_frame = one_hot_joint(frames, lambda s, c: (1 - s, c))  # same cell, one frame away
    d = map_distances(other_frame[:, None].double().numpy(), geometry)
    assert d["temporal"][0, 0] == 1.0 and d["spatial"][0, 0] == 0.0 and np.isnan(d["within"][0, 0])
    neighbour = one_hot_joint(frames, lambda s, c: (s, 1 - c))  # the other cell of its own frame
    d = map_distances(neighbour[:, None].double().numpy(), geometry)
    assert d["temporal"][0, 0] == 0.0 and d["spatial"][0, 0] == 8.0 and d["within"][0, 0] == 8.0
    tubelets = ClipLayout(frames=4, tubelet=2, grid=(1, 2), stride_px=(8, 8), prefix=("class",))
    other = one_hot_joint(tubelets, lambda s, c: (1 - s, c))  # the next tubelet's centre is 2 frames away
    other[0, 0, 1:, 0] = 3.0  # weight on the class token, removed by the renormalisation
    acc = SpaceTimeAccumulator(tubelets, 1)
    acc.add([other])
    r = acc.distance("hand", fps=4.0)
    assert r.temporal_frames[0, 0] == 2.0 and r.temporal_s[0, 0] == 0.5 and r.spatial_px[0, 0] == 0.0
    divided = ClipLayout(frames=3, tubelet=1, grid=(1, 2), stride_px=(8, 8), prefix=("class",), order="space-major",
                         divided=True)
    temporal = torch.zeros(2, 1, 3, 3)  # each cell: frame 0 -> 1, 1 -> 2, 2 -> 1 (one frame away)
    temporal[:, 0, [0, 1, 2], [1, 2, 1]] = 1.0
    spatial = torch.zeros(3, 1, 3, 3)  # each frame: the class token on itself, each cell on the other cell
    spatial[:, 0, [0, 1, 2], [0, 2, 1]] = 1.0
    acc = SpaceTimeAccumulator(divided, 1)
    acc.add([temporal, spatial])
    r = acc.distance("divided")
    assert r.temporal_frames.tolist() == [[1.0], [0.0]] and r.spatial_px.tolist() == [[0.0], [8.0]]
    assert r.baseline_temporal_frames.tolist() == pytest.approx([8 / 9, 0.0])
    uniform = torch.full((1, 1, 5, 5), 0.2)
    acc = SpaceTimeAccumulator(tubelets, 1)
    acc.add([uniform])
    r = acc.distance("uniform")
    assert r.temporal_frames[0, 0] == pytest.approx(r.baseline_temporal_frames[0]) == pytest.approx(1.0)
    assert r.spatial_px[0, 0] == pytest.approx(r.baseline_spatial_px[0]) == pytest.approx(4.0)
    assert r.baseline_within_px[0] == pytest.approx(4.0)


def dense_model_order(a: torch.Tensor, kind: str, layout: ClipLayout, b: int) -> np.ndarray:
    """One map as a dense head-mean token matrix with residual, (A + I) / rowsum, in the model's own order, built
    token by token (TimeSformer: token 1 + cell * F + frame; the class row of a spatial map the mean of its
    per-frame copies' rows)."""
    f = a.double().mean(1).numpy()
    cells, steps = layout.cells, layout.steps
    if kind != "timesformer":
        dense = f[b].copy()
    else:
        n = 1 + cells * steps
        dense = np.zeros((n, n))
        tok = lambda c, t: 1 + c * steps + t  # noqa: E731
        if a.shape[-1] == steps:  # temporal
            dense[0, 0] = 1.0
            for c in range(cells):
                for t in range(steps):
                    for u in range(steps):
                        dense[tok(c, t), tok(c, u)] = f[b * cells + c, t, u]
        else:
            for t in range(steps):
                g = f[b * steps + t]
                dense[0, 0] += g[0, 0] / steps
                for c in range(cells):
                    dense[0, tok(c, t)] += g[0, 1 + c] / steps
                    dense[tok(c, t), 0] = g[1 + c, 0]
                    for k in range(cells):
                        dense[tok(c, t), tok(k, t)] = g[1 + c, 1 + k]
    dense = dense + np.eye(len(dense))
    return dense / dense.sum(1, keepdims=True)


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_equals_a_brute_force_dense_composition(kind, models, clips, captured):
    m = models[kind]
    layout = m.family.clip_layout(m.model)
    r = vl.attention_rollout(m, clips)
    assert r.maps.shape == (2, layout.steps, 4, 4)
    for b in range(2):
        product = np.eye(layout.num_tokens)
        for a in captured[kind]:
            product = dense_model_order(a, kind, layout, b) @ product  # R = A'_M ... A'_1
        row = product[0] if layout.num_prefix else product.mean(0)
        cellrow = row[layout.num_prefix:]
        if kind == "timesformer":  # model order (cell, frame) -> [frame, cell]
            cellrow = cellrow.reshape(16, FRAMES).T
        expected = cellrow.reshape(layout.steps, 4, 4)
        np.testing.assert_allclose(r.maps[b], expected / expected.max(), rtol=1e-9, atol=1e-12)
    assert r.source_token == ("class" if layout.num_prefix else "mean of cells")


def test_rollout_of_self_attention_keeps_the_source_and_analyze_gives_both_views(models, clips, tmp_path):
    layout = ClipLayout(frames=2, tubelet=1, grid=(1, 2), stride_px=(8, 8))
    identity = torch.eye(4)[None, None]
    assert np.allclose(rollout_clips([identity, identity], layout, ("joint", "joint")), 1.0)  # the cells' mean
    a = vl.analyze(models["timesformer"], clips, views=("distance", "rollout", "filters"))
    assert a.distance.n_clips == 2 and a.rollout.maps.shape == (2, FRAMES, 4, 4) and "filters" in a.notes
    one_by_one = vl.analyze(models["timesformer"], clips, batch_size=1, views=("distance", "rollout"))
    np.testing.assert_allclose(one_by_one.distance.spatial_px, a.distance.spatial_px, rtol=1e-12)
    np.testing.assert_allclose(one_by_one.rollout.maps, a.rollout.maps, rtol=1e-12, atol=1e-15)
    model = models["timesformer"]
    shards = [SpaceTimeAccumulator.for_model(model) for _ in range(2)]
    for acc, shard in zip(shards, (clips[:1], clips[1:])):
        vl.stream_attention(model, shard, [acc])  # the engine's clip source feeds the space-time consumer
    merged = shards[0].merge(shards[1])  # shards merge exactly
    np.testing.assert_allclose(merged.distance("m").temporal_frames, a.distance.temporal_frames, rtol=1e-12)
    np.testing.assert_allclose(merged.rollout("m").maps, a.rollout.maps, rtol=1e-12, atol=1e-15)
    for result in (a.distance, a.rollout):  # both travel as files
        back = vl.load_result(result.save(tmp_path / f"{result.kind}.json"))
        assert type(back) is type(result) and back.summary() == result.summary()
    assert np.array_equal(vl.load_result(tmp_path / "spacetime_distance.json").temporal_frames,
                          a.distance.temporal_frames)
    big = ClipLayout(frames=16, tubelet=2, grid=(14, 14), stride_px=(16, 16))  # VideoMAE-base: 1568 tokens
    assert clips_per_forward(big, 12, 32) == 4 and clips_per_forward(layout, 2, 32) == 32


def test_unsupported_video_inputs_and_models_are_refused_in_one_line(models, clips):
    cfg = transformers.TimesformerConfig(image_size=SIZE, patch_size=PATCH, num_frames=FRAMES, hidden_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                         attention_type="space_only")
    with pytest.raises(UnsupportedModelError, match="divided_space_time") as err:
        vl.LoadedModel.from_module(transformers.TimesformerModel(cfg).eval())
    assert "\n" not in str(err.value)
    small_decoder = transformers.VideoMAEConfig(
        image_size=SIZE, patch_size=PATCH, num_frames=FRAMES, tubelet_size=2, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=2, decoder_intermediate_size=64)
    pretraining = transformers.VideoMAEForPreTraining(small_decoder)
    with pytest.raises(UnsupportedModelError, match="VideoMAEModel") as err:
        vl.LoadedModel.from_module(pretraining.eval())
    assert "\n" not in str(err.value)
    for bad in (clips[:, :2], torch.randn(2, 3, SIZE, SIZE), [clips]):
        with pytest.raises(InvalidParameterError, match="frames") as err:
            vl.attention_distance(models["vivit"], bad)
        assert "\n" not in str(err.value)
    with pytest.raises(InvalidParameterError, match="fps"):
        vl.attention_distance(models["vivit"], clips, fps=0)
    with pytest.raises(InvalidParameterError, match="head_fusion alone"):
        vl.attention_rollout(models["vivit"], clips, discard_ratio=0.5)
    # no attribution method is defined for a clip (the input-space ones take one image): none offered, each refused
    from vitlens.attribution.methods import METHOD_TABLE, methods_for

    assert methods_for(models["vivit"]) == ()
    for method in ("saliency", "integrated_gradients", "gradcam", "rollout"):
        assert method in METHOD_TABLE
        with pytest.raises(vl.VitlensError, match="is a video model .its input is a clip") as err:
            vl.attribute(models["vivit"], clips, method=method)
        assert "\n" not in str(err.value)


def test_the_video_classifiers_are_read_through_their_bare_model_with_logits_unchanged(models, clips):
    classes = {"videomae": transformers.VideoMAEForVideoClassification,
               "vivit": transformers.VivitForVideoClassification, "vjepa2": transformers.VJEPA2ForVideoClassification,
               "timesformer": transformers.TimesformerForVideoClassification}
    for kind, cls in classes.items():
        config = models[kind].model.config.__class__.from_dict({**models[kind].model.config.to_dict(), "num_labels": 3})
        m = vl.LoadedModel.from_module(cls(config).eval(), name=kind)
        plain = m.logits(clips)
        with vl.capture_attention(m) as cap:
            captured_logits = m.logits(clips)
        assert m.spec.num_classes == 3 and plain.shape == (2, 3) and torch.equal(captured_logits, plain)
        assert len(cap.maps) == (4 if kind == "timesformer" else 2)
