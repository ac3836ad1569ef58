"""What a capture is asked to do (``CaptureRequest``: where the probabilities go, side or inline, by rows) and
what a family's capture can do (``CaptureAbilities``): the two objects between ``capture_plan`` and a family's
``install_side`` / ``install_inline`` (``vitlens.families.base`` re-exports them)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

Emit = Callable[..., None]
"""Where a capture sends each block's probabilities: ``emit(layer, probs)`` with a whole map [B, heads, T, T],
or ``emit(layer, probs, rows)`` with the query rows ``rows`` of it (see ``vitlens.engine.stream``)."""


@dataclass(frozen=True)
class CaptureRequest:
    """What a family's install receives: one explicit object saying what to capture and where to send it.

    Calling the request hands a block's probabilities on: ``request(layer, probs)`` (a whole map) or
    ``request(layer, probs, rows)`` (the query rows ``rows`` of it).

    Attributes:
        emit: where each block's probabilities go (``Emit``).
        mode: "side" (beside the model's own forward, its outputs untouched) or "inline" (the family's
            non-fused path; the maps are the ones the output is computed from).
        query_rows: how many query rows the family may compute at a time (None: whole maps). A family that
            cannot go by rows makes whole maps (``CaptureAbilities`` says which can).
        detach: inline only: hand over detached probabilities (False: in the autograd graph).
        views: whether views listen (streaming consumers, which read every token as a patch of one grid):
            a family refuses inputs whose tokens are not that (padded or packed batches) when they do.
        taps: ``taps(layer, rows, shape)``: what the views want a block of query rows' softmax pass to compute
            besides the probabilities (``vitlens.core.native.SoftmaxTaps``, or None); a family that computes the
            probabilities by rows passes ``taps_for(layer)`` to ``attention_probs_in_rows``. None: nothing asked.
        reuse_maps: nothing the capture keeps holds a map it is handed (no stored maps, no plain callbacks: streaming
            consumers alone, which copy what they keep), so a family may hand a whole map (``rows`` None) in memory
            the next block reuses, valid during the call only, as a row block always is (SAM's inline capture makes
            each block's map in the session's workspace then, no fresh 0.8 GB per global block at 1024 px).
    """

    emit: Emit
    mode: str = "side"
    query_rows: int | None = None
    detach: bool = True
    views: bool = False
    taps: Callable[[int, slice, tuple], Any] | None = None
    reuse_maps: bool = False

    def taps_for(self, layer: int) -> Callable[[slice, tuple], Any] | None:
        """Block ``layer``'s ``taps`` as ``attention_probs_in_rows`` asks them (None when nothing is asked)."""
        taps = self.taps
        if taps is None:
            return None
        return lambda rows, shape: taps(layer, rows, shape)

    def __call__(self, layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        if rows is None:
            self.emit(layer, probs)
        else:
            self.emit(layer, probs, rows)

    def sending_to(self, emit: Emit) -> "CaptureRequest":
        """The same request with its probabilities sent to ``emit`` (a family's adapter of the maps)."""
        return dataclasses.replace(self, emit=emit)


@dataclass(frozen=True)
class CaptureAbilities:
    """What a family's capture can do for a model (``Family.abilities``): what ``capture_plan`` reads.

    Attributes:
        has_inline: a non-fused path exists that inline capture reads.
        view_mode: the capture the views use: "inline" where the family's own non-fused path is cheaper than
            computing the probabilities a second time beside the fused one (measured by analyses/bench.py).
        side_rows: side capture computes the probabilities a block of query rows at a time when asked.
        inline_rows: inline capture computes the block's attention a block of query rows at a time when asked
            (the probabilities made once, the output computed from them, no whole map).
    """

    has_inline: bool = True
    view_mode: str = "inline"
    side_rows: bool = False
    inline_rows: bool = False
