"""Swin (issue 32): exact window capture against the block's own non-fused attention, the windows' geometry
against a hand-written cyclic shift + padding + partition (the Swin paper's, not the model's code), attention
distance in image pixels against a float64 computation over explicit dense token-to-token matrices, and the
rollout through windows and patch mergings against a brute-force composition of those dense matrices."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.rollout import RolloutResult
from vitlens.views.distance import FLOAT32_RTOL
from vitlens.views.windowed import WindowedDistanceAccumulator, WindowedDistanceResult
from vitlens.core.windows import merge_transport


def tiny_swin(fused: bool = False, window: int = 4, img: int = 56, seed: int = 0) -> torch.nn.Module:
    """A 3-stage Swin on a 14x14 grid with 4x4 windows (so stage 0 pads to 16x16 and its shifted windows are
    cut by the border), with large random q/k weights so the attention is far from uniform."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=img, window_size=window,
                              embed_dim=16, depths=(2, 2, 2), num_heads=(2, 2, 4), num_classes=5).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                block.attn.qkv.weight.normal_(0.0, 0.6, generator=g)
                block.attn.relative_position_bias_table.normal_(0.0, 1.0, generator=g)
                block.attn.fused_attn = fused
    return model


def load(module: torch.nn.Module) -> vl.LoadedModel:
    return vl.LoadedModel.from_module(module, name="tiny-swin")


