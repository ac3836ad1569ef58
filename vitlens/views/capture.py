"""Exact capture of every block's post-softmax attention, handed over as it is made.

Serves every attention view of the paper (Fig. 6/14 rollout, Fig. 7 right and Fig. 11
attention distance). Two modes, both exact; the model's family (``vitlens.families``) installs
the hooks:

- ``mode="side"`` (default): the model's own forward is left untouched, fused attention
  included, so its outputs are bit-for-bit those of a run without capture. Beside it, the
  probabilities are computed from the very queries and keys the block uses, in float32 even
  when the model runs under bf16 autocast.
- ``mode="inline"``: each block runs its family's own non-fused path and the probabilities are
  taken as they enter dropout: no extra work beyond un-fusing, and the captured maps are the
  ones the output depends on (what gradient methods need). Outputs then equal a non-fused run
  exactly and the fused run to float rounding.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import InvalidParameterError
from ..families import Handles, HookSession, family_of
from ..core.attention import attention_probs
from ..loading.model import LoadedModel

AttentionCallback = Callable[[int, torch.Tensor], None]
CAPTURE_MODES = ("side", "inline")


class AttentionCapture(HookSession):
    """Context manager that captures the attention probabilities of every block.

    Use ``vl.capture_attention(m)``; after a forward, ``maps[l]`` is block l's [B, heads, T, T]
    attention (float32, detached), T = prefix tokens + patch tokens. Callbacks are called as
    ``callback(layer_index, attn)`` the moment each block's attention exists, so a statistic can
    be accumulated without keeping any map (``store=False``).
    """

    def __init__(self, m: LoadedModel | nn.Module, store: bool = True,
                 consumers: Iterable[AttentionCallback] = (), mode: str = "side", detach: bool = True) -> None:
        if mode not in CAPTURE_MODES:
            raise InvalidParameterError(f"mode must be one of {', '.join(CAPTURE_MODES)}; got {mode!r}.")
        if not detach and mode != "inline":
            raise InvalidParameterError("detach=False needs mode='inline': only then does the output depend on "
                                        "the captured maps.")
        if isinstance(m, LoadedModel):
            self.model, self.family = m.model, m.family
        else:
            self.model, self.family = m, family_of(m)
        if mode == "inline" and not self.family.has_inline:
            raise InvalidParameterError(f"{self.family.name} models have no non-fused path to capture inline; "
                                        "use mode='side'.")
        self.mode = mode
        self.detach = detach
        self.store = store
        self.consumers: list[AttentionCallback] = list(consumers)
        self._maps: dict[int, torch.Tensor] = {}

    @property
    def maps(self) -> list[torch.Tensor]:
        """Attention of each block from the latest forward, first block first."""
        return [self._maps[i] for i in sorted(self._maps)]

    def _emit(self, layer: int, probs: torch.Tensor) -> None:
        if self.store:
            self._maps[layer] = probs
        for consumer in self.consumers:
            consumer(layer, probs)

    def install(self, handles: Handles) -> None:
        if self.mode == "inline":
            self.family.install_inline(self.model, self._emit, handles, self.detach)
        else:
            self.family.install_side(self.model, self._emit, handles)


def capture_attention(m: LoadedModel | nn.Module, store: bool = True,
                      consumers: Iterable[AttentionCallback] = (), mode: str = "side",
                      detach: bool = True) -> AttentionCapture:
    """Capture every block's attention probabilities during forwards inside the ``with`` block.

    Args:
        m: a LoadedModel (or a supported model module).
        store: keep the maps of the latest forward in ``.maps`` (False: callbacks only, no memory).
        consumers: callables ``f(layer_index, attn[B, heads, T, T])`` called as each block finishes.
        mode: "side" (outputs bit-for-bit unchanged; attention computed beside the fused
            forward) or "inline" (the non-fused path; maps are the ones the output uses).
        detach: with mode="inline", False keeps the maps in the autograd graph (for gradients).
    """
    return AttentionCapture(m, store=store, consumers=consumers, mode=mode, detach=detach)


__all__ = ["AttentionCapture", "CAPTURE_MODES", "attention_probs", "capture_attention"]
