"""Issue 52, rollout's memory: the per-block maps held in float16 scaled by 2^15 where they are large
(``vitlens.views.rollout_store``), the stated bound tested — per entry (reached at rounding's halfway points, on both
sides of float16's normal range), the chain's row in l1 and, where every entry is in the normal range, entrywise;
the native half kernel against the eager one; ``analyze`` with float16 forced on a small model within the bound, and
"auto" on it bit-identical to float32 storage; which storage was used recorded in the result."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.core import native
from vitlens.engine import stream_attention
from vitlens.engine import plan as plan_module
from vitlens.views import rollout as roll
from vitlens.views.rollout import RolloutAccumulator, RolloutResult
from vitlens.views.rollout_store import (HALF_ABOVE_MB, HALF_ABS, HALF_SCALE, HALF_UNIT, MapStore, half_bound,
                                         storage_for, store_half)
from conftest import get_model

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) on PATH")
NORMAL = 2.0 ** -29  # the smallest entry in float16's normal range once scaled by 2^15
SLACK = 1e-12  # the two chains' own float64 rounding (T x 2^-53 a step), far below the bounds


@pytest.fixture(scope="module")
def small():
    return get_model("vit_tiny_patch16_224", img_size=64, depth=2)


def _half(a: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape, dtype=torch.float16)
    store_half(a.clone(), out)
    return out


def _stored(a: torch.Tensor) -> torch.Tensor:
    return _half(a).to(torch.float64) / HALF_SCALE


def test_a_stored_entry_is_within_its_bound_which_rounding_reaches_on_both_sides_of_the_normal_range():
    # halfway points between neighbouring float16 values (scaled): rounding to nearest even misses by half a spacing
    normal_half = (1 + 2.0 ** -11) * 2.0 ** -15  # 1 + 2^-11 scaled: rounds to 1, off by 2^-11 relative
    sub_half = 1.5 * 2.0 ** -39  # 1.5 subnormal spacings (2^-24) scaled: rounds to 2, off by half a spacing
    g = torch.Generator().manual_seed(0)
    spread = torch.exp(-30 * torch.rand(4000, generator=g))  # entries from ~1e-13 up to 1
    a = torch.cat([torch.tensor([0.0, 1.0, normal_half, sub_half, NORMAL, NORMAL / 2]), spread]).to(torch.float32)
    a64, got = a.to(torch.float64), _stored(a)
    err, bound = (got - a64).abs(), HALF_UNIT * a64 + HALF_ABS
    assert bool((err <= bound).all())
    assert got[0] == 0 and got[1] == 1  # zero and one exactly
    assert err[2] / bound[2] > 0.99 and err[3] / bound[3] > 0.99  # the bound is reached, above and below the edge
    tiny = a64 < NORMAL
    assert bool(tiny.any()) and float((err[tiny] / a64[tiny].clamp_min(1e-300)).max()) > 100 * HALF_UNIT  # below
    # the edge an entry keeps no relative precision: the absolute term of the bound is needed
    assert float((err[~tiny] / a64[~tiny].clamp_min(1e-300)).max()) <= HALF_UNIT


def _maps(layers: int, b: int, t: int, sharp: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(sharp * torch.randn(b, 3, t, t, generator=g), -1).mean(1) for _ in range(layers)]


def _check_row(half: torch.Tensor, full: torch.Tensor, stored: int, t: int, entrywise: bool) -> None:
    l1, rel = half_bound(stored, t)
    assert float((full.sum(-1) - 1).abs().max()) < 1e-12  # the row sums to 1 (the l1 bound's premise)
    assert float((half - full).abs().sum(-1).max()) <= l1 + SLACK
    if entrywise:
        assert bool(((half - full).abs() <= rel * full + SLACK * full).all())


@pytest.mark.parametrize("compiled", ["0", pytest.param("1", marks=needs_compiler)])
def test_the_chain_from_float16_maps_is_within_the_stated_bound(monkeypatch, compiled):
    """Eleven stored maps of 64 tokens (a ViT-B's count), all entries in the normal range: the row within the l1
    and the entrywise bound of float32 storage's row, by the eager chain and the native half kernel alike."""
    monkeypatch.setenv(native.COMPILE_ENV, compiled)
    maps = _maps(11, 2, 64, 2.0, seed=1)
    assert min(float(m.min()) for m in maps) >= NORMAL
    full = roll.rollout_row(maps, 1, True)
    half = roll.rollout_row([_half(m) for m in maps], 1, True)
    _check_row(half, full, 11, 64, entrywise=True)
    assert float((half - full).abs().max()) > 0  # float16 did round


def test_tiny_entries_below_the_normal_range_keep_the_l1_bound():
    """Hand-built maps near the edge: every row one large entry and the rest tiny (1e-11 to 1e-9, below 2^-29 once
    scaled: stored with an absolute error, up to ~10% relative), the row within the l1 bound."""
    t, g = 48, torch.Generator().manual_seed(2)
    maps = []
    for _ in range(6):
        tiny = 10 ** (-11 + 2 * torch.rand(2, t, t, generator=g, dtype=torch.float64))
        big = torch.randint(0, t, (2, t), generator=g)
        a = tiny.scatter(-1, big[..., None], 0.0)
        a = a.scatter(-1, big[..., None], (1 - a.sum(-1, keepdim=True)))
        maps.append(a.to(torch.float32))
    stored = _stored(maps[0])
    small_ones = maps[0].to(torch.float64) < NORMAL
    assert float(((stored - maps[0]).abs()[small_ones] / maps[0][small_ones]).max()) > 0.01  # relative precision lost
    full = roll.rollout_row(maps, 1, True)
    half = roll.rollout_row([_half(m) for m in maps], 1, True)
    _check_row(half, full, 6, t, entrywise=False)


@needs_compiler
def test_the_native_half_step_is_the_eager_one(monkeypatch):
    maps = [_half(m) for m in _maps(2, 2, 130, 3.0, seed=3)]  # 130: a row that is no whole number of 8-lanes
    v = torch.rand(2, 130, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    got = roll.rollout_row(maps, 1, True, v)
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    want = roll.rollout_row(maps, 1, True, v)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=130 * np.finfo(np.float64).eps)


def test_auto_holds_float16_only_where_one_images_maps_are_large():
    vit_b = RolloutAccumulator(12, 1, True)  # the last block streamed: 11 maps kept
    assert storage_for("auto", 11, 2305) == "float32" and storage_for("auto", 11, 4097) == "float16"
    assert 4 * 11 * 2305 ** 2 <= HALF_ABOVE_MB * 2**20 < 4 * 11 * 4097 ** 2
    assert vit_b.held_bytes_per_image(4097) == 2 * 11 * 4097 ** 2  # 1024 px: half the bytes
    assert vit_b.held_bytes_per_image(2305) == 4 * 11 * 2305 ** 2  # 768 px: float32 as before
    assert RolloutAccumulator(12, 1, True, precision="float16").held_bytes_per_image(197) == 2 * 11 * 197 ** 2
    assert RolloutAccumulator(12, 1, True, precision="float32").held_bytes_per_image(4097) == 4 * 11 * 4097 ** 2
    with pytest.raises(vl.InvalidParameterError, match="rollout precision must be one of auto, float32, float16; "
                                                        "got 'half'"):
        RolloutAccumulator(12, 1, True, precision="half")


def test_the_store_is_made_once_and_reused_by_smaller_batches():
    store = MapStore()
    first = store.slot(0, 3, 2, 5, torch.float16, torch.device("cpu"))
    again = store.slot(2, 3, 1, 5, torch.float16, torch.device("cpu"))  # a smaller last sub-batch: the same memory
    assert first.shape == (2, 5, 5) and again.shape == (1, 5, 5) and again.is_contiguous()
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
    bigger = store.slot(0, 3, 4, 5, torch.float16, torch.device("cpu"))
    assert bigger.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    buf = store.buffer(2, 5, torch.device("cpu"))
    assert buf.dtype == torch.float32 and store.buffer(1, 5, torch.device("cpu")).data_ptr() == buf.data_ptr()


def _rows(monkeypatch) -> list[torch.Tensor]:
    """The rolled-out rows [b, T] float64 of every batch ``end_batch`` maps (before the max normalisation)."""
    seen: list[torch.Tensor] = []
    real = roll.row_map

    def keep(row, prefix, grid):
        seen.append(row.clone())
        return real(row, prefix, grid)

    monkeypatch.setattr(roll, "row_map", keep)
    return seen


@pytest.mark.parametrize("budget", [None, pytest.param(0.01, marks=needs_compiler)])
def test_analyze_with_float16_forced_is_within_the_bound_and_auto_is_float32_to_the_bit(monkeypatch, small, budget):
    """A 2-block ViT at 64 px (17 tokens): whole maps, and by query rows through the native taps (``budget``);
    three images in sub-batches of one where split (the store reused)."""
    if budget is not None:
        monkeypatch.setenv(native.COMPILE_ENV, "1")
        monkeypatch.setattr(plan_module, "HELD_BLOCKS", 1e-12)  # one image per forward
        monkeypatch.setattr(plan_module, "HELD_FLOOR_MB", 0.0)
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    rows = _rows(monkeypatch)
    got, by = {}, {}
    for p in ("auto", "float32", "float16"):
        rows.clear()
        got[p] = vl.analyze(small, x, views=("rollout",), rollout_precision=p, memory_budget_mb=budget).rollout
        by[p] = torch.cat(rows)
    assert got["auto"].map_storage == got["float32"].map_storage == "float32"
    assert got["float16"].map_storage == "float16" and "maps held in float16" in got["float16"].title()
    np.testing.assert_array_equal(got["auto"].maps, got["float32"].maps)  # small maps: float32, bit-identical
    stored = small.spec.num_layers - 1  # the last block streamed
    _check_row(by["float16"], by["float32"], stored, by["float32"].shape[-1], entrywise=False)
    # the map divides the patch row by its maximum M: within 2 e / (M - e) of float32's for the row's l1 bound e
    e = half_bound(stored, by["float32"].shape[-1])[0] + SLACK
    peak = by["float32"][:, 1:].amax(-1).numpy()
    diff = np.abs(got["float16"].maps - got["float32"].maps).reshape(3, -1).max(-1)
    assert (diff <= 2 * e / (peak - e)).all() and diff.max() > 0
    np.testing.assert_array_equal(got["float16"].predictions, got["float32"].predictions)


def test_the_storage_travels_with_the_result(small):
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    r = vl.attention_rollout(small, x, precision="float16")
    back = RolloutResult.from_dict(r.to_dict())
    assert back.map_storage == "float16" and back.equals(r)
    acc = RolloutAccumulator.for_model(small, precision="float16")
    stream_attention(small, x, [acc], batch_size=1)
    merged = acc.merge(RolloutAccumulator.for_model(small))
    assert merged.map_storage == "float16" and merged.precision == "float16"
    with pytest.raises(vl.InvalidParameterError, match="rollout precision must be one of"):
        vl.analyze(small, x, views=("rollout",), rollout_precision="bfloat16")


def _scaled_ties(scaled: torch.Tensor) -> tuple[int, int]:
    """(entries of ``scaled`` (float32, a map times 2^15) exactly halfway between two float16 neighbours, entries in
    float16's subnormal range and not 0): the cases where rounding to nearest even decides."""
    x = scaled.to(torch.float64).flatten()
    sub = (x > 0) & (x < 2.0 ** -14)
    half_way_sub = sub & (torch.frac(x * 2.0 ** 24) == 0.5)
    bits = scaled.flatten().view(torch.int32)
    half_way_normal = (x >= 2.0 ** -14) & ((bits & 0x1FFF) == 0x1000)
    return int(half_way_sub.sum() + half_way_normal.sum()), int(sub.sum())


@needs_compiler
def test_the_softmax_pass_writes_store_halfs_float16_numbers_to_the_bit(monkeypatch):
    """Two images, 3 heads, 300 keys (no whole number of 8 or 16 lanes: the conversion's tail), two row blocks of a
    padded buffer, query rows from flat to sharp (entries down to float16's subnormals and 0 once scaled): the float16
    mean the pass writes into a [2, T, T] slot's rows is ``store_half`` of the float32 mean it writes otherwise, bit
    for bit, ties to even included; asked for both, the float32 mean is the same too."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    b, h, t, ld = 2, 3, 300, 320
    sharp = torch.linspace(0.5, 40.0, t)[None, None, :, None]
    scores = torch.randn(b, h, t, t, generator=torch.Generator().manual_seed(5)) * sharp
    got = torch.full((b, t, t), float("nan"), dtype=torch.float16)
    want = torch.empty(b, t, t, dtype=torch.float16)
    scaled = torch.empty(b, t, t)
    for start, stop in ((0, 128), (128, t)):
        def block(start: int = start, stop: int = stop) -> torch.Tensor:  # a fresh padded copy of the rows
            buf = torch.empty(b, h, stop - start, ld)
            buf[..., :t] = scores[:, :, start:stop]
            return buf[..., :t]

        mean = torch.empty(b, stop - start, t)
        assert native.softmax_taps(block(), native.SoftmaxTaps(mean=mean))
        both = native.SoftmaxTaps(mean=torch.empty_like(mean), half_mean=torch.empty(b, stop - start, t,
                                  dtype=torch.float16), half_scale=HALF_SCALE)
        assert native.softmax_taps(block(), both)
        assert torch.equal(both.mean, mean)
        store_half(mean, want[:, start:stop])  # the old path: the float32 mean scaled in place, then copied
        scaled[:, start:stop] = mean
        taps = native.SoftmaxTaps(half_mean=got[:, start:stop], half_scale=HALF_SCALE)
        assert native.softmax_taps(block(), taps) and taps.filled
        assert torch.equal(both.half_mean.view(torch.int16), want[:, start:stop].view(torch.int16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ties, subnormal = _scaled_ties(scaled)
    assert ties > 0 and subnormal > 0 and bool((scaled == 0).any())  # the cases rounding decides were there


@needs_compiler
def test_a_float16_tap_the_kernel_cannot_write_is_refused_and_nothing_changes(monkeypatch):
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    scores = torch.randn(1, 2, 4, 70, generator=torch.Generator().manual_seed(6))
    wide = torch.zeros(1, 4, 80, dtype=torch.float16)
    for half, scale in ((torch.zeros(1, 4, 70), HALF_SCALE),  # float32, not float16
                        (torch.zeros(1, 5, 70, dtype=torch.float16), HALF_SCALE),  # another shape
                        (wide[..., :70], HALF_SCALE),  # rows not T apart
                        (torch.zeros(1, 4, 70, dtype=torch.float16), 3.0)):  # scaling that would round
        block = scores.clone()
        taps = native.SoftmaxTaps(half_mean=half, half_scale=scale)
        assert not native.softmax_taps(block, taps) and not taps.filled
        assert torch.equal(block, scores) and not bool(half.any())
    assert not bool(wide.any())


def _held_maps(monkeypatch) -> list[list[torch.Tensor]]:
    """The maps every batch's chain starts from (``rollout_row``'s list: the stored float16 slots), copied."""
    seen: list[list[torch.Tensor]] = []
    real = roll.rollout_row

    def keep(fused, *args, **kwargs):
        seen.append([f.clone() for f in fused])
        return real(fused, *args, **kwargs)

    monkeypatch.setattr(roll, "rollout_row", keep)
    return seen


@needs_compiler
@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("source", [None, "pool"])
def test_float16_maps_written_by_the_softmax_pass_are_the_old_paths_to_the_bit(monkeypatch, small, source,
                                                                               refused):
    """Two images in one forward, inline by blocks of 5 query rows (fewer than T), attention distance beside (one
    pass fills both views' taps): float16 storage forced, the maps the chain starts from and the result are those
    of the old path (the float32 mean by the pass, then
    ``store_half``) to the bit, with no float32 buffer made; with the last block streamed (the class token) and with
    every block stored (a MAP head's pool as the source). ``refused``: the kernel refuses every other row block
    (the eager softmax runs; those rows are fused and stored as before, row block by row block)."""
    from vitlens.core import attention
    from vitlens.views.distance import AttentionDistanceAccumulator
    from test_families import tiny_open_clip

    monkeypatch.setenv(native.COMPILE_ENV, "1")
    m = small if source is None else vl.LoadedModel.from_module(tiny_open_clip(timm_trunk=True).eval(),
                                                                 name="oc-map")
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(7))
    real, asked = attention.softmax_taps, []

    def taps(scores, t):
        asked.append(t.half_mean is not None)
        return False if refused and len(asked) % 2 == 0 else real(scores, t)

    monkeypatch.setattr(attention, "softmax_taps", taps)
    held = _held_maps(monkeypatch)
    runs = {}
    for path in ("pass", "old"):
        if path == "old":
            monkeypatch.setattr(RolloutAccumulator, "_half_from_pass", lambda self, tokens: False)
        asked.clear()
        acc = RolloutAccumulator.for_model(m, precision="float16", source=source)
        distance = AttentionDistanceAccumulator.for_model(m)
        stream_attention(m, x, [distance, acc], batch_size=2, capture_mode="inline", query_rows=5)
        no_buffer = acc._store._buffer is None  # (looked at before ``result`` lets the store go)
        runs[path] = (acc.result(m.spec), held[-1], no_buffer, any(asked), distance.result().mean_px)
    (new, new_maps, no_buffer, half_asked, new_px), (old, old_maps, old_no_buffer, old_half, old_px) = \
        runs["pass"], runs["old"]
    np.testing.assert_array_equal(new_px, old_px)
    assert half_asked and no_buffer  # the pass wrote the slots: no float32 [B, T, T] buffer made
    assert not old_half and not old_no_buffer  # the old path: the buffer, then store_half
    tokens = m.spec.num_tokens()
    assert tokens > 5 and len(new_maps) == len(old_maps) == m.spec.num_layers - (source is None)
    for a, b in zip(new_maps, old_maps):
        assert a.dtype == torch.float16 and a.shape == (2, tokens, tokens)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    np.testing.assert_array_equal(new.maps, old.maps)
    assert new.map_storage == old.map_storage == "float16"
