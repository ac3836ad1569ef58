"""The component analyses' arguments checked at the boundary (issue 62, items 15 and 16): images, class indices and
targets, one refusal naming the argument, before any forward runs. What each analysis computes is in
docs/definitions.md ("Decomposition", "Logit lens", "Activation patching", "Mean-ablation").
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import InvalidParameterError


def index(value: Any, what: str, size: int | None = None) -> int:
    """One index: an integer (a float only where it is a whole number), in ``[0, size)`` when ``size`` is given.

    Args:
        value: what the caller passed.
        what: the argument's name in the refusal ("target", "component ('head', 1, 2)'s layer").
        size: how many there are (None: any index >= 0).

    Returns:
        The index as an int.

    Raises:
        InvalidParameterError: a bool, text, NaN, a fraction, or an index out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (Integral, Real)) or \
            (not isinstance(value, Integral) and not (math.isfinite(float(value)) and float(value).is_integer())):
        raise InvalidParameterError(f"{what} must be a whole number (an index); got {value!r}.")
    # a whole Real (a float, a numpy float) by the check above, which reads it through float too
    i = int(value) if isinstance(value, Integral) else int(float(value))
    if i < 0 or (size is not None and i >= size):
        where = f"in [0, {size})" if size is not None else ">= 0"
        raise InvalidParameterError(f"{what} must be an index {where}; got {i}.")
    return i


def per_image(value: Any, what: str, size: int, count: int) -> torch.Tensor:
    """One index for every image, or one per image: a [count] long tensor.

    Args:
        value: an index, or a sequence of ``count`` indices.
        what: the argument's name in the refusal.
        size: how many classes (or prompts) there are.
        count: how many images.

    Returns:
        The indices [count].

    Raises:
        InvalidParameterError: an index ``index`` refuses, or a sequence of another length than the images.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return torch.full((count,), index(value, what, size), dtype=torch.long)
    if len(value) not in (1, count):
        raise InvalidParameterError(f"{what} must be one index for every image or one per image ({count}); got "
                                    f"{len(value)}.")
    found = [index(v, f"{what}[{i}]", size) for i, v in enumerate(value)]
    return torch.tensor(found * (count if len(found) == 1 else 1), dtype=torch.long)


def fixed_input_size(module: nn.Module) -> tuple[int, int] | None:
    """The one input size a model runs at, where it declares it and refuses others (None: any size, or unknown):
    a timm ViT whose patch embedding is strict and not dynamic, a torchvision ViT."""
    embed = getattr(module, "patch_embed", None)
    if embed is not None and getattr(embed, "strict_img_size", False) and \
            not getattr(module, "dynamic_img_size", False):
        size = getattr(embed, "img_size", None)
        if isinstance(size, (tuple, list)) and len(size) == 2:
            return int(size[0]), int(size[1])
    if type(module).__module__.startswith("torchvision.") and isinstance(getattr(module, "image_size", None), int):
        return int(module.image_size), int(module.image_size)
    return None


def check_pixels(pixels: torch.Tensor, module: nn.Module, what: str = "pixels") -> torch.Tensor:
    """Preprocessed images [B, 3, H, W] that the model can run: at least one image, finite values, and the model's
    own input size where it runs at one size only (``fixed_input_size``).

    Args:
        pixels: the images.
        module: the model that will read them.
        what: the argument's name in the refusal ("pixels", "reference", "clean").

    Returns:
        ``pixels``.

    Raises:
        InvalidParameterError: no image, a NaN or infinite value, or another size than the model runs at.
    """
    if pixels.shape[0] == 0:
        raise InvalidParameterError(f"{what} holds no image: pass at least one.")
    if pixels.is_floating_point() and not bool(torch.isfinite(pixels).all()):
        raise InvalidParameterError(f"{what} holds NaN or infinite values: pass preprocessed images.")
    size = fixed_input_size(module)
    if size is not None and tuple(pixels.shape[-2:]) != size:
        raise InvalidParameterError(f"{what} is {pixels.shape[-2]}x{pixels.shape[-1]} px, but the model runs at "
                                    f"{size[0]}x{size[1]} px only: preprocess the images with the model's data "
                                    "config (vl.preprocess, or a LoadedModel's preprocess).")
    return pixels


__all__ = ["check_pixels", "fixed_input_size", "index", "per_image"]
