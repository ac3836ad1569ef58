"""Hugging Face Qwen2.5-VL's vision tower: window blocks and a full block on tokens reordered into windows. The
windows against a hand-written window index (windows row-major, merge blocks row-major in each, cells row-major in
each block, partial windows at the borders); the capture against each block's attention written out here in float64
from its own input, ``qkv`` and transformers' RoPE, chunk by chunk (side and inline), the outputs bit for bit under
side capture; the distance in pixels and the rollout against dense float64 computations on the image's cells built
from those hand-written chunks (not from the family's geometry). A tiny random tower: patch 8, merge 2, 32 px
windows, read at 64x48 (8x6 patches: two full and two partial windows), block 1 full."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl

transformers = pytest.importorskip("transformers")

SIZE, PATCH, WINDOW, MERGE = (64, 48), 8, 32, 2
GRID = (SIZE[0] // PATCH, SIZE[1] // PATCH)
FULL = (1,)


def tiny_qwen(seed: int = 0, implementation: str = "sdpa") -> torch.nn.Module:
    """A tiny random tower with large random qkv weights (attention far from uniform)."""
    cfg = transformers.Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, num_heads=2, intermediate_size=64,
                                              patch_size=PATCH, spatial_merge_size=MERGE, window_size=WINDOW,
                                              fullatt_block_indexes=list(FULL), out_hidden_size=32)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VisionTransformerPretrainedModel._from_config(
        cfg, attn_implementation=implementation).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.5, generator=g)
    return model


@pytest.fixture(scope="module")
def m() -> vl.LoadedModel:
    return vl.LoadedModel.from_module(tiny_qwen(), name="qwen25", device="cpu",
                                      data_config={"input_size": (3, *SIZE)})


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *SIZE, generator=torch.Generator().manual_seed(seed))


def hand_windows() -> list[list[int]]:
    """Each window's cells (r * W + c) in the tower's token order, written out: windows of 4x4 patches row-major
    over the 8x6 grid (the last column of windows 2 patches wide), each window's 2x2 merge blocks row-major, each
    block's cells row-major."""
    out = []
    step = WINDOW // PATCH
    for r0 in range(0, GRID[0], step):
        for c0 in range(0, GRID[1], step):
            cells = []
            for br in range(r0, min(r0 + step, GRID[0]), MERGE):
                for bc in range(c0, min(c0 + step, GRID[1]), MERGE):
                    cells += [(br + i) * GRID[1] + bc + j for i in range(MERGE) for j in range(MERGE)]
            out.append(cells)
    return out


def reference_chunks(m: vl.LoadedModel, x: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each block's attention, chunk by chunk in the model's order: softmax(q k^T * scaling) in float64 within each
    of its ``cu_seqlens`` chunks, q and k from the block's own input through its ``qkv`` and transformers'
    ``apply_rotary_pos_emb_vision``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    seen: list[tuple] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, a, kw: seen.append((a[0], kw)), with_kwargs=True)
             for b in m.model.blocks]
    try:
        with torch.no_grad():
            m.forward(x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for block, (hidden, kw) in zip(m.model.blocks, seen):
        attn = block.attn
        qkv = attn.qkv(hidden).double().reshape(hidden.shape[0], 3, attn.num_heads, -1)
        q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)
        cos, sin = (t.double() for t in kw["position_embeddings"])
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        bounds = kw["cu_seqlens"].tolist()
        out.append([torch.softmax(torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * attn.scaling, -1)
                    for s, e in zip(bounds[:-1], bounds[1:])])
    return out


def dense_maps(chunks: list[list[torch.Tensor]], n: int) -> list[np.ndarray]:
    """Each block's [B, heads, T, T] on the image's cells, from its chunks and the hand-written window order."""
    windows = hand_windows()
    full_order = [c for w in windows for c in w]
    t = GRID[0] * GRID[1]
    out = []
    for layer, calls in enumerate(chunks):
        cells = [full_order] * n if layer in FULL else windows * n
        a = np.zeros((n, calls[0].shape[0], t, t))
        for i, (call, where) in enumerate(zip(calls, cells)):
            b = i // (len(calls) // n)
            a[b][:, np.array(where)[:, None], np.array(where)[None, :]] = call.numpy()
        out.append(a)
    return out


def test_the_windows_are_the_hand_written_window_index(m):
    assert (m.family.name, m.spec.kind, m.spec.grid, m.spec.stride_px) == ("hf-qwen2.5-vl", "hierarchical", GRID,
                                                                           (8, 8))
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [g.kind for g in windows] == ["window", "global", "window"]
    want = hand_windows()
    assert [len(w) for w in want] == [16, 8, 16, 8]  # two full windows, two partial ones at the right border
    for layer, g in enumerate(windows):
        rows = [[c for c in w] for w in g.index.tolist()]
        real = [[c for c in row if c >= 0] for row in rows]
        assert real == ([[c for w in want for c in w]] if layer in FULL else want)
        assert sorted(c for row in real for c in row) == list(range(GRID[0] * GRID[1]))


