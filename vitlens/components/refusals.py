"""The structural refusals of the component analyses (issue 61: one reading of every model, one refusal): which timm
ViT blocks and which OpenCLIP towers give the residual sum the components read (``vitlens.components.layout``), each
refused by name otherwise. Below the layout and the readers, which all import it."""
from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .linearise import check_norm, is_identity


def refuse_other_blocks(model: nn.Module) -> None:
    """Refuse, by name, a timm ViT whose blocks are not ``x + ls1(attn(norm(x)))``, ``x + ls2(mlp(norm(x)))`` with
    a sum over heads before the projection (what every component analysis reads: ``layout``)."""
    name = type(model).__name__
    for i, block in enumerate(model.blocks):
        kind = type(block).__name__
        if kind != "Block":
            raise UnsupportedModelError(f"{name} block {i} is a {kind} (post-norm or parallel): its output is not "
                                        f"x + attn(norm(x)) + mlp(norm(x)), so it gives no residual sum.")
        attn = block.attn
        if type(attn).__name__ != "Attention" or not is_identity(getattr(attn, "norm", None)) \
                or getattr(attn, "gate", None) is not None:
            raise UnsupportedModelError(f"{name} block {i}'s attention is a {type(attn).__name__} with a norm or "
                                        f"gate before its projection: not a sum over heads.")
        for ls in (block.ls1, block.ls2):
            if not (is_identity(ls) or type(ls).__name__ == "LayerScale"):
                raise UnsupportedModelError(f"{name} block {i} scales its branches by a {type(ls).__name__}.")


def refuse_other_openclip(model: nn.Module) -> None:
    """Refuse an OpenCLIP tower the reading does not cover, by name."""
    if model.attn_pool is not None or model.pool_type not in ("tok", "avg"):
        raise UnsupportedModelError(f"OpenCLIP VisionTransformer with attentional pooling or pool {model.pool_type!r}:"
                                    f" not read; a class-token or average-pooled tower is.")
    check_norm(model.ln_pre, "pre-norm")
    check_norm(model.ln_post, "final norm")
    for i, block in enumerate(model.transformer.resblocks):
        if not isinstance(block.attn, nn.MultiheadAttention) or hasattr(block, "ln_1_kv") \
                or not is_identity(getattr(block, "ln_attn", None)):
            raise UnsupportedModelError(f"OpenCLIP block {i} uses a {type(block.attn).__name__} (custom attention: "
                                        f"qk-norm, cosine or scaled heads): not read.")


__all__ = ["refuse_other_blocks", "refuse_other_openclip"]
