"""``decompose``: the output as an exact sum over embeddings, heads x source tokens, MLPs and biases, with a
ledger (docs/definitions.md, "Direct contributions")."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from . import timm_vit
from .result import DecompositionResult
from .stream import module_of, pixels_for


def decompose(model: object, pixels: object, target: int | Sequence[int] | None = None,
              direction: torch.Tensor | np.ndarray | None = None) -> DecompositionResult:
    """Split what the model outputs for each image into exact parts (docs/definitions.md, "Direct contributions").

    Args:
        model: a ``LoadedModel`` (``vl.load_model``) or the module itself; timm ``VisionTransformer`` with a class
            token or average pooling (other structures are refused by name).
        pixels: [B, 3, H, W] preprocessed images (moved to the model's device and dtype); with a ``LoadedModel``,
            anything ``vl.preprocess`` reads (PIL images, paths, arrays).
        target: the class read, one for all images or one per image; default each image's predicted class.
        direction: instead of a class, a [D] direction over the pre-logits features (a text embedding, a unit
            vector); the output read is ``direction . features``.

    Returns:
        A ``DecompositionResult`` whose ledger (``ledger()``, shown in its summary) says how closely the parts add
        up to the output.
    """
    module, name = module_of(model, "decompose")
    timm_vit.refuse_unless_supported(module)
    pixels = pixels_for(model, module, pixels)
    if target is not None and direction is not None:
        raise InvalidParameterError("Give a target class or a direction, not both.")
    cap = timm_vit.capture(module, pixels)
    b = pixels.shape[0]
    if direction is not None:
        u = torch.as_tensor(np.asarray(direction), dtype=torch.float64, device=cap.features.device)
        if u.shape != (cap.features.shape[-1],):
            raise InvalidParameterError(f"direction has shape {tuple(u.shape)}; the pre-logits features have "
                                        f"{cap.features.shape[-1]} dimensions.")
        u = u.expand(b, -1)
        output = (cap.features.double() * u).sum(-1)
        labels = torch.full((b,), -1, dtype=torch.long)
        const = torch.zeros(b, dtype=torch.float64, device=u.device)
    else:
        n_classes = cap.logits.shape[-1]
        labels = (cap.logits.argmax(-1) if target is None else
                  torch.as_tensor(target, dtype=torch.long).expand(b)).to(cap.logits.device)
        if ((labels < 0) | (labels >= n_classes)).any():
            raise InvalidParameterError(f"target must be a class index in [0, {n_classes}).")
        u = module.head.weight.detach().double()[labels]
        output = cap.logits.double().gather(1, labels[:, None])[:, 0]
        bias = module.head.bias
        const = bias.detach().double()[labels] if bias is not None else torch.zeros(b, dtype=torch.float64)
    parts = timm_vit.contributions(module, cap, u)
    parts["readout_bias"] = parts["readout_bias"] + const.to(parts["readout_bias"].device)
    n_patch = cap.final_in.shape[1] - module.num_prefix_tokens
    grid = tuple(getattr(module.patch_embed, "grid_size", None) or (n_patch, 1))
    return DecompositionResult(
        output=output.cpu().numpy(), target=labels.cpu().numpy(),
        **{k: v.cpu().numpy() for k, v in parts.items()},
        num_prefix_tokens=int(module.num_prefix_tokens), grid=tuple(int(g) for g in grid), model_name=name,
        direction="direction" if direction is not None else "class")
