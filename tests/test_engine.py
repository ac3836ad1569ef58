"""The streaming engine's consumer protocol: what a consumer is told and in which order, partial
states that merge into the state over all images, and one image's attention maps with the
query-token arithmetic the app uses."""
from __future__ import annotations

import pickle
from typing import Sequence

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.views.rollout import RolloutAccumulator
from conftest import get_model


class Recorder(vl.AttentionConsumer):
    """A consumer that writes down every call it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin_batch(self, batch: vl.BatchInfo) -> None:
        self.calls.append(("begin", batch.index, batch.start, batch.size, batch.grid, batch.input_size,
                           None if batch.labels is None else batch.labels.tolist()))

    def on_attention(self, layer: int, attn: torch.Tensor) -> None:
        self.calls.append(("attention", layer, tuple(attn.shape)))

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        self.calls.append(("end", tuple(logits.shape)))


def test_consumers_hear_begin_every_block_in_order_and_end_with_the_logits(tiny):
    rec = Recorder()
    x = torch.randn(5, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    n = vl.stream_attention(tiny, x, [rec], batch_size=3, labels=np.arange(5))
    assert n == 5
    t = 197
    want = []
    for index, (start, size) in enumerate([(0, 3), (3, 2)]):
        want.append(("begin", index, start, size, (14, 14), (224, 224), list(range(start, start + size))))
        want += [("attention", layer, (size, 3, t, t)) for layer in range(12)]
        want.append(("end", (size, 1000)))
    assert rec.calls == want


def test_the_logits_consumers_see_are_the_models_own(tiny):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    seen = []

    class Logits(vl.AttentionConsumer):
        def end_batch(self, logits=None):
            seen.append(logits)

    vl.stream_attention(tiny, x, [Logits()])
    assert torch.equal(seen[0], tiny.logits(x))  # side capture: bit-identical


def test_distance_accumulators_of_shards_merge_into_the_whole_in_any_order(tiny):
    x = torch.randn(6, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    whole = vl.attention_distance(tiny, x, batch_size=6)
    parts = []
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        acc = AttentionDistanceAccumulator.for_model(tiny.spec)
        vl.stream_attention(tiny, x[sl], [acc], capture_mode=None)  # the views' capture
        parts.append(pickle.loads(pickle.dumps(acc)))  # as if it came back from a worker
    for order in ([0, 1, 2], [2, 0, 1]):
        merged = parts[order[0]].merge(parts[order[1]]).merge(parts[order[2]])
        got = merged.result(tiny.spec)
        assert got.n_images == 6
        np.testing.assert_allclose(got.mean_px, whole.mean_px, rtol=1e-12)
        np.testing.assert_allclose(got.std_px, whole.std_px, rtol=1e-9)


def test_rollout_accumulators_merge_in_image_order_with_predictions(tiny):
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    whole = vl.attention_rollout(tiny, x)
    a, b = RolloutAccumulator.for_model(tiny), RolloutAccumulator.for_model(tiny)
    vl.stream_attention(tiny, x[:1], [a], capture_mode=None)
    vl.stream_attention(tiny, x[1:], [b], capture_mode=None)
    merged = pickle.loads(pickle.dumps(a)).merge(b).result(tiny.spec)
    assert merged.equals(whole, rtol=1e-6)  # float32 logits depend a little on the batch they ran in
    assert merged.predictions.tolist() == tiny.logits(x).argmax(-1).tolist()
    assert merged.image_size == (224, 224)


def test_accumulators_of_different_settings_do_not_merge(tiny):
    a = AttentionDistanceAccumulator.for_model(tiny.spec, renormalize=True)
    b = AttentionDistanceAccumulator.for_model(tiny.spec, renormalize=False)
    with pytest.raises(vl.InvalidParameterError):
        a.merge(b)
    with pytest.raises(vl.InvalidParameterError):
        RolloutAccumulator.for_model(tiny).merge(RolloutAccumulator.for_model(tiny, head_fusion="max"))


def test_a_new_view_is_one_consumer_class(tiny):
    """The extension point: a consumer that keeps the mean attention each head pays to the class token."""

    class ClassTokenShare(vl.AttentionConsumer):
        def __init__(self) -> None:
            self.sums = np.zeros((12, 3))
            self.n = 0

        def on_attention(self, layer, attn):
            self.sums[layer] += attn[:, :, 1:, 0].mean(-1).sum(0).double().numpy()
            if layer == 0:
                self.n += attn.shape[0]

        def result(self, spec):
            return self.sums / self.n

    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(4))
    c = ClassTokenShare()
    vl.stream_attention(tiny, x, [c], batch_size=2)
    with torch.no_grad(), vl.capture_attention(tiny) as cap:
        tiny.model(x)
    want = np.stack([a[:, :, 1:, 0].mean(-1).mean(0).double().numpy() for a in cap.maps])
    np.testing.assert_allclose(c.result(tiny.spec), want, rtol=1e-6)


def test_query_token_counts_prefix_tokens_and_rows():
    spec = get_model("deit_tiny_distilled_patch16_224").spec  # class + distillation token, 14x14
    assert vl.query_token(spec) == 0
    assert vl.query_token(spec, 0, 0) == 2
    assert vl.query_token(spec, 1, 6) == 2 + 14 + 6
    assert vl.query_token(spec, 13, 13) == 2 + 195
    with pytest.raises(vl.InvalidParameterError, match="grid"):
        vl.query_token(spec, 14, 0)
    gap = get_model("vit_little_patch16_reg4_gap_256", img_size=128).spec
    with pytest.raises(vl.InvalidParameterError, match="no class token"):
        vl.query_token(gap)


def test_attention_maps_of_one_image_equal_the_captured_maps_and_answer_queries():
    m = get_model("vit_tiny_patch16_224", img_size=(64, 96))  # non-square: 4x6 grid
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    res = vl.attention_maps(m, x)
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.model(x)
    assert res.maps.shape == (12, 3, 25, 25) and res.grid == (4, 6)
    np.testing.assert_array_equal(res.maps, np.stack([a[0].numpy() for a in cap.maps]))
    q = vl.query_token(m.spec, 2, 5)
    got = res.query_attention(3, q)
    assert got.shape == (3, 4, 6)
    np.testing.assert_array_equal(got[:, 1, 4], cap.maps[3][0, :, q, 1 + 1 * 6 + 4].numpy())
    rows = res.query_rows(3, q)
    assert len(rows) == 3 * 24 and rows[0] == {"layer": 4, "head": 1, "query": q, "row": 0, "col": 0,
                                                 "attention": float(got[0, 0, 0])}


def test_nothing_of_vitlens_keeps_the_model_or_the_images_alive_after_a_view():
    """Issue 19: a notebook user who deletes the model and images gets the memory back (no
    module-global last pass holding them)."""
    import gc
    import weakref

    m = vl.load_model("vit_tiny_patch16_224", pretrained=False, device="cpu")
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    photos = vl.sample_images()[:1]
    d = vl.attention_distance(m, x, batch_size=2)
    r = vl.attention_rollout(m, x, batch_size=2)
    a = vl.analyze(m, photos, views=("distance", "rollout", "prefix"))
    attr = vl.attribute(m, x[:1], method="rollout")
    refs = [weakref.ref(m), weakref.ref(m.model), weakref.ref(x), weakref.ref(photos[0])]
    del m, x, photos
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4
    assert d.n_images == 2 and r.maps.shape[0] == 2 and a.distance.n_images == 1 and attr.maps.shape[0] == 1


def test_distance_then_rollout_equals_analyze_of_both(tiny):
    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    both = vl.analyze(tiny, x, batch_size=3, views=("distance", "rollout"))
    assert both.distance.equals(vl.attention_distance(tiny, x, batch_size=3))
    assert both.rollout.equals(vl.attention_rollout(tiny, x, batch_size=3))


def split_rows(attn: torch.Tensor, sizes: Sequence[int]) -> list[tuple[torch.Tensor, slice]]:
    """A whole map [B, H, T, T] as blocks of ``sizes`` query rows (the last takes the rest), as
    query-chunked capture hands them over."""
    t, out, start = attn.shape[-2], [], 0
    for size in list(sizes) + [t]:
        stop = min(t, start + int(size))
        if stop > start:
            out.append((attn[:, :, start:stop], slice(start, stop)))
        start = stop
        if start >= t:
            break
    return out



@pytest.mark.parametrize("sizes", [(1,), (5, 2, 11), (60,)])  # uneven blocks; one that splits the prefix off
def test_every_consumer_gives_identical_results_from_whole_maps_and_from_row_blocks(sizes):
    """Issue 19: consumers take a layer's attention as blocks of query rows as well as whole."""
    from vitlens.views.prefix import PrefixAttentionAccumulator

    m = get_model("deit_tiny_distilled_patch16_224", img_size=(64, 96))  # 2 prefix tokens, 4x6 grid: T = 26
    x = torch.randn(3, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), vl.capture_attention(m) as cap:
        logits = m.model(x)
    maps = cap.maps
    info = vl.BatchInfo(index=0, start=0, size=3, input_size=(64, 96), grid=(4, 6), device=torch.device("cpu"))

    def consumers():
        return [AttentionDistanceAccumulator.for_model(m.spec), AttentionDistanceAccumulator.for_model(m.spec, False),
                RolloutAccumulator.for_model(m), RolloutAccumulator.for_model(m, "max", 0.5),
                PrefixAttentionAccumulator.for_model(m.spec)]

    whole, blocks = consumers(), consumers()
    for c in whole + blocks:
        c.begin_batch(info)
    for layer, a in enumerate(maps):
        for c in whole:
            c.on_attention(layer, a)
        for part, rows in split_rows(a, sizes):
            for c in blocks:
                c.on_attention(layer, part, rows)
    for c in whole + blocks:
        c.end_batch(logits)
    for w, b in zip(whole, blocks):
        assert w.result(m.spec).equals(b.result(m.spec)), type(w).__name__  # bit for bit


