"""One hook layer (issue 61, item 1; docs/definitions.md, "Named sites"): every analysis beside attention reads the
model through named sites (``vitlens.engine.sites``) of one site map (``vitlens.components.layout``); capture leaves
the logits bit-for-bit those of a plain forward; a new site is one ``register_site`` call; the component analyses read
the same models (a Hugging Face ``ViTForImageClassification`` included) and refuse the others in one line; two
threads on one model never mix what their sites saw; no module hook sits outside the hook layer."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlens as vl
from test_components_towers import build
from vitlens.components.layout import Layout, read_sites
from vitlens.engine.sites import HookPoint, SiteSession, record, register_site, unregister_site
from vitlens.errors import UnsupportedModelError

ROOT = Path(__file__).resolve().parents[1]
HF_KINDS = ["vit-cls", "vit", "dinov2", "dinov2-cls", "torchvision"]


def timm_vit() -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=5, reg_tokens=1).double().eval()


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


#: a toy site registered in this one module: the input every block's attention reads (its pre-attention norm's output)
ATTN_IN = "blocks.*.hook_attn_in"


def _attn_in(model: torch.nn.Module, points: dict) -> dict:
    blocks = getattr(model, "blocks", None)
    return {} if blocks is None else {f"blocks.{i}.hook_attn_in": HookPoint(b.norm1) for i, b in enumerate(blocks)}


def test_a_toy_analysis_reads_a_new_site_registered_in_one_module(pixels: torch.Tensor) -> None:
    m = timm_vit()
    register_site(ATTN_IN, _attn_in)
    try:
        def attention_input_norms(model: torch.nn.Module, x: torch.Tensor) -> list[float]:  # the toy analysis
            seen = read_sites(model, x, [f"blocks.{i}.hook_attn_in" for i in range(len(model.blocks))])
            return [float(seen[f"blocks.{i}.hook_attn_in"].norm()) for i in range(len(model.blocks))]

        got = attention_input_norms(m, pixels)
        resid = read_sites(m, pixels, ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"])
        with torch.no_grad():
            want = [float(b.norm1(resid[f"blocks.{i}.hook_resid_pre"]).norm()) for i, b in enumerate(m.blocks)]
        assert got == want
        assert "blocks.1.hook_attn_in" in Layout(m).points()
    finally:
        unregister_site(ATTN_IN)
    assert "blocks.1.hook_attn_in" not in Layout(m).points()


@pytest.mark.parametrize("kind", ["timm", *HF_KINDS, "siglip"])
def test_reading_every_site_leaves_the_logits_bit_identical(kind: str, pixels: torch.Tensor) -> None:
    m = timm_vit() if kind == "timm" else build(kind)
    layout = Layout(m)
    with torch.no_grad():
        plain = layout.run(pixels)
    seen, hooked = record(m, layout.points(), lambda: layout.run(pixels))
    assert torch.equal(hooked, plain)
    assert len(seen) == len(layout.points())
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())


@pytest.mark.parametrize("kind", HF_KINDS)
def test_logit_lens_and_token_norms_read_what_decompose_reads(kind: str, pixels: torch.Tensor) -> None:
    m = build(kind)
    classes = kind in ("vit-cls", "dinov2-cls", "torchvision")
    direction = None if classes else torch.randn(3, 32, generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.float64)
    assert vl.decompose(m, pixels, target=0 if classes else None,
                        direction=None if classes else direction[0]).closes()
    lens = vl.logit_lens(m, pixels, direction=direction)
    np.testing.assert_array_equal(lens.pooled[:, -1], lens.output)  # the last depth is the output
    norms = vl.token_norms(m, pixels)
    assert norms.norms.shape == (2, 3, 17) and norms.num_prefix_tokens == 1
    if kind == "torchvision":
        return
    with torch.no_grad():  # Hugging Face's own hidden states: the residual entering block 1 and leaving each block
        hidden = m(pixel_values=pixels, output_hidden_states=True).hidden_states
    np.testing.assert_array_equal(norms.norms, torch.stack([h.norm(dim=-1) for h in hidden], 1).numpy())
    if kind == "vit-cls":
        with torch.no_grad():
            by_hand = m.classifier(m.vit.layernorm(hidden[1])[:, 0])
        np.testing.assert_allclose(lens.pooled[:, 1], by_hand.gather(1, torch.as_tensor(lens.target)[:, None])[:, 0])


def test_patching_the_last_mlp_of_a_hugging_face_vit_equals_the_patch_by_hand(pixels: torch.Tensor) -> None:
    m = build("vit-cls")
    clean, corrupted = pixels[:1], pixels[1:]
    r = vl.patch_activations(m, clean, corrupted)
    last = m.vit.layers[-1]

    def mid(x: torch.Tensor) -> torch.Tensor:  # the residual between the last block's attention and its MLP
        h = m(pixel_values=x, output_hidden_states=True).hidden_states[-2]
        return h + last.attention(last.layernorm_before(h))[0]

    with torch.no_grad():
        mlp_clean = last.mlp(last.layernorm_after(mid(clean)))
        logits = m.classifier(m.vit.layernorm(mid(corrupted) + mlp_clean)[:, 0])
    np.testing.assert_allclose(r.mlp[-1], float(logits[0, r.target]), rtol=1e-12)
    a = vl.mean_ablate(m, pixels, [("head", 0, 1), ("layer", 1)])
    assert a.score == "logit" and a.after.shape == (2,)


def test_every_component_analysis_refuses_an_unread_model_in_the_same_line(pixels: torch.Tensor) -> None:
    import transformers as tf

    swin = tf.SwinModel(tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                      window_size=4)).double()
    messages = set()
    for fn in (vl.decompose, vl.logit_lens, vl.token_norms, vl.mean_ablate, vl.patch_activations):
        args = {vl.mean_ablate: ([("mlp", 0)],), vl.patch_activations: (pixels[1:],)}.get(fn, ())
        with pytest.raises(UnsupportedModelError) as err:
            fn(swin, pixels[:1], *args)
        messages.add(str(err.value))
    assert len(messages) == 1 and "SwinModel" in messages.pop()


def test_two_threads_on_one_model_never_mix_their_sites(pixels: torch.Tensor) -> None:
    m = timm_vit()
    layout = Layout(m)
    seen: list[torch.Tensor] = []
    inside, other_done = threading.Event(), threading.Event()

    def session() -> None:
        with SiteSession(m, {"blocks.1.hook_resid_post": layout.points()["blocks.1.hook_resid_post"]},
                         lambda name, value: seen.append(value)), torch.no_grad():
            inside.set()
            other_done.wait(10)
            m(pixels[:1])

    def plain() -> None:  # a forward of another thread that does not take the model's lock
        inside.wait(10)
        with torch.no_grad():
            m(pixels)
        other_done.set()

    threads = [threading.Thread(target=session), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 1 and seen[0].shape[0] == 1  # only the session's own forward, of one image


def test_no_module_hook_outside_the_hook_layer() -> None:
    layer = ("families", "engine", "core")
    found = [f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "vitlens").rglob("*.py"))
             if p.relative_to(ROOT / "vitlens").parts[0] not in layer
             and re.search(r"register_forward_hook|register_forward_pre_hook|register_full_backward", p.read_text())]
    assert found == []


def test_the_family_declares_each_blocks_residual_and_heads_sites(tiny, ref_vit) -> None:
    from vitlens.engine.sites import family_sites

    for m in (tiny, ref_vit):
        sites = family_sites(m)
        blocks = m.blocks()
        assert [sites[f"blocks.{i}.hook_resid_post"].module for i in range(len(blocks))] == blocks
        assert all(sites[f"blocks.{i}.hook_resid_pre"].at == "input" for i in range(len(blocks)))
        heads = [m.family.head_outputs(a) for a in m.family.attention_modules(m.model)]
        assert [sites[f"blocks.{i}.attn.hook_z"].module for i in range(len(blocks))] == heads
        x = torch.randn(1, 3, *m.spec.image_size)
        with torch.no_grad():
            plain = m.model(x)
        seen, hooked = record(m.model, sites, lambda: m.model(x))
        assert torch.equal(hooked, plain) and len(seen) == len(sites)
