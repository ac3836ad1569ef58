"""The residual stream at every depth of a timm ViT, read with hooks on the user's own blocks (for the logit
lens and the token norms; docs/definitions.md, "Logit lens", "Token norms")."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError


def module_of(model: object, who: str) -> tuple[nn.Module, str]:
    """The torch module inside a ``LoadedModel`` (or the module itself) and its name."""
    inner = getattr(model, "model", model)
    if not isinstance(inner, nn.Module):
        raise InvalidParameterError(f"{who} takes a vitlens LoadedModel or a torch module, not "
                                    f"{type(model).__name__}.")
    spec = getattr(model, "spec", None)
    return inner, str(getattr(spec, "name", "") or type(inner).__name__)


def refuse_unless_stream(model: nn.Module, who: str) -> None:
    """Refuse a model without one residual stream through pre-norm blocks (timm's VisionTransformer)."""
    name = type(model).__name__
    if name != "VisionTransformer" or not type(model).__module__.startswith("timm"):
        raise UnsupportedModelError(f"{name}: {who} reads one residual stream through blocks whose norms and branches "
                                    "vitlens knows (timm's VisionTransformer, the towers of direct contributions); "
                                    f"{name}'s blocks are not among them.")


def pixels_for(model: object, module: nn.Module, pixels: object) -> torch.Tensor:
    """[B, 3, H, W] on the module's device and dtype (a LoadedModel's preprocessing for anything else)."""
    from ..images import preprocess

    config = getattr(model, "data_config", None)
    if not torch.is_tensor(pixels) and config:
        pixels = preprocess(pixels, config)
    if not torch.is_tensor(pixels) or pixels.dim() != 4:
        raise InvalidParameterError("pixels must be a [B, 3, H, W] tensor of preprocessed images (or, with a "
                                    "LoadedModel, anything vl.preprocess reads).")
    first = next(module.parameters())
    return pixels.to(device=first.device, dtype=first.dtype)


def residuals(model: nn.Module, pixels: torch.Tensor, with_qkv: bool = False
              ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """One forward with hooks on the blocks.

    Returns:
        ``(stream, logits, qkv)``: the residual [B, N, D] entering block 1 and leaving each block (L + 1
            entries, depth 0 = the embeddings), the model's output, and each block's ``attn.qkv`` output when
            ``with_qkv``. The hooks are removed on exit.
    """
    stream: list[torch.Tensor] = []
    qkv: list[torch.Tensor] = []
    handles = [model.blocks[0].register_forward_pre_hook(lambda mod, args: stream.append(args[0]))]
    try:
        for block in model.blocks:
            handles.append(block.register_forward_hook(lambda mod, args, out: stream.append(out)))
            if with_qkv:
                handles.append(block.attn.qkv.register_forward_hook(lambda mod, args, out: qkv.append(out)))
        with torch.no_grad():
            logits = model(pixels)
    finally:
        for h in handles:
            h.remove()
    return stream, logits, qkv