def test_row_blocks_that_do_not_match_the_attention_are_refused(tiny):
    acc = AttentionDistanceAccumulator.for_model(tiny.spec)
    acc.begin_batch(vl.BatchInfo(index=0, start=0, size=1, input_size=(224, 224), grid=(14, 14),
                                 device=torch.device("cpu")))
    with pytest.raises(vl.InvalidParameterError, match="do not match"):
        acc.on_attention(0, torch.full((1, 3, 4, 197), 1 / 197), slice(0, 5))


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in model.modules())


def test_every_hook_session_removes_its_hooks_on_exit_and_on_error(tiny):
    """Issue 19: attention capture, token norms, CKA features and head ablation share one managed
    hook mechanism (HookSession), which leaves no hook behind, also when the forward raises."""
    from vitlens.compare.cka import OutputHooks
    from vitlens.compare.heads import HeadAblation
    from vitlens.views.prefix import TokenNorms

    before = _hook_count(tiny.model)
    sites = [tiny.family.head_outputs(a) for a in tiny.family.attention_modules(tiny.model)]
    sessions = [lambda: vl.capture_attention(tiny), lambda: vl.capture_attention(tiny, mode="inline"),
                lambda: TokenNorms(tiny), lambda: OutputHooks(tiny.blocks(), tiny.block_names(), {}),
                lambda: HeadAblation(sites, tiny.spec.num_heads, "zero")]
    x = torch.randn(1, 3, 224, 224)
    for make in sessions:
        with make():
            assert _hook_count(tiny.model) > before
            tiny.logits(x)
        assert _hook_count(tiny.model) == before
        with pytest.raises(ZeroDivisionError):
            with make():
                1 / 0
        assert _hook_count(tiny.model) == before
    assert torch.equal(tiny.logits(x), tiny.logits(x))  # nothing left that changes the forward


