"""Eager-only Hugging Face vision towers (BLIP, GIT: no sdpa implementation in transformers) read by the generic
capture at each block's one softmax call, against the model's own ``output_attentions=True`` weights."""
from __future__ import annotations

import pytest
import torch

import vitlens as vl

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)


def build(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}VisionConfig")(**SMALL)
    return getattr(transformers, f"{kind}VisionModel")(config).eval()


@pytest.mark.parametrize("kind", ["Blip", "Git"])
def test_eager_only_towers_are_exact_against_their_own_attentions(kind):
    model = build(kind)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(pixel_values=x, output_attentions=True)
    m = vl.LoadedModel.from_module(model, device="cpu")
    assert m.spec.family == "generic" and m.spec.grid == (4, 4) and m.spec.num_prefix_tokens == 1
    with torch.no_grad():
        plain = m.logits(x)
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        assert torch.equal(out, plain)
        assert len(cap.maps) == len(ref.attentions) == 2
        for got, want in zip(cap.maps, ref.attentions):
            assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5
