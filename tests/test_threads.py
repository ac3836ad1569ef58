"""Issue 30 §4: two threads capturing one shared model at once each get their own maps.

Each thread opens a capture on the same model and runs several forwards of its own images inside it
(a barrier starts both together, a short sleep between forwards invites interleaving); every map it
sees must equal a single-threaded capture of its own images exactly (the same computation, so the
same bits). Without the model's lock the two sessions' hooks both see every forward and the maps
are the other thread's. Models that share their parts (two built from one transformers config, a model and its
tower) share the lock; a plain ``module(x)`` from another thread during a view is not counted in it."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

import vitlens as vl


def timm_vit():
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, num_classes=5)


def hf_vit():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tr.ViTForImageClassification(tr.ViTConfig(num_labels=5, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, image_size=32,
                                                     patch_size=8, attn_implementation="sdpa"))


def open_clip_vit():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    return open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
                                                              head_width=16),
                                text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1))


BUILDERS = {"timm": timm_vit, "hf-sdpa": hf_vit, "openclip": open_clip_vit}


def capture(m, x, mode):
    with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():
        m.forward(x)
    return [a.clone() for a in cap.maps]


def in_two_threads(work: Callable[[int], None], timeout: float) -> None:
    """``work(0)`` and ``work(1)`` in two threads started together (a barrier); an error of either is failed here."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread is still running"


@pytest.mark.parametrize("mode", ["side", "inline"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_two_threads_get_their_own_maps(kind, mode):
    m = vl.LoadedModel.from_module(BUILDERS[kind](), name=kind, device="cpu")
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 3, 32, 32, generator=g), torch.randn(3, 3, 32, 32, generator=g)]
    alone = [capture(m, x, mode) for x in inputs]  # single-threaded references
    seen: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}

    def work(i: int) -> None:
        with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():
            for _ in range(3):
                m.forward(inputs[i])
                seen[i].append([a.clone() for a in cap.maps])
                time.sleep(0.01)

    in_two_threads(work, timeout=60)
    for i in (0, 1):
        assert len(seen[i]) == 3
        for maps in seen[i]:
            assert len(maps) == len(alone[i]) == 2
            for got, want in zip(maps, alone[i]):
                assert got.shape == want.shape and torch.equal(got, want)


def test_a_forward_waits_for_another_threads_session():
    """A plain m.forward from a second thread waits while a capture session is on the model (its hooks would
    otherwise see that forward), and runs once the session is over."""
    m = vl.LoadedModel.from_module(timm_vit(), name="timm", device="cpu")
    x, y = torch.randn(1, 3, 32, 32), torch.randn(2, 3, 32, 32)
    done = threading.Event()

    def other() -> None:
        with torch.no_grad():
            m.forward(y)
        done.set()

    with vl.capture_attention(m) as cap, torch.no_grad():
        t = threading.Thread(target=other)
        t.start()
        assert not done.wait(0.3)  # blocked on the model's lock
        m.forward(x)  # this thread's own forward re-enters the lock
        assert cap.maps[0].shape[0] == 1
    t.join(30)
    assert done.is_set() and cap.maps[0].shape[0] == 1


def test_lrp_mode_holds_the_model_lock():
    from vitlens.attribution.lrp import attnlrp_mode

    m = vl.LoadedModel.from_module(timm_vit(), name="timm", device="cpu")
    got: list[bool] = []
    with attnlrp_mode(m):
        t = threading.Thread(target=lambda: got.append(m.lock.acquire(timeout=0.2)))
        t.start()
        t.join(10)
    assert got == [False]  # another thread could not take the lock while the mode's switches were on
    assert m.lock.acquire(timeout=1)
    m.lock.release()


