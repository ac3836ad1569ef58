"""Measurements on labelled, masked images (e.g. ``vitlens.reference.shapes``): accuracy, and how much of
the rollout map (paper Fig. 6) falls on the object."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..views.analyze import attention_rollout
from .masks import MaskScores, mask_scores, masks_at_input


def accuracy(m: LoadedModel, images: Images, labels: np.ndarray, batch_size: int = 256) -> float:
    """Top-1 accuracy of the model's predictions.

    Args:
        m: the model.
        images: the images.
        labels: [N] true class indices.
        batch_size: images per forward.

    Returns:
        The share of images whose top-1 prediction equals its label, in [0, 1].
    """
    preds = []
    for x in iter_batches(images, m.data_config, batch_size):
        preds.append(m.logits(x).argmax(-1).cpu().numpy())
    return float((np.concatenate(preds) == np.asarray(labels)).mean())


def rollout_mask_scores(m: LoadedModel, images: Images, masks: np.ndarray, batch_size: int = 128,
                        **rollout_kwargs: Any) -> MaskScores:
    """Mass-in-mask and pointing game of the rollout maps of ``images`` against object ``masks``
    (masks of the original images, brought through the images' resize and crop).

    Args:
        m: the model.
        images: the images.
        masks: [N, H, W] bool object masks of the original images.
        batch_size: images per forward.
        **rollout_kwargs: passed to ``attention_rollout`` (``head_fusion``, ``discard_ratio``, ...).

    Returns:
        ``MaskScores`` of the rollout maps (as ``mask_scores``).
    """
    r = attention_rollout(m, images, batch_size=batch_size, **rollout_kwargs)
    return mask_scores(r.maps, masks_at_input(masks, m.data_config, images))
