"""Issue 20: exact attention views in bounded memory at high resolution. The views choose between
whole maps and query-chunked side capture by T, batch and a memory budget; chunked capture gives
the same numbers (relative error <= 1e-5 against float64) with uneven chunks; nothing of a block
outlives it; distance builds its key weights by block; rollout converts to float64 by rows."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.distance import AttentionDistanceAccumulator
import view_references
from conftest import get_model, reference_attention
from vitlens.families import CaptureAbilities
from vitlens.engine.plan import ROW_BLOCK_MB, CapturePlan, capture_plan, default_budget_mb, query_rows_for_budget


def test_capture_plan_makes_whole_maps_within_the_budget_and_query_blocks_above_it(tiny):
    # vit_tiny at 224 px: T = 197, 3 heads, embed 192. A whole block map at batch 8 is 4*8*3*197^2 bytes
    whole_mb = 4 * 8 * 3 * 197 ** 2 / 2**20
    plan = capture_plan(tiny, 8)
    assert plan.whole_map_mb == pytest.approx(whole_mb)
    assert plan.budget_mb == pytest.approx(max(4.0, 4 * 8 * 197 * 4 * 192 / 2**20))
    assert (plan.mode, plan.query_rows) == ("inline", 197)  # one block of every row: T = 197 <= 4 * 192 / 3 = 256
    small = capture_plan(tiny, 8, memory_budget_mb=whole_mb / 3)
    assert small.mode == "inline" and small.query_rows == query_rows_for_budget(8, 3, 197, whole_mb / 3) == 65
    assert capture_plan(tiny, 8, memory_budget_mb=whole_mb).query_rows == 197  # exactly fits: whole maps
    with pytest.raises(vl.InvalidParameterError, match="memory_budget_mb"):
        capture_plan(tiny, 8, memory_budget_mb=0)


def test_default_budget_is_one_mlp_activation_so_whole_maps_stop_at_256_tokens(tiny):
    # B * T * 4 * dim * 4 bytes >= B * heads * T^2 * 4 bytes  <=>  T <= 4 * dim / heads (= 256 for 64-dim heads)
    assert default_budget_mb(64, 256, 192) * 2**20 == 4 * 64 * 256 * 4 * 192
    assert default_budget_mb(1, 10, 8) == 4.0  # never below MIN_BUDGET_MB
    for t in (256, 257):
        plan = capture_plan(tiny, 64, tokens=t)
        assert (plan.query_rows == t) == (t <= 256)
        if t > 256:  # blocks of ROW_BLOCK_MB (48 MB) at most, below this budget of 48.2 MB
            assert plan.budget_mb == default_budget_mb(64, 257, 192) > ROW_BLOCK_MB
            assert plan.query_rows == int(ROW_BLOCK_MB * 2**20 // (4 * 64 * 3 * 257)) == 255


def test_blocks_of_query_rows_stay_within_the_row_block_cap_whatever_the_budget(tiny):
    """A budget above ROW_BLOCK_MB chunks as ROW_BLOCK_MB does (faster blocks, less memory); a budget below it
    chunks as the budget says."""
    big = capture_plan(tiny, 8, tokens=2305, memory_budget_mb=400.0)  # whole maps: 486 MB
    capped = capture_plan(tiny, 8, tokens=2305, memory_budget_mb=ROW_BLOCK_MB)
    assert big.mode == capped.mode == "inline" and big.query_rows == capped.query_rows
    assert big.query_rows * 4 * 8 * 3 * 2305 <= ROW_BLOCK_MB * 2**20
    small = capture_plan(tiny, 8, tokens=2305, memory_budget_mb=ROW_BLOCK_MB / 4)
    assert small.query_rows == query_rows_for_budget(8, 3, 2305, ROW_BLOCK_MB / 4) < big.query_rows


def test_families_that_cannot_chunk_keep_whole_maps():
    from types import SimpleNamespace

    m = get_model("vit_tiny_patch16_224")
    plan = capture_plan(m, 4, tokens=5000, memory_budget_mb=1.0)
    assert plan.mode == "inline" and plan.query_rows == 2**20 // (4 * 4 * 3 * 5000) == 4  # timm ViT: by query rows
    side_rows = SimpleNamespace(spec=m.spec, model=None, family=SimpleNamespace(  # e.g. parallel blocks, EVA
        abilities=lambda _model: CaptureAbilities(view_mode="inline", side_rows=True, inline_rows=False)))
    assert capture_plan(side_rows, 4, tokens=5000, memory_budget_mb=1.0) == (
        CapturePlan("side", plan.query_rows, plan.budget_mb, plan.whole_map_mb))
    other = SimpleNamespace(spec=m.spec, model=None, family=SimpleNamespace(
        abilities=lambda _model: CaptureAbilities(view_mode="side")))
    assert capture_plan(other, 4, tokens=5000, memory_budget_mb=1.0).query_rows is None  # whole maps, whatever T


def _float64_distance(maps: list[torch.Tensor], grid: tuple[int, int], stride: int, p: int) -> np.ndarray:
    """Independent reference: mean attention distance per layer and head in float64, renormalised."""
    gh, gw = grid
    ys, xs = np.meshgrid(np.arange(gh) * stride, np.arange(gw) * stride, indexing="ij")
    pos = np.stack([ys.ravel(), xs.ravel()], 1).astype(np.float64)
    d = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1))
    out = []
    for a in maps:
        w = a[:, :, p:, p:].double().numpy()
        out.append(((w * d).sum(-1) / w.sum(-1)).mean(-1).mean(0))
    return np.stack(out)


def test_views_chunk_by_themselves_above_256_tokens_with_uneven_blocks_and_the_same_numbers():
    m = get_model("vit_tiny_patch16_224", img_size=288)  # 18 x 18 grid: T = 325 = 256 + 69 (uneven blocks)
    x = torch.randn(5, 3, 288, 288, generator=torch.Generator().manual_seed(20))
    plan = capture_plan(m, 5)  # budget 5 * 325 * 768 * 4 bytes (4.8 MB) < whole map 5 * 3 * 325^2 * 4 (6.0 MB)
    assert plan.mode == "inline" and plan.query_rows == 256
    seen = []

    class Rows(vl.AttentionConsumer):
        def on_attention(self, layer, attn, rows=None):
            seen.append((layer, None if rows is None else (rows.start, rows.stop)))

    vl.stream_attention(m, x, [Rows()], batch_size=5, capture_mode=None)
    assert seen == [(layer, b) for layer in range(m.spec.num_layers) for b in ((0, 256), (256, 325))]
    chunked = vl.analyze(m, x, batch_size=5, views=("distance", "rollout", "prefix"))
    whole = vl.analyze(m, x, batch_size=5, views=("distance", "rollout", "prefix"), memory_budget_mb=1e6)
    with torch.no_grad(), vl.capture_attention(m, mode="inline") as cap:
        m.model(x)
    want = _float64_distance(cap.maps, (18, 18), 16, 1)
    np.testing.assert_allclose(chunked.distance.mean_px, want, rtol=1e-5, atol=0)
    np.testing.assert_allclose(whole.distance.mean_px, want, rtol=1e-5, atol=0)
    np.testing.assert_allclose(chunked.rollout.maps, whole.rollout.maps, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(chunked.prefix.mass, whole.prefix.mass, rtol=1e-5, atol=0)
    # the one-view calls take the same choice
    np.testing.assert_array_equal(vl.attention_distance(m, x, batch_size=5).mean_px, chunked.distance.mean_px)


def test_side_capture_keeps_no_block_input_alive_during_the_forward():
    """Each block's input (B x T x dim) must be freed when the block is done, as in a plain forward:
    the capture once held every block's input until the next forward (12 x 28 MB at 768 px, batch 4)."""
    m = get_model("vit_tiny_patch16_224")
    inputs: list[weakref.ref] = []
    alive_at_last_block: list[int] = []

    def keep(_mod, args):
        inputs.append(weakref.ref(args[0]))

    def count(_mod, _args):
        gc.collect()
        alive_at_last_block.append(sum(r() is not None for r in inputs[:-1]))

    handles = [b.attn.register_forward_pre_hook(keep) for b in m.model.blocks]
    handles.append(m.model.blocks[-1].register_forward_pre_hook(count))
    try:
        for rows in (None, 50):
            inputs.clear()
            with torch.no_grad(), vl.capture_attention(m, store=False, consumers=[vl.AttentionConsumer()],
                                                       query_rows=rows):
                m.model(torch.randn(1, 3, 224, 224))
    finally:
        for h in handles:
            h.remove()
    assert alive_at_last_block == [0, 0]  # at the last block, no earlier block's input is still held