def hf_pair():
    """Two transformers ViTs built from one config object (transformers gives both the same object), other
    weights."""
    tr = pytest.importorskip("transformers")
    config = tr.ViTConfig(num_labels=5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, image_size=32, patch_size=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    first = tr.ViTForImageClassification(config)
    torch.manual_seed(1)
    second = tr.ViTForImageClassification(config)
    assert first.config is second.config
    return first, second


def _held_session_blocks(first, second, mode: str) -> tuple[bool, list[BaseException]]:
    """A capture on ``first`` is open in one thread; a capture on ``second`` opened from another: whether the second
    got in before the first closed, and the errors of both."""
    inside, go, second_in = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    x = torch.randn(1, 3, 32, 32)

    def run(model, entered: threading.Event, wait: threading.Event | None) -> None:
        try:
            with vl.capture_attention(model, mode=mode) as cap, torch.no_grad():
                entered.set()
                if wait is not None:
                    wait.wait(10)
                model(pixel_values=x)
                assert len(cap.maps) == 2
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    a = threading.Thread(target=run, args=(first, inside, go))
    a.start()
    inside.wait(10)
    b = threading.Thread(target=run, args=(second, second_in, None))
    b.start()
    early = second_in.wait(0.3)
    go.set()
    a.join(30)
    b.join(30)
    return early, errors


@pytest.mark.parametrize("mode", ["inline", "side"])
def test_models_of_one_config_share_the_lock_and_the_config_is_restored(mode):
    """Two models built from one config, captured from two threads: the second capture waits for the first (the
    config object is one of the parts they share), and the config is left as it was. Without the shared lock the
    inline captures interleaved set-and-restore of ``_attn_implementation`` and left it at "vitlens_inline"."""
    first, second = hf_pair()
    early, errors = _held_session_blocks(first, second, mode)
    assert not errors, errors
    assert not early  # waited for the first capture's lock
    assert first.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("mode", ["inline", "side"])
def test_a_model_and_its_tower_share_the_lock(mode):
    """A capture on a classifier and one on its ``.vit`` tower (the same modules) from two threads: one after the
    other, each with its own maps."""
    first, _ = hf_pair()
    early, errors = _held_session_blocks(first, first.vit, mode)
    assert not errors, errors
    assert not early


@pytest.mark.parametrize("mode", ["inline", "side"])
def test_two_threads_on_models_of_one_config_get_their_own_maps(mode):
    """Two threads, each capturing its own model of one shared config over and over: every map equals the
    single-threaded one, no error on the way, and the config restored after."""
    first, second = hf_pair()
    models = [vl.LoadedModel.from_module(m, name=f"m{i}", device="cpu") for i, m in enumerate((first, second))]
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 3, 32, 32, generator=g), torch.randn(3, 3, 32, 32, generator=g)]
    alone = [capture(m, x, mode) for m, x in zip(models, inputs)]
    seen: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}

    def work(i: int) -> None:
        for _ in range(6):
            seen[i].append(capture(models[i], inputs[i], mode))

    in_two_threads(work, timeout=120)
    assert first.config._attn_implementation == "sdpa"
    for i in (0, 1):
        assert len(seen[i]) == 6
        for maps in seen[i]:
            assert all(torch.equal(got, want) for got, want in zip(maps, alone[i], strict=True))


@pytest.mark.parametrize("mode", ["inline", "side"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_plain_forward_from_another_thread_is_not_counted(kind, mode):
    """During a capture, another thread calls the module itself (``model(x)``, which does not wait for the lock)
    in the middle of the capture's own forward: that forward runs as without the capture (no vitlens error, its
    own output), and the capture hears only its own forward (each block once, its own batch)."""
    module = BUILDERS[kind]()
    m = vl.LoadedModel.from_module(module, name=kind, device="cpu")
    x, y = torch.randn(1, 3, 32, 32), torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        plain = m.family.logits(module, y)
    heard: list[tuple[int, int]] = []
    other: dict[str, object] = {}

    def foreign() -> None:
        try:
            with torch.no_grad():
                other["out"] = m.family.logits(module, y)
        except BaseException as e:  # noqa: BLE001 (asserted below)
            other["error"] = e

    def consumer(layer: int, attn: torch.Tensor) -> None:
        heard.append((layer, int(attn.shape[0])))
        if layer == 0 and "thread" not in other:
            other["thread"] = t = threading.Thread(target=foreign)
            t.start()
            t.join(30)

    with vl.capture_attention(m, mode=mode, consumers=[consumer], store=False), torch.no_grad():
        m.forward(x)
    assert "error" not in other, other.get("error")
    assert heard == [(0, 1), (1, 1)]
    torch.testing.assert_close(other["out"], plain, rtol=1e-5, atol=1e-6)
    if mode == "side":
        assert torch.equal(other["out"], plain)


def test_a_plain_forward_loop_during_views_changes_nothing():
    """Another thread runs the module itself in a loop while ``analyze`` computes attention distance and rollout
    on the same model: the views' numbers are those computed alone, and the other thread sees no error."""
    module = timm_vit()
    m = vl.LoadedModel.from_module(module, name="timm", device="cpu")
    x, y = torch.randn(2, 3, 32, 32), torch.randn(4, 3, 32, 32)
    alone = vl.analyze(m, x, views=("distance", "rollout"))
    stop = threading.Event()
    errors: list[BaseException] = []
    runs = [0]

    def loop() -> None:
        try:
            with torch.no_grad():
                while not stop.is_set():
                    module(y)
                    runs[0] += 1
        except BaseException as e:  # noqa: BLE001 (asserted below)
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    try:
        results = [vl.analyze(m, x, views=("distance", "rollout")) for _ in range(5)]
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert runs[0] > 0
    for got in results:
        assert torch.equal(torch.as_tensor(got.distance.mean_px), torch.as_tensor(alone.distance.mean_px))
        assert torch.equal(torch.as_tensor(got.rollout.maps), torch.as_tensor(alone.rollout.maps))
