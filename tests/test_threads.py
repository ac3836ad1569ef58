"""Issue 30 §4: two threads capturing one shared model at once each get their own maps.

Each thread opens a capture on the same model and runs several forwards of its own images inside it
(a barrier starts both together, a short sleep between forwards invites interleaving); every map it
sees must equal a single-threaded capture of its own images exactly (the same computation, so the
same bits). Without the model's lock the two sessions' hooks both see every forward and the maps
are the other thread's."""
from __future__ import annotations

import threading
import time

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


@pytest.mark.parametrize("mode", ["side", "inline"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_two_threads_get_their_own_maps(kind, mode):
    m = vl.LoadedModel.from_module(BUILDERS[kind](), name=kind, device="cpu")
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 3, 32, 32, generator=g), torch.randn(3, 3, 32, 32, generator=g)]
    alone = [capture(m, x, mode) for x in inputs]  # single-threaded references
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    seen: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}

    def work(i: int) -> None:
        try:
            barrier.wait()
            with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():
                for _ in range(3):
                    m.forward(inputs[i])
                    seen[i].append([a.clone() for a in cap.maps])
                    time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
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
