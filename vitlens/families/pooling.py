"""The attention of a model's attention pool (a MAP head: timm's ``AttentionPoolLatent``, SigLIP's probe
attention), where the model pools through one instead of a class token: an extra map beside the
blocks' own, [B, heads, queries, T] over every token (T = prefix + patch tokens; a pool that reads the
patch tokens only, timm's ``pool_include_prefix=False`` behind registers, puts exactly zero on the prefix).

The capture is ``side`` (the model's output untouched), computed in float32 from the very queries
and keys the pool uses, as the family's block capture is::

    from vitlens.families.pooling import capture_pool_attention

    with capture_pool_attention(m) as pool:
        m.logits(x)
    probs = pool.maps[0]              # [B, heads, queries, T]
    grid = pool.patch_maps(m.spec)    # [B, heads, queries, gh, gw], the patch tokens on their grid
"""
from __future__ import annotations

from typing import Any

import torch

from .base import CaptureRequest, Family, Handles, HookSession
from ..errors import ViewNotAvailableError
from . import family_of


class PoolAttentionCapture(HookSession):
    """Context manager: the attention pool's probabilities of the latest forward in ``maps`` (one entry)."""

    def __init__(self, m: Any) -> None:
        if isinstance(getattr(m, "family", None), Family):  # a LoadedModel (families import nothing of loading)
            self.model, self.family = m.model, m.family
        else:
            self.model, self.family = m, family_of(m)
        self._maps: dict[int, torch.Tensor] = {}

    @property
    def maps(self) -> list[torch.Tensor]:
        return [self._maps[i] for i in sorted(self._maps)]

    def patch_maps(self, spec: object) -> torch.Tensor:
        """The latest map over the patch tokens only, on their grid: [B, heads, queries, gh, gw]."""
        probs = self.maps[0]
        # the ignore below: spec is a ModelSpec (typed object: families import nothing of loading)
        prefix, (gh, gw) = spec.num_prefix_tokens, spec.grid  # type: ignore[attr-defined]
        if probs.shape[-1] != prefix + gh * gw:
            raise ViewNotAvailableError(
                f"The pool's map has {probs.shape[-1]} key columns, not the {prefix} prefix + {gh}x{gw} patch tokens "
                "of this spec: pass the spec of the input the forward ran on (m.spec at its own size).")
        return probs[..., prefix:].reshape(*probs.shape[:-1], gh, gw)

    def _emit(self, layer: int, probs: torch.Tensor) -> None:
        self._maps[layer] = probs.detach()

    def install(self, handles: Handles) -> None:
        self.family.install_pool(self.model, CaptureRequest(self._emit), handles)


def capture_pool_attention(m: object) -> PoolAttentionCapture:
    """Capture the attention pool's own attention during forwards inside the ``with`` block.

    Raises:
        ViewNotAvailableError: the model pools otherwise (class token, mean), so there is no pool attention.
    """
    return PoolAttentionCapture(m)


__all__ = ["PoolAttentionCapture", "capture_pool_attention"]