@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_each_blocks_own_attention_and_side_capture_leaves_the_outputs(m, mode):
    x = images()
    want = reference_chunks(m, x)
    with torch.no_grad():
        plain = m.model(**m.family.inputs(m.model, x))
        with vl.capture_attention(m, mode=mode) as cap:
            out = m.model(**m.family.inputs(m.model, x))
    for name in ("last_hidden_state", "pooler_output"):
        a, b = getattr(out, name), getattr(plain, name)
        assert torch.equal(a, b) if mode == "side" else (a - b).abs().max().item() < 1e-5
    assert len(cap.maps) == 3
    for layer, (got, calls) in enumerate(zip(cap.maps, want)):
        assert len(calls) == (2 if layer in FULL else 8)  # one call per image, or per window of each image
        n = max(c.shape[-1] for c in calls)
        assert got.shape == (len(calls), 2, n, n)
        for i, call in enumerate(calls):
            k = call.shape[-1]
            assert (got[i, :, :k, :k].double() - call).abs().max().item() < 1e-5
            assert not got[i, :, k:].any() and not got[i, :, :, k:].any()  # the padding is zeros
    assert max(float(p.max()) for p in cap.maps) > 0.5  # far from uniform


def test_distance_and_rollout_equal_dense_float64_computations_in_image_order(m):
    x = images()
    dense = dense_maps(reference_chunks(m, x), 2)
    t = GRID[0] * GRID[1]
    ys, xs = np.divmod(np.arange(t), GRID[1])
    centres = np.stack([(ys + 0.5) * PATCH, (xs + 0.5) * PATCH], 1)
    d = np.sqrt(((centres[:, None] - centres[None]) ** 2).sum(-1))
    got = vl.attention_distance(m, x)
    windows = hand_windows()
    same = np.zeros((t, t), dtype=bool)
    for w in windows:
        same[np.array(w)[:, None], np.array(w)[None, :]] = True
    for layer, a in enumerate(dense):
        per_image = ((a * d).sum(-1) / a.sum(-1)).mean(-1)  # [B, heads]
        np.testing.assert_allclose(got.mean_px[layer], per_image.mean(0), rtol=1e-5, atol=1e-6)
        allowed = np.ones((t, t), dtype=bool) if layer in FULL else same
        uniform = ((d * allowed).sum(-1) / allowed.sum(-1)).mean()
        np.testing.assert_allclose(got.window_uniform_px[layer], uniform, rtol=1e-10)
    assert got.kinds == ("window", "global", "window")
    assert got.window_uniform_px[1] > got.window_uniform_px[0]  # the full block's keys spread over the whole image
    # rollout: (A + I) / rowsum per block on the cells, composed from the last block, the mean over the tokens
    roll = vl.attention_rollout(m, x)
    for b in range(2):
        v = np.full(t, 1.0 / t)
        for a in reversed(dense):
            fused = a[b].mean(0) + np.eye(t)
            v = v @ (fused / fused.sum(-1, keepdims=True))
        want = v.reshape(GRID)
        np.testing.assert_allclose(roll.maps[b], want / want.max(), rtol=1e-5, atol=1e-7)
    assert roll.source_token == "mean over the tokens, through the windows and global blocks"


def test_other_sizes_and_implementations_are_refused_in_one_line(m):
    with pytest.raises(vl.InvalidParameterError, match="at 64x48 px") as err:
        vl.analyze_each(m, [images(1)[0], torch.randn(3, 32, 32)])
    assert "\n" not in str(err.value)
    with pytest.raises(vl.UnsupportedModelError, match="multiples of 16 px"):
        vl.LoadedModel.from_module(m.model, name="q", device="cpu", data_config={"input_size": (3, 40, 48)})
    with pytest.raises(vl.UnsupportedModelError, match="attn_implementation='sdpa'"):
        vl.LoadedModel.from_module(tiny_qwen(implementation="eager"), name="q", device="cpu")
    from vitlens.attribution.cam import default_cam_layer

    with pytest.raises(vl.ViewNotAvailableError, match="target_layer"):  # its blocks hand on window-ordered [T, C]
        default_cam_layer(m)
    w, _, _ = m.family.pixel_filters(m.model, m.spec)
    assert w.shape == (32, 3, 8, 8)  # the Conv3d's two temporal frames summed


def test_a_whole_qwen25_vl_is_read_through_its_visual_tower():
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, window_size=WINDOW, fullatt_block_indexes=[1], out_hidden_size=32)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(
        transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text), attn_implementation="sdpa").eval()
    m = vl.LoadedModel.from_module(model, name="qwen25-whole", device="cpu", data_config={"input_size": (3, *SIZE)})
    assert m.model is model.model.visual and m.family.name == "hf-qwen2.5-vl"
    assert m.spec.read_module == "model.visual (Qwen2_5_VisionTransformerPretrainedModel)"
    assert (m.spec.image_size, m.spec.grid) == (SIZE, GRID)
    got = vl.attention_distance(m, images(1))
    assert got.kinds == ("window", "global")
