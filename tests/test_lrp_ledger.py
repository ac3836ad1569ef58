"""AttnLRP's conservation ledger closes to the target score within 1e-6 relative in float64 on a timm ViT (ref-vit),
a hybrid (ref-hybrid: BatchNorm shifts in its CNN stem) and an open_clip tower, and on a hand-built case each share
is known."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.attribution.lrp_ledger import ENTRIES, attnlrp_ledger


def scenes(n: int) -> list:
    from vitlens.reference.shapes import HELD_OUT_SEED, generate

    return list(generate(n, seed=HELD_OUT_SEED).images)


@pytest.mark.parametrize("name", ["ref-vit", "ref-hybrid"])
def test_the_ledger_closes_to_the_logit_on_the_reference_models(name, tmp_path):
    m = vl.load_model(name, device="cpu")
    state = {k: v.clone() for k, v in m.model.state_dict().items()}
    led = attnlrp_ledger(m, scenes(3))
    assert all(torch.equal(v, state[k]) for k, v in m.model.state_dict().items())  # the user's model untouched
    assert led.dtype == "float64" and led.closure().max() < 1e-6
    # the score is the predicted class's logit (float32 model vs its float64 copy: within float32 rounding)
    from vitlens.images import iter_batches

    logits = m.logits(next(iter(iter_batches(scenes(3), m.data_config, 3)))).double().numpy()
    assert led.targets.tolist() == logits.argmax(1).tolist()
    np.testing.assert_allclose(led.score, logits.max(1), rtol=1e-4, atol=1e-4)
    assert np.all(np.abs(led.position) > 0) and np.all(np.abs(led.softmax) > 0) and np.all(np.abs(led.prefix) > 0)
    assert set(led.to_rows()[0]) >= {"score", *ENTRIES, "closure"}
    assert vl.load_result(led.save(tmp_path / "l.json")).equals(led)


def test_the_ledger_closes_on_an_open_clip_tower():
    import open_clip

    torch.manual_seed(0)
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
                                                               head_width=16),
                                 text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1))
    with torch.no_grad():
        for name, p in model.visual.named_parameters():  # open_clip initialises biases at 0: give them weight
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    m = vl.LoadedModel.from_module(model, name="openclip", device="cpu")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    led = attnlrp_ledger(m, x, target=[3, 7])
    assert led.targets.tolist() == [3, 7] and led.closure().max() < 1e-6
    with torch.no_grad():
        want = m.forward(x)[torch.arange(2), torch.tensor([3, 7])].double().numpy()
    np.testing.assert_allclose(led.score, want, rtol=1e-4, atol=1e-5)
    assert np.all(np.abs(led.biases) > 0) and np.all(np.abs(led.position) > 0) and np.all(np.abs(led.prefix) > 0)


def test_uniform_attention_hands_half_its_branch_to_the_softmax_a_known_ledger():
    """One timm block, norms as identities, every bias and the position table at zero, queries and keys at zero
    (uniform attention: scores 0, so s * dR/ds = 0) and fc2 at zero (no MLP): the class token's output is
    cls + P Wv mean_j(token_j), so the score is w.cls + f_attn with f_attn = w P Wv (cls + sum of patches) / T. The
    uniform rule hands half of A v's relevance to A, all of which the softmax absorbs; the other half goes through
    v to the tokens, the class token's share to ``prefix`` with w.cls, the patches' to the input."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              embed_dim=16, num_heads=2, num_classes=3, norm_layer=torch.nn.Identity)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "pos_embed" in name or "mlp.fc2" in name:
                p.zero_()
            elif name.endswith("qkv.weight"):
                p.normal_(0, 0.5)
                p[:32].zero_()  # the query and key rows
            elif p.ndim >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
    m = vl.LoadedModel.from_module(model, name="one-block", device="cpu")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    led = attnlrp_ledger(m, x, target=1)
    md = model.double()
    with torch.no_grad():
        cls = md.cls_token[0, 0]
        patches = md.patch_embed(x.double()).sum(1)  # [B, D]
        n_tokens = md.patch_embed.num_patches + 1
        w_p_wv = md.head.weight[1] @ md.blocks[0].attn.proj.weight @ md.blocks[0].attn.qkv.weight[32:48]
        f_cls, f_patches = float(w_p_wv @ cls) / n_tokens, (patches @ w_p_wv).numpy() / n_tokens
        w_cls = float(md.head.weight[1] @ cls)
    np.testing.assert_allclose(led.score, w_cls + f_cls + f_patches, rtol=1e-10)
    np.testing.assert_allclose(led.softmax, (f_cls + f_patches) / 2, rtol=1e-10)
    np.testing.assert_allclose(led.prefix, w_cls + f_cls / 2, rtol=1e-10)
    np.testing.assert_allclose(led.input, f_patches / 2, rtol=1e-10)
    np.testing.assert_allclose(led.position, 0.0, atol=1e-15)
    np.testing.assert_allclose(led.biases, 0.0, atol=1e-15)


def test_the_ledger_as_shown_writes_a_tiny_closure_gap_in_scientific_notation():
    """Issue 45 item 19: the closure row read "0.0000000000000001" in the app; the shown rows (app and report)
    give every number 3 significant digits, a tiny one in scientific notation, and leave the closure's share blank."""
    from vitlens.attribution.lrp_ledger import ConservationLedger
    from vitlens.report.html import ledger_section

    score = np.array([10.0])
    parts = dict(input=np.array([6.0]), position=np.array([1.0]), prefix=np.array([1.0]), biases=np.array([1.0]),
                 softmax=np.array([1.0 + 1e-15]))
    led = ConservationLedger(score=score, targets=np.array([0]), **parts)
    shown = {row["entry"]: row for row in led.shown_rows()}
    closure = next(row for name, row in shown.items() if name.startswith("closure"))
    assert closure["relevance"] == f"{led.closure().max():.3g}" and "e-1" in closure["relevance"]
    assert closure["share"] == ""
    assert shown["input pixels"]["relevance"] == "6" and shown["input pixels"]["share"] == "0.6"
    page = ledger_section(type("T", (), {"ledger": led})())
    assert closure["relevance"] in page and "0.00000000" not in page
