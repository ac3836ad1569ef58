"""Segmentation from the spatial decomposition (Gandelsman, Efros, Steinhardt, ICLR 2024, Sec. 5.1, their
``compute_segmentations.py``) as an attribution method on the one contract (images in, [B, gh, gw] maps out): each
source token's direct contribution to the output, summed over layers and heads (``vl.decompose``'s
``heads[b, l, h, j]``; docs/definitions.md, "Direct contributions"), read at the patch tokens. The output is the
target class's logit on a classifier (the embedded pair) and the image-text cosine similarity for a prompt on a CLIP
tower (the decomposition along the prompt's embedding, divided by the image embedding's norm).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from .builtin import Scorer


def _tower(m: LoadedModel) -> Any:
    """What ``decompose`` reads for a prompt: an OpenCLIP model's vision tower (its ``visual``), else the model."""
    visual = getattr(m.model, "visual", None)
    return visual if isinstance(visual, torch.nn.Module) else m


def spatial_refusal(m: LoadedModel) -> str:
    """Why the spatial decomposition is not defined for ``m`` ("" where it is): it needs a class logit or a prompt's
    similarity (an output linear in the parts), read by a model ``vl.decompose`` reads."""
    from ..components.decompose import refusal
    from .text import has_text_tower

    if has_text_tower(m):
        tower = _tower(m)
        why = refusal(tower)
        return (f"spatial_decomposition reads {m.spec.name}'s vision tower as vl.decompose does, and {why}" if why
                else "")
    if m.spec.num_classes <= 0:
        return (f"spatial_decomposition explains a class's logit or a prompt's similarity; {m.spec.name} has neither "
                "a classifier head nor a text tower (its output's norm is not a sum of parts).")
    why = refusal(m)
    return f"spatial_decomposition reads the model as vl.decompose does, and {why}" if why else ""


def _per_token(result: Any) -> np.ndarray:
    """[B, gh, gw] the heads' parts summed over layers and heads, at the patch tokens."""
    values = result.heads.sum((1, 2))[:, result.num_prefix_tokens:]
    return values.reshape(values.shape[0], *result.grid)


def spatial_decomposition_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
                               params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    """Each patch token's direct contribution, through every head of every layer, to the target's score.

    Args:
        m: the model.
        x: [B, 3, H, W] preprocessed images.
        t: [B] the class (or prompt) each image's map explains.
        grid: the patch-token grid.
        params: none.
        score: the scorer; a prompt's (``text.PromptScore``) carries the prompts' unit embeddings.

    Returns:
        ``(maps [B, gh, gw], targets [B])``.
    """
    from ..components.decompose import decompose

    directions = getattr(score, "directions", None)
    if directions is None:
        if m.spec.num_classes <= 0:
            raise InvalidParameterError(f"{m.spec.name} has no classes: the spatial decomposition explains a class's "
                                        "logit or, on a CLIP model, the similarity to a prompt (target='a photo of "
                                        "...').")
        maps = _per_token(decompose(m, x, target=t.tolist()))
    else:
        tower = _tower(m)
        with torch.no_grad():
            norm = m.forward(x).double().flatten(1).norm(dim=-1).cpu().numpy()
        maps = np.zeros((x.shape[0], *grid))
        labels = t.cpu().numpy()
        for k in np.unique(labels):
            rows = np.flatnonzero(labels == k)
            u = directions[int(k)].double().cpu().numpy()
            part = _per_token(decompose(tower, x[torch.as_tensor(rows, device=x.device)], direction=u))
            maps[rows] = part / norm[rows, None, None]
    if tuple(maps.shape[1:]) != tuple(grid):
        raise InvalidParameterError(f"the decomposition's grid {maps.shape[1:]} is not the model's patch grid {grid}.")
    return maps, t.cpu().numpy()


__all__ = ["spatial_decomposition_maps", "spatial_refusal"]