@pytest.mark.parametrize("name,kwargs", [("vit_tiny_patch16_224", {}), ("deit_tiny_distilled_patch16_224", {}),
                                         ("eva02_tiny_patch14_224", {"img_size": 112})])
def test_query_chunked_side_capture_gives_the_same_maps_and_views_as_whole_maps(name, kwargs):
    """Issue 20's lever: the family computes softmax(q k^T) a block of queries at a time from the
    very q and k of the untouched fused forward (uneven blocks: 50 rows, the last shorter)."""
    m = get_model(name, **kwargs)
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad(), vl.capture_attention(m) as whole:
        logits = m.model(x)
    with torch.no_grad(), vl.capture_attention(m, query_rows=50) as chunked:
        assert torch.equal(m.model(x), logits)  # the model's own forward is untouched
    for a, b in zip(whole.maps, chunked.maps):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)  # the same rows, computed in blocks
    t = whole.maps[0].shape[-1]
    assert t % 50 != 0  # the last block is shorter
    rows_seen = []

    class Rows(vl.AttentionConsumer):
        def on_attention(self, layer, attn, rows=None):
            rows_seen.append((layer, None if rows is None else (rows.start, rows.stop)))

    consumers = [AttentionDistanceAccumulator.for_model(m.spec), RolloutAccumulator.for_model(m), Rows()]
    vl.stream_attention(m, x, consumers, query_rows=50)
    blocks = [(start, min(t, start + 50)) for start in range(0, t, 50)]
    assert rows_seen == [(layer, b) for layer in range(m.spec.num_layers) for b in blocks]  # in order, every row once
    want = vl.analyze(m, x, views=("distance", "rollout"))
    from vitlens.views.distance import FLOAT32_RTOL

    np.testing.assert_allclose(consumers[0].result(m.spec).mean_px, want.distance.mean_px, rtol=2 * FLOAT32_RTOL)
    np.testing.assert_allclose(consumers[1].result(m.spec).maps, want.rollout.maps, rtol=1e-5, atol=1e-7)


def test_query_rows_from_a_memory_budget():
    from vitlens.engine.plan import query_rows_for_budget

    assert query_rows_for_budget(4, 12, 2305, budget_mb=256) == 256 * 2**20 // (4 * 4 * 12 * 2305)
    assert query_rows_for_budget(1, 1, 10, budget_mb=1000) == 10 and query_rows_for_budget(512, 16, 4097, 1) == 1