def test_distance_rows_by_block_equal_the_whole_matrix(monkeypatch):
    from vitlens.views import distance

    d = distance.token_distance_matrix((5, 7), (16, 8))
    for q in (slice(0, 35), slice(3, 11), slice(34, 35)):
        assert torch.equal(distance.token_distance_matrix((5, 7), (16, 8), queries=q), d[q])
    m = get_model("deit_tiny_distilled_patch16_224", img_size=(64, 96))
    x = torch.randn(3, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    whole = AttentionDistanceAccumulator.for_model(m.spec)
    vl.stream_attention(m, x, [whole], query_rows=7)
    monkeypatch.setattr(distance, "WHOLE_DISTANCES_BYTES", 0)  # every block builds its own rows
    by_block = AttentionDistanceAccumulator.for_model(m.spec)
    vl.stream_attention(m, x, [by_block], query_rows=7)
    assert by_block._distances is None
    assert whole.result(m.spec).equals(by_block.result(m.spec))  # bit for bit


@pytest.mark.parametrize("head_fusion,discard", [("mean", 0.0), ("max", 0.3)])
def test_rollout_row_in_float64_row_blocks_equals_the_full_matrix_product(monkeypatch, head_fusion, discard):
    from vitlens.views import rollout_math as rollout  # where rollout_row reads ROLLOUT_ROWS_BYTES

    g = torch.Generator().manual_seed(5)
    maps = [torch.rand(2, 3, 13, 13, generator=g).softmax(-1) for _ in range(4)]
    monkeypatch.setattr(rollout, "ROLLOUT_ROWS_BYTES", 8 * 2 * 13 * 5)  # blocks of 5 rows: 5, 5, 3
    got = view_references.rollout_from_maps(maps, 1, True, (3, 4), head_fusion, discard)
    # independent: fuse, discard, (A + I) / rowsum, multiply the full float64 matrices, take the class row
    prod = torch.eye(13, dtype=torch.float64).expand(2, 13, 13)
    for a in maps:
        f = rollout.fuse(a, head_fusion)
        f = rollout.discard_smallest(f, discard, True)
        prod = view_references.residual_normalize(f.double()) @ prod
    want = rollout.rollout_map(prod, 1, True, (3, 4))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_discard_in_place_equals_the_copying_discard_and_keeps_the_class_token():
    from vitlens.views.rollout_math import discard_smallest

    f = torch.rand(2, 9, 9, generator=torch.Generator().manual_seed(1))
    f[:, 0, 0] = 1e-9  # the smallest weight, protected
    want = discard_smallest(f, 0.5, True)
    g = f.clone()
    got = discard_smallest(g, 0.5, True, inplace=True)
    assert got.data_ptr() == g.data_ptr() and torch.equal(got, want)
    assert (want == 0).sum(dim=(1, 2)).tolist() == [40, 40]  # int(81 * 0.5) zeroed, the class token's own kept
    assert torch.equal(f[:, 0, 0], want[:, 0, 0])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_row_consumers_keep_no_row_block_alive():
    """A consumer that kept a view of a row block would keep the block's whole storage (and so every
    block of a layer: a whole map) alive: every tensor a consumer holds owns no more than its numbers."""
    from vitlens.views.prefix import PrefixAttentionAccumulator

    m = get_model("deit_tiny_distilled_patch16_224", img_size=(64, 96))  # T = 26
    info = vl.BatchInfo(index=0, start=0, size=2, input_size=(64, 96), grid=(4, 6), device=torch.device("cpu"))
    consumers = [AttentionDistanceAccumulator.for_model(m.spec), PrefixAttentionAccumulator.for_model(m.spec)]
    for c in consumers:
        c.begin_batch(info)
    a = torch.rand(2, 3, 10, 26).softmax(-1)
    for c in consumers:
        c.on_attention(0, a, slice(0, 10))  # the layer's first block: its state is held until the last
    held = [t for c in consumers for t in _tensors(vars(c)) if t.untyped_storage().data_ptr() == a.data_ptr()
            or t.untyped_storage().nbytes() > t.numel() * t.element_size()]
    assert held == []


def test_one_querys_maps_keep_only_its_rows_and_equal_the_whole_maps():
    """``attention_maps(queries=...)`` at a resolution where the plan chunks (vit_base at 288 px, one image:
    T = 325, blocks of 268 + 57 query rows under the 4 MB floor): the rows kept equal the whole maps' rows,
    queries in both blocks."""
    m = get_model("vit_base_patch16_224", img_size=288)
    x = torch.randn(1, 3, 288, 288, generator=torch.Generator().manual_seed(3))
    assert capture_plan(m, 1).query_rows == 268  # the chunked path engages
    whole = vl.attention_maps(m, x)
    queries = (0, 17, 300)  # the class token, a patch in the first row block, one in the second
    some = vl.attention_maps(m, x, queries=queries)
    assert some.maps.shape == (12, 12, 3, 325) and some.queries == queries
    np.testing.assert_allclose(some.maps, whole.maps[:, :, list(queries)], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(some.query_attention(5, 300), whole.query_attention(5, 300), rtol=1e-5, atol=1e-7)
    with pytest.raises(vl.InvalidParameterError, match="keep the rows of queries"):
        some.query_attention(5, 1)
    with pytest.raises(vl.InvalidParameterError, match="without queries"):
        some.prefix_mass()
    with pytest.raises(vl.InvalidParameterError, match=r"token indices in \[0, 325\)"):
        vl.attention_maps(m, x, queries=[325])


@pytest.mark.parametrize("scratch_rows", [1, 7, 40])  # products a query at a time, uneven chunks, all at once
def test_sums_over_keys_stay_within_the_float32_bound_however_the_queries_are_chunked(monkeypatch, scratch_rows):
    """99 patch keys: one whole block of 64 and a shorter one; the scratch buffer holds 1, 7 (uneven: 40 =
    5 x 7 + 5) or all 40 queries' products; against the same sums in float64, within the derived bound."""
    from vitlens.views import distance as dist

    g = torch.Generator().manual_seed(5)
    grid, p = (9, 11), 2
    attn = torch.softmax(torch.randn(2, 3, 40, p + 99, generator=g) * 4, dim=-1)
    monkeypatch.setattr(dist, "SCRATCH_BYTES", 4 * 2 * 3 * 99 * scratch_rows)
    d = dist.token_distance_matrix(grid, (16, 16), queries=slice(10, 50))
    a = attn.double()[..., p:]
    for renormalize in (True, False):
        got = dist.per_query_distance(attn, d.float(), p, renormalize)
        want = (a * d).sum(-1) / (a.sum(-1) if renormalize else 1.0)  # [B, H, q] in float64
        np.testing.assert_allclose(got.permute(1, 2, 0).numpy(), want.numpy(), rtol=dist.FLOAT32_RTOL)
    with pytest.raises(vl.InvalidParameterError, match="do not fit 40 queries over 99 patch keys"):
        dist.per_query_distance(attn, d[:5], p)


def test_inline_capture_by_query_rows_gives_the_whole_maps_and_the_non_fused_output(tiny):
    """Inline by query rows (timm's Attention computed a block of queries at a time, each block emitted and then
    multiplied by v): the maps are the whole non-fused path's (the same products; tolerance as the families'
    exactness test), the output the non-fused path's to float rounding, uneven blocks (197 = 3 x 50 + 47)
    included; the modules' own forward is back afterwards (no instance attribute left)."""
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(21))
    ref_maps, ref_out = reference_attention(tiny.model, x)
    seen = []

    class Rows(vl.AttentionConsumer):
        def on_attention(self, layer, attn, rows=None):
            seen.append((layer, rows.start, rows.stop))

    with torch.no_grad(), vl.capture_attention(tiny, mode="inline", query_rows=50, consumers=[Rows()]) as cap:
        out = tiny.model(x)
    assert seen == [(layer, a, b) for layer in range(12) for a, b in ((0, 50), (50, 100), (100, 150), (150, 197))]
    for got, want in zip(cap.maps, ref_maps):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    assert all("forward" not in vars(b.attn) for b in tiny.model.blocks)
    with torch.no_grad():
        assert torch.equal(tiny.model(x), tiny.model(x))  # the fused path again, deterministic
        torch.testing.assert_close(tiny.model(x), ref_out, atol=1e-4, rtol=1e-4)


def test_inline_capture_by_query_rows_keeps_gradients_and_runs_under_autocast(tiny):
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(22)).requires_grad_(True)
    with vl.capture_attention(tiny, mode="inline", detach=False) as whole:
        g_whole, = torch.autograd.grad(tiny.model(x)[0, 3], x)
    with vl.capture_attention(tiny, mode="inline", detach=False, query_rows=64, store=False):
        g_rows, = torch.autograd.grad(tiny.model(x)[0, 3], x)
    assert len(whole.maps) == 12
    torch.testing.assert_close(g_rows, g_whole, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = tiny.model(x).float()
        with vl.capture_attention(tiny, mode="inline", query_rows=64) as cap:
            rows = tiny.model(x).float()
    assert all(a.dtype == torch.float32 for a in cap.maps)  # float32 probabilities, as side capture gives
    torch.testing.assert_close(rows, plain, atol=0.1, rtol=0.05)  # bf16 rounding of the activations


def test_inline_by_query_rows_is_refused_where_the_family_runs_its_own_path():
    m = get_model("vit_base_patch16_xp_224", img_size=32, depth=1, embed_dim=64, num_heads=2)  # parallel blocks
    with pytest.raises(vl.InvalidParameterError, match="mode='side'"):
        vl.capture_attention(m, mode="inline", query_rows=4)
    assert capture_plan(m, 2, tokens=5000, memory_budget_mb=1.0).mode == "side"  # the views chunk beside it