def images(n: int = 3, size: int = 56, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def reference_probs(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's window attention written out here (Swin paper, eq. 4): softmax(q k^T / sqrt(d) + B + mask)
    over the windows the block's own partition makes, in float64."""
    attn = block.attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda _m, args, kwargs: seen.update(x=args[0], mask=kwargs.get("mask")),
                                          with_kwargs=True)
    try:
        with torch.no_grad():
            block._attn(x)  # the attention branch on the block's normalised input
    finally:
        hook.remove()
    xw, mask = seen["x"].double(), seen["mask"]
    b_, n, c = xw.shape
    qkv = torch.nn.functional.linear(xw, attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b_, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    scores = (q * attn.scale) @ k.transpose(-2, -1) + attn._get_rel_pos_bias().double()
    if mask is not None:
        nw = mask.shape[0]
        scores = (scores.view(-1, nw, attn.num_heads, n, n) + mask.double()[None, :, None]).view(-1, attn.num_heads, n, n)
    return scores.softmax(-1)


def recording_block_inputs(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """Hooks that record what every block's attention branch is fed in a forward: norm1 of its input."""
    feeds: list[torch.Tensor] = []
    hooks = [b.norm1.register_forward_hook(lambda _m, _i, out: feeds.append(out))
             for stage in model.layers for b in stage.blocks]
    return feeds, hooks


def hand_windows(grid: tuple[int, int], window: int, shift: int) -> np.ndarray:
    """The Swin paper's partition, written out: pad the grid to whole windows after a cyclic shift of
    -shift rows and columns, windows in row-major order, positions row-major inside: [windows, N], -1 = padding."""
    h, w = grid
    numbers = np.arange(h * w).reshape(h, w)
    if shift:
        numbers = np.roll(numbers, (-shift, -shift), axis=(0, 1))
    hp, wp = -(-h // window) * window, -(-w // window) * window
    padded = np.full((hp, wp), -1)
    padded[:h, :w] = numbers
    out = []
    for r in range(0, hp, window):
        for c in range(0, wp, window):
            out.append(padded[r:r + window, c:c + window].ravel())
    return np.stack(out)


def hand_centres(grids: list[tuple[int, int]], patch: int) -> list[np.ndarray]:
    """Each stage's token centres in pixels, written out: patch centres, then each merged token at the mean of
    the (up to four) tokens of its 2x2 block."""
    (h, w), out = grids[0], []
    out.append(np.array([((r + 0.5) * patch, (c + 0.5) * patch) for r in range(h) for c in range(w)]))
    for (fh, fw), (ch, cw) in zip(grids, grids[1:]):
        fine = out[-1].reshape(fh, fw, 2)
        out.append(np.array([fine[2 * r: 2 * r + 2, 2 * c: 2 * c + 2].reshape(-1, 2).mean(0)
                             for r in range(ch) for c in range(cw)]))
    return out


def dense(probs: torch.Tensor, index: np.ndarray, tokens: int) -> np.ndarray:
    """[B, T, T] float64: the block's token-to-token attention, each window's block placed on the stage grid
    (padding rows and columns dropped)."""
    nw, n = index.shape
    p = probs.double().reshape(-1, nw, n, n).numpy()
    out = np.zeros((p.shape[0], tokens, tokens))
    for w in range(nw):
        real = index[w] >= 0
        rows = index[w][real]
        out[:, rows[:, None], rows[None, :]] += p[:, w][:, real][:, :, real]
    return out


def test_the_windows_are_the_papers_shift_padding_and_partition():
    m = load(tiny_swin())
    windows = m.family.windows(m.model, m.spec.image_size)
    blocks = [b for stage in m.model.layers for b in stage.blocks]
    assert [(g.stage, g.grid, g.stride_px, g.kind) for g in windows] == [
        (0, (14, 14), (4, 4), "window"), (0, (14, 14), (4, 4), "shifted window"),
        (1, (7, 7), (8, 8), "window"), (1, (7, 7), (8, 8), "shifted window"),
        (2, (4, 4), (16, 16), "global"), (2, (4, 4), (16, 16), "global")]
    for g, block in zip(windows, blocks):
        want = hand_windows(g.grid, block.window_size[0], block.shift_size[0])
        np.testing.assert_array_equal(g.index, want)
        real = g.index >= 0
        assert sorted(g.index[real].tolist()) == list(range(g.grid[0] * g.grid[1]))  # every token once
    # a shifted window's mask keeps apart tokens the roll brought together from far sides of the grid
    shifted = windows[1]
    rows, cols = np.divmod(np.where(shifted.index >= 0, shifted.index, 0), 14)
    for w in range(shifted.num_windows):
        for i in range(shifted.window_tokens):
            for j in range(shifted.window_tokens):
                if shifted.index[w, i] < 0 or shifted.index[w, j] < 0:
                    continue
                near = abs(rows[w, i] - rows[w, j]) < 4 and abs(cols[w, i] - cols[w, j]) < 4
                assert shifted.allowed[w, i, j] == near


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_window_capture_is_the_blocks_own_attention_and_leaves_the_outputs(fused, mode):
    model = tiny_swin(fused=fused)
    m = load(model)
    x = images()
    with torch.no_grad():
        plain = model(x)
        feeds, hooks = recording_block_inputs(model)  # the inputs of this very forward (inline's drift from fused)
        with vl.capture_attention(m, mode=mode) as cap:
            out = model(x)
        for h in hooks:
            h.remove()
    if mode == "side":
        assert torch.equal(out, plain)  # bit for bit
    else:  # the non-fused path: the fused one to float rounding
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    blocks = [b for stage in model.layers for b in stage.blocks]
    assert len(cap.maps) == len(blocks) == len(feeds)
    for block, feed, got in zip(blocks, feeds, cap.maps):
        want = reference_probs(block, feed)
        # float32 probabilities of at most 16 keys against float64: a few float32 ulps of values <= 1
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def views_capture(m: vl.LoadedModel, batch: int) -> str:
    """The capture mode the views run for this model (the plan's rule): the maps the dense checks read are the ones
    the views were handed (SAM's views capture inline, whose probabilities differ from side's by float rounding)."""
    from vitlens.engine.plan import capture_plan

    return capture_plan(m, batch).mode


def assert_distance_is_a_dense_float64_computation(m: vl.LoadedModel, x: torch.Tensor) -> WindowedDistanceResult:
    """``vl.attention_distance`` of a windowed model against float64 over explicit dense token-to-token matrices
    (each block's captured window maps placed on its stage grid), and its window-uniform distance against the
    uniform attention over what each query may attend (the block's own mask, padding excluded). Every Swin
    variant's test calls this (tests/test_swin_variants.py)."""
    n = x.shape[0]
    got = vl.attention_distance(m, x)
    assert isinstance(got, WindowedDistanceResult) and got.n_images == n
    windows = m.family.windows(m.model, m.spec.image_size)
    with vl.capture_attention(m, mode=views_capture(m, n)) as cap, torch.no_grad():
        m.logits(x)
    assert len(cap.maps) == len(windows)
    grids = list({g.stage: g.grid for g in windows}.values())  # each stage's grid, first stage first
    centres = hand_centres(grids, windows[0].stride_px[0])
    for layer, (g, probs) in enumerate(zip(windows, cap.maps)):
        h, w = g.grid
        ys, xs = centres[g.stage][:, 0], centres[g.stage][:, 1]
        d = np.sqrt((ys[:, None] - ys[None]) ** 2 + (xs[:, None] - xs[None]) ** 2)
        heads = probs.shape[1]
        per_image = np.zeros((n, heads))
        for head in range(heads):
            a = dense(probs[:, head], g.index, h * w)  # [B, T, T]
            per_image[:, head] = ((a * d).sum(-1) / a.sum(-1)).mean(-1)
        # float32 maps are summed by FLOAT32_RTOL's derived rule (float32 products over key blocks); float64 exactly
        rtol = FLOAT32_RTOL if probs.dtype == torch.float32 else 1e-10
        np.testing.assert_allclose(got.mean_px[layer, :heads], per_image.mean(0), rtol=rtol, atol=1e-12)
        np.testing.assert_allclose(got.std_px[layer, :heads], per_image.std(0), rtol=1e-8,
                                   atol=max(1e-10, rtol * per_image.max()))
        assert np.isnan(got.mean_px[layer, heads:]).all()
        # uniform attention over what each query may attend: the block's own mask, padding excluded
        allowed = np.zeros((h * w, h * w), dtype=bool)
        for win in range(g.num_windows):
            real = g.index[win] >= 0
            ids = g.index[win][real]
            allowed[ids[:, None], ids[None, :]] = g.allowed[win][real][:, real]
        want_uniform = ((d * allowed).sum(-1) / allowed.sum(-1)).mean()
        assert got.window_uniform_px[layer] == pytest.approx(want_uniform, rel=1e-12)
    return got


def test_distance_in_pixels_equals_a_dense_float64_computation_and_its_window_uniform():
    got = assert_distance_is_a_dense_float64_computation(load(tiny_swin()), images(4))
    assert np.nanmax(got.of_window) - np.nanmin(got.of_window) > 0.1  # peaky weights: heads differ
    rows = got.to_rows()
    assert len(rows) == 2 * 4 + 4 * 2 and {r["attention"] for r in rows} == {"window", "shifted window", "global"}


def test_the_distance_reduced_a_few_queries_at_a_time_is_the_same_number(monkeypatch):
    """Bounded memory (a 1024 px SAM's global block is reduced a block of queries at a time): a reduction cut
    into blocks of a few queries gives the same distances as whole windows at once."""
    import vitlens.views.windowed as windowed

    m, x = load(tiny_swin()), images(2)
    whole = vl.attention_distance(m, x)
    monkeypatch.setattr(windowed, "REDUCE_ELEMENTS", 300)  # a few queries of a 16-token window per block
    cut = vl.attention_distance(m, x)
    np.testing.assert_allclose(cut.mean_px, whole.mean_px, rtol=1e-12)


def _distance_of_maps(m: vl.LoadedModel, maps: list[torch.Tensor], rows: int | None = None) -> WindowedDistanceResult:
    """The windowed distance of captured window maps handed to the accumulator by hand: whole, or ``rows`` queries
    of every window at a time (the blocks an inline capture by query rows hands over)."""
    acc = WindowedDistanceAccumulator.for_model(m)
    acc.begin_batch(vl.BatchInfo(index=0, start=0, size=maps[0].shape[0] // acc.windows[0].num_windows,
                                 input_size=m.spec.image_size, grid=m.spec.grid, device=torch.device("cpu")))
    for layer, a in enumerate(maps):
        n = a.shape[-2]
        for r0 in range(0, n, rows or n):
            part = None if rows is None else slice(r0, min(n, r0 + rows))
            acc.on_attention(layer, a[:, :, r0:r0 + (rows or n)], part)
    acc.end_batch()
    return acc.result()


def test_float64_maps_are_summed_in_float64_and_row_blocks_give_the_whole_maps_numbers():
    """Float64 window maps are summed in float64 (the dense float64 computation to 1e-12, not float32's bound), and
    blocks of each window's query rows, as an inline capture by rows hands them, give the whole maps' numbers."""
    m, x = load(tiny_swin()), images(2)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    maps = [a.double() for a in cap.maps]
    whole = _distance_of_maps(m, maps)
    windows = m.family.windows(m.model, m.spec.image_size)
    centres = hand_centres(list({g.stage: g.grid for g in windows}.values()), windows[0].stride_px[0])
    for layer, (g, probs) in enumerate(zip(windows, maps)):
        ys, xs = centres[g.stage][:, 0], centres[g.stage][:, 1]
        d = np.sqrt((ys[:, None] - ys[None]) ** 2 + (xs[:, None] - xs[None]) ** 2)
        for head in range(probs.shape[1]):
            a = dense(probs[:, head], g.index, g.grid[0] * g.grid[1])
            want = ((a * d).sum(-1) / a.sum(-1)).mean(-1).mean()
            assert whole.mean_px[layer, head] == pytest.approx(want, rel=1e-12)
    cut = _distance_of_maps(m, maps, rows=5)  # 16-token windows: blocks of 5, 5, 5 and 1 queries
    np.testing.assert_allclose(cut.mean_px, whole.mean_px, rtol=1e-12)
    cut32 = _distance_of_maps(m, list(cap.maps), rows=3)
    np.testing.assert_allclose(cut32.mean_px, _distance_of_maps(m, list(cap.maps)).mean_px, rtol=1e-12)
    with pytest.raises(vl.InvalidParameterError, match="Rows 0:4 do not match a block of 3 queries"):
        acc = WindowedDistanceAccumulator.for_model(m)
        acc.begin_batch(vl.BatchInfo(index=0, start=0, size=2, input_size=m.spec.image_size, grid=m.spec.grid,
                                     device=torch.device("cpu")))
        acc.on_attention(0, maps[0][:, :, :3], slice(0, 4))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) to build the kernels")
def test_the_native_window_sums_follow_the_float32_rule_of_the_eager_ones(monkeypatch):
    """Window maps without padding keys go through the native kernel (one read, the products fused): the same
    distances as the eager float32 sums within twice the derived bound, each within it of float64, and the kernel ran
    where asked and only then."""
    import vitlens.views.windowed as windowed

    m, x = load(tiny_swin(window=7)), images(2)  # 14x14 grid in 7x7 windows: no padding keys in stage 0
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    calls = []
    real = windowed.window_block_sums
    monkeypatch.setattr(windowed, "window_block_sums", lambda *args: calls.append(real(*args)) or calls[-1])
    monkeypatch.setenv("VITLENS_COMPILE", "1")
    native = _distance_of_maps(m, list(cap.maps))
    assert calls and any(calls)
    monkeypatch.setenv("VITLENS_COMPILE", "0")
    calls.clear()
    eager = _distance_of_maps(m, list(cap.maps))
    assert calls and not any(calls)
    wide = _distance_of_maps(m, [a.double() for a in cap.maps])
    np.testing.assert_allclose(native.mean_px, eager.mean_px, rtol=2 * FLOAT32_RTOL)
    np.testing.assert_allclose(native.mean_px, wide.mean_px, rtol=FLOAT32_RTOL)


def test_the_shared_tables_stay_right_when_threads_evict_them_at_once(monkeypatch):
    """Two models' windows read by four threads at once, the cache holding one table (every lookup evicts): each
    thread gets its own windows' tables, and no thread fails on another's eviction."""
    import threading
    import vitlens.views.windowed as windowed
    from vitlens.core.windows import stage_centres

    geometries = [windowed.model_windows(load(tiny_swin(window=w))) for w in (4, 7)]
    want = [[windowed._distances(g, stage_centres(ws)[g.stage])[0] for g in ws] for ws in geometries]
    monkeypatch.setattr(windowed, "_TABLES_KEPT", 1)
    monkeypatch.setattr(windowed, "_TABLES", {})
    failures: list[BaseException] = []

    def read(ws: list, tables: list) -> None:
        try:
            for _ in range(20):
                got = windowed._shared_tables(ws, stage_centres(ws))
                assert all(torch.equal(g[0], t) for g, t in zip(got, tables))
        except BaseException as e:  # handed to the test's thread
            failures.append(e)

    threads = [threading.Thread(target=read, args=(geometries[i % 2], want[i % 2])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


@pytest.mark.parametrize("self_bias, want", [(0.0, 1.0), (60.0, 0.0)])
def test_known_answers_uniform_attention_fills_its_window_and_self_attention_is_at_zero(self_bias, want):
    """With q = k = 0 the scores are the relative bias alone: all zero, each query spreads evenly over its window
    (padding keys dropped, a shifted window's masked keys at exp(-100)): exactly the window-uniform distance; a
    bias of +60 at offset (0, 0) puts every query on itself: distance 0."""
    model = tiny_swin()
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                attn = block.attn
                attn.qkv.weight.zero_(), attn.qkv.bias.zero_(), attn.relative_position_bias_table.zero_()
                ws = block.window_size
                attn.relative_position_bias_table[(ws[0] - 1) * (2 * ws[1] - 1) + ws[1] - 1] = self_bias  # offset 0
    got = vl.attention_distance(load(model), images(2))
    # float32 maps summed by FLOAT32_RTOL's rule: of_window within that bound of its known answer (1.0 or 0.0)
    np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=want), want, rtol=0, atol=FLOAT32_RTOL)


def assert_rollout_is_a_brute_force_dense_composition(m: vl.LoadedModel, x: torch.Tensor) -> RolloutResult:
    """``vl.attention_rollout`` of a windowed model against explicit float64 matrices: per block (A + I) / rowsum
    over the stage's tokens (A: the captured window maps, heads fused by their mean, placed on the stage grid),
    per patch merging the transport (coarse token = mean of the fine tokens it merges), the source the mean over
    the last stage's tokens. Every Swin variant's test calls this (tests/test_swin_variants.py)."""
    n = x.shape[0]
    got = vl.attention_rollout(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    with vl.capture_attention(m, mode=views_capture(m, x.shape[0])) as cap, torch.no_grad():
        m.logits(x)
    product = None
    for layer, (g, probs) in enumerate(zip(windows, cap.maps)):
        t = g.grid[0] * g.grid[1]
        a = dense(probs.mean(dim=1), g.index, t)  # heads fused by their mean, in float32 as the rollout fuses them
        a = a + np.eye(t)
        a = a / a.sum(-1, keepdims=True)
        if layer and windows[layer - 1].stage != g.stage:
            parent, weight = merge_transport(windows[layer - 1].grid, g.grid)
            fine = windows[layer - 1].grid[0] * windows[layer - 1].grid[1]
            merge = np.zeros((t, fine))
            merge[parent, np.arange(fine)] = weight  # coarse token = mean of the fine tokens it merges
            product = merge @ product
        product = a if product is None else a @ product
    last = windows[-1].grid[0] * windows[-1].grid[1]
    row = np.full((n, last), 1.0 / last)[:, None, :] @ product  # the mean over the last stage's tokens
    want = row[:, 0].reshape(n, *windows[0].grid)
    want = want / want.reshape(n, -1).max(-1)[:, None, None]
    np.testing.assert_allclose(got.maps, want, rtol=1e-10, atol=1e-12)
    assert got.grid == windows[0].grid and got.image_size == m.spec.image_size
    return got


def test_rollout_through_windows_and_patch_merging_equals_a_brute_force_dense_composition():
    got = assert_rollout_is_a_brute_force_dense_composition(load(tiny_swin()), images(2))
    assert got.grid == (14, 14) and got.image_size == (56, 56)


def test_the_transport_of_a_merging_is_the_mean_of_the_fine_tokens_it_merges():
    parent, weight = merge_transport((3, 5), (2, 3))
    assert parent.reshape(3, 5).tolist() == [[0, 0, 1, 1, 2], [0, 0, 1, 1, 2], [3, 3, 4, 4, 5]]
    assert weight.reshape(3, 5).tolist() == [[0.25, 0.25, 0.25, 0.25, 0.5], [0.25, 0.25, 0.25, 0.25, 0.5],
                                             [0.5, 0.5, 0.5, 0.5, 1.0]]
    with pytest.raises(ValueError, match="gives 2x3"):
        merge_transport((3, 5), (2, 2))


def test_a_vit_view_is_refused_for_a_windowed_model_in_one_line(tiny):
    m = load(tiny_swin())
    with pytest.raises(vl.UnsupportedModelError, match="attends within windows"):
        vl.prefix_diagnostics(m, images(1))
    for what, call in (("attention_maps", lambda: vl.attention_maps(m, images(1))),
                       ("head importance", lambda: vl.head_importance(m, images(2)))):
        with pytest.raises(vl.UnsupportedModelError, match=f"{what}.*hierarchical.*window_maps"):
            call()
    # CKA compares representations: it says why this model's blocks are not compared, and where its attention is
    with pytest.raises(vl.UnsupportedModelError, match="CKA compares.*representations.*hierarchical.*"
                                                       "vl.attention_distance"):
        vl.cka(m, tiny, images(4))
    with pytest.raises(vl.UnsupportedModelError, match="attends globally"):
        WindowedDistanceAccumulator.for_model(tiny)
    with pytest.raises(vl.InvalidParameterError, match="discard_ratio=0"):
        vl.attention_rollout(m, images(1), discard_ratio=0.5)


def test_analyze_gives_the_windowed_views_and_the_weight_views_say_why_not():
    m = load(tiny_swin())
    a = vl.analyze(m, images(2))
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 14, 14)
    assert a.filters is not None
    assert a.position is None and "relative-position bias" in a.position_note


def test_the_facts_say_a_swins_stages_and_heads_per_stage():
    """Issue 45.7: the facts said "layers x heads 12 x 24" for Swin-T (its stages have 3, 6, 12, 24 heads); a model of
    stages says its stages and the heads of each, read from its blocks, and keeps them through a saved spec."""
    import timm

    module = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, window_size=4,
                               embed_dim=12, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), num_classes=5)
    m = vl.LoadedModel.from_module(module, name="swin-t-shaped")
    assert m.spec.stage_heads == ((3, 3), (6, 6), (12,) * 6, (24, 24))
    facts = m.describe()
    assert "layers x heads" not in facts
    assert facts["stages"] == "4 (2, 2, 6, 2 blocks)" and facts["heads per stage"] == "3, 6, 12, 24"
    assert "4 stages of 3, 6, 12, 24 heads" in repr(m)
    assert vl.ModelSpec.from_dict(json.loads(json.dumps(m.spec.to_dict()))) == m.spec
    assert vl.load_model("ref-vit").describe()["layers x heads"] == "6 x 8"  # one stage: as before
