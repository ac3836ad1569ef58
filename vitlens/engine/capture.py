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
  exactly and the fused run to float rounding. With ``query_rows`` (timm ViTs), the non-fused
  path is computed a block of query rows at a time and each block is handed over before it is
  multiplied by v: high resolutions without a whole map and without a second q k^T.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import InvalidParameterError
from ..families import CaptureRequest, Handles, HookSession, family_of
from ..core.attention import attention_probs
from ..core.native import SoftmaxTaps
from ..loading.model import LoadedModel
from .consumer import AttentionConsumer, query_rows
from .plan import CAPTURE_MODES

AttentionCallback = Callable[[int, torch.Tensor], None]


@dataclass
class _Joined(SoftmaxTaps):
    """Two consumers' asks in one pass: filling it fills both."""

    parts: tuple = ()

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "filled":
            for part in getattr(self, "parts", ()):
                part.filled = value


class AttentionCapture(HookSession):
    """Context manager that captures the attention probabilities of every block.

    Use ``vl.capture_attention(m)``; after a forward, ``maps[l]`` is block l's [B, heads, T, T]
    attention (float32, detached), T = prefix tokens + patch tokens. Callbacks are called as
    ``callback(layer_index, attn)`` the moment each block's attention exists, so a statistic can
    be accumulated without keeping any map (``store=False``).
    """

    def __init__(self, m: LoadedModel | nn.Module, store: bool = True,
                 consumers: Iterable[AttentionCallback] = (), mode: str = "side", detach: bool = True,
                 query_rows: int | None = None) -> None:
        if mode not in CAPTURE_MODES:
            raise InvalidParameterError(f"mode must be one of {', '.join(CAPTURE_MODES)}; got {mode!r}.")
        if not detach and mode != "inline":
            raise InvalidParameterError("detach=False needs mode='inline': only then does the output depend on "
                                        "the captured maps.")
        if query_rows is not None and int(query_rows) < 1:
            raise InvalidParameterError(f"query_rows must be >= 1 (queries per block of probabilities); got "
                                        f"{query_rows!r}.")
        if isinstance(m, LoadedModel):
            self.model, self.family = m.model, m.family
        else:
            self.model, self.family = m, family_of(m)
        can = self.family.abilities(self.model)
        if query_rows is not None and mode == "inline" and not can.inline_rows:
            raise InvalidParameterError(
                f"query_rows with mode='inline' needs a family whose non-fused path vitlens computes by query rows "
                f"(timm's standard Attention); {self.family.name} runs its own path, which makes whole maps: use "
                "mode='side' (the probabilities computed by query rows beside the model's own forward).")
        if mode == "inline" and not can.has_inline:
            raise InvalidParameterError(f"{self.family.name} models have no non-fused path to capture inline; "
                                        "use mode='side'.")
        self.mode = mode
        self.detach = detach
        self.store = store
        self.consumers: list[AttentionCallback] = list(consumers)
        self.query_rows = None if query_rows is None else int(query_rows)
        self._maps: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}  # a layer's whole map being filled from its row blocks

    @property
    def maps(self) -> list[torch.Tensor]:
        """Attention of each block from the latest forward, first block first."""
        return [self._maps[i] for i in sorted(self._maps)]

    def _emit(self, layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        """A block's map, whole or as query rows: streaming consumers hear every row block; the
        stored maps and plain callbacks get the whole map once its last rows have come."""
        for consumer in self._streaming:
            consumer(layer, probs, rows)
        whole = probs
        if rows is not None:
            wanted = self.store or bool(self._plain)
            if not wanted:
                return
            start, stop, last = query_rows(probs, rows)
            if start == 0 and last:
                whole = probs.clone()
            else:  # a row block is only valid during the call (its memory is the next block's): copied in
                if start == 0:
                    self._rows[layer] = probs.new_empty(*probs.shape[:-2], probs.shape[-1], probs.shape[-1])
                self._rows[layer][..., start:stop, :] = probs
                if not last:
                    return
                whole = self._rows.pop(layer)
        if self.store:
            self._maps[layer] = whole
        for callback in self._plain:
            callback(layer, whole)

    def _taps(self, layer: int, rows: slice, shape: tuple) -> SoftmaxTaps | None:
        """What the streaming consumers want block ``layer``'s rows ``rows`` softmax pass to compute: the first
        consumer's ask of each kind (distance sums, head mean) in one ``SoftmaxTaps``; the asks it holds are marked
        filled when it is (the others compute theirs from the probabilities)."""
        asks = [t for t in (c.softmax_tap(layer, rows, shape) for c in self._streaming) if t is not None]
        if not asks:
            return None
        distance = next((t for t in asks if t.distances is not None), None)
        mean = next((t for t in asks if t.mean is not None or t.half_mean is not None), None)
        if distance is mean or mean is None or distance is None:
            return distance or mean
        return _Joined(distances=distance.distances, first=distance.first, prefix=distance.prefix,
                       key_block=distance.key_block, sums=distance.sums, mean=mean.mean, half_mean=mean.half_mean,
                       half_scale=mean.half_scale, parts=(distance, mean))

    def install(self, handles: Handles) -> None:
        # streaming consumers hear row blocks; plain callbacks (and the stored maps) want whole maps
        self._streaming = [c for c in self.consumers if isinstance(c, AttentionConsumer)]
        self._plain = [c for c in self.consumers if not isinstance(c, AttentionConsumer)]
        request = CaptureRequest(self._emit, self.mode, self.query_rows, self.detach, views=bool(self._streaming),
                                 taps=self._taps if self._streaming and self.detach else None,
                                 reuse_maps=not self.store and not self._plain)
        if self.mode == "inline":
            self.family.install_inline(self.model, request, handles)
        else:
            self.family.install_side(self.model, request, handles)


def capture_attention(m: LoadedModel | nn.Module, store: bool = True,
                      consumers: Iterable[AttentionCallback] = (), mode: str = "side",
                      detach: bool = True, query_rows: int | None = None) -> AttentionCapture:
    """Capture every block's attention probabilities during forwards inside the ``with`` block.

    Args:
        m: a LoadedModel (or a supported model module).
        store: keep the maps of the latest forward in ``.maps`` (False: callbacks only, no memory).
        consumers: callables ``f(layer_index, attn[B, heads, T, T])`` called as each block finishes.
        mode: "side" (outputs bit-for-bit unchanged; attention computed beside the fused
            forward) or "inline" (the non-fused path; maps are the ones the output uses).
        detach: with mode="inline", False keeps the maps in the autograd graph (for gradients).
        query_rows: let the family compute each block's probabilities this many queries at a time:
            with mode="side" timm's ViT and EVA families do (others make whole maps); with
            mode="inline", timm ViTs with the standard ``Attention`` (``CaptureAbilities.inline_rows``; others
            are refused), whose output is then computed from those very blocks. Streaming consumers
            (``AttentionConsumer``) then get row blocks and no [B, heads, T, T] map need exist at once
            (unless ``store`` or a plain callback asks for whole maps).

    Returns:
        An ``AttentionCapture`` context manager; inside the ``with`` block, every forward fills ``.maps``
            (one [B, heads, T, T] float32 tensor per block, probabilities over keys) and calls the consumers.
            The hooks are removed on exit and on error.

    Raises:
        UnsupportedModelError: a model no family can capture exactly.
        InvalidParameterError: an unknown mode, or ``query_rows`` where the family cannot honour it.
    """
    return AttentionCapture(m, store=store, consumers=consumers, mode=mode, detach=detach, query_rows=query_rows)


__all__ = ["AttentionCapture", "CAPTURE_MODES", "attention_probs", "capture_attention"]
