"""What every component analysis takes first: the torch module inside a ``LoadedModel`` and the pixels it is fed
(its residual stream is read through its site map, ``layout``)."""
from __future__ import annotations

import torch
from torch import nn

from .arguments import check_pixels
from ..errors import InvalidParameterError
from ..images import preprocess


def module_of(model: object, who: str) -> tuple[nn.Module, str]:
    """The torch module inside a ``LoadedModel`` (or the module itself) and its name."""
    inner = getattr(model, "model", model)
    if not isinstance(inner, nn.Module):
        raise InvalidParameterError(f"{who} takes a vitlens LoadedModel or a torch module, not "
                                    f"{type(model).__name__}.")
    spec = getattr(model, "spec", None)
    return inner, str(getattr(spec, "name", "") or type(inner).__name__)


def pixels_for(model: object, module: nn.Module, pixels: object, what: str = "pixels") -> torch.Tensor:
    """[B, 3, H, W] on the module's device and dtype (a LoadedModel's preprocessing for anything else), checked at
    the boundary (``arguments.check_pixels``: at least one image, finite, the model's own size where it has one);
    ``what`` names the argument in a refusal."""
    config = getattr(model, "data_config", None)
    if not torch.is_tensor(pixels) and config:
        pixels = preprocess(pixels, config)
    if not torch.is_tensor(pixels) or pixels.dim() != 4:
        raise InvalidParameterError(f"{what} must be a [B, 3, H, W] tensor of preprocessed images (or, with a "
                                    "LoadedModel, anything vl.preprocess reads).")
    first = next(module.parameters())
    return check_pixels(pixels, module, what).to(device=first.device, dtype=first.dtype)
