"""The consumer protocol of the streaming engine (``vitlens.engine.stream`` describes it): what a
batch tells a consumer (``BatchInfo``), the consumer base class (``AttentionConsumer``) and the
reading of a row block (``query_rows``). Below both the capture, which hands consumers their row
blocks, and the engine, which drives the capture, so neither imports the other for it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..core.native import SoftmaxTaps
from ..core.spec import ModelSpec
from ..errors import InvalidParameterError

C = TypeVar("C", bound="AttentionConsumer")


@dataclass(frozen=True)
class BatchInfo:
    """What a consumer learns about a batch before its attention arrives.

    Attributes:
        index: batch number in this stream (0-based).
        start: stream index of the batch's first image.
        size: images in the batch.
        input_size: (H, W) input pixels.
        grid: (gh, gw) patch-token grid at that input size.
        device: where the attention tensors live.
        labels: [size] class labels, when the image set has them.
        masks: [size, H, W] bool object masks, when the image set has them.
    """

    index: int
    start: int
    size: int
    input_size: tuple[int, int]
    grid: tuple[int, int]
    device: torch.device
    labels: np.ndarray | None = None
    masks: np.ndarray | None = None

    @classmethod
    def of(cls, grid: tuple[int, int], input_size: tuple[int, int] | None = None, size: int = 0,
           device: torch.device | str = "cpu") -> "BatchInfo":
        """A batch described by its grid alone (feeding a consumer by hand, e.g. captured maps)."""
        grid = (int(grid[0]), int(grid[1]))
        return cls(index=0, start=0, size=size, input_size=(input_size[0], input_size[1]) if input_size else (0, 0),
                   grid=grid,
                   device=torch.device(device))


class AttentionConsumer:
    """Base class of the streaming consumers (see the module docstring for the protocol)."""

    # The flags below say which kinds of maps other than a ViT's the consumer reads: each is a kind's
    # ``Kind.reader`` (``vitlens.kinds``), and the stream refuses a model of that kind for a consumer whose flag is
    # not True (a new kind's flag needs no default here: an undeclared flag reads as False).
    #: whether the consumer reads a windowed model's window maps [B * windows, heads, N, N] (Swin: the views of
    #: ``vitlens.views.windowed``); the stream refuses a hierarchical model for a consumer that does not
    reads_windows = False
    #: whether the consumer reads a model with class-attention layers (CaiT: [B, heads, N, N] maps over the patches
    #: alone, then [B, heads, 1, 1 + N] of the class token: ``vitlens.views.class_attention``); the stream refuses
    #: such a model for a consumer that does not
    reads_class_attention = False
    #: whether the consumer reads no map's shape at all (the logits alone), so every kind's maps pass it
    #: (``Kind.reads``): the flag of a consumer that would otherwise have to name every kind's flag
    reads_every_kind = False

    def begin_batch(self, batch: BatchInfo) -> None:
        """A new batch is about to run."""

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        """Block ``layer``'s attention of the current batch: whole [B, heads, T, T], or the query rows
        ``rows`` of it [B, heads, q, T] (see the module docstring)."""

    def softmax_tap(self, layer: int, rows: slice, shape: tuple) -> "SoftmaxTaps | None":
        """Asked before block ``layer``'s query rows ``rows`` (probabilities of ``shape`` [B, heads, rows, T]) are
        made, by an engine that makes them itself: what the consumer wants their softmax pass to compute besides
        them (``SoftmaxTaps``: attention distance's per-query sums, the mean over heads), in buffers it owns. The
        engine fills what it can and says so (``filled``) before ``on_attention`` hands over the same rows; a
        consumer computes from the probabilities whatever was not filled. None (the default): nothing."""
        return None

    def end_batch(self, logits: torch.Tensor | None = None) -> object:
        """The current batch's model output, after its last block (what it returns, if anything, is the consumer's:
        the engine ignores it)."""

    def held_bytes_per_image(self, tokens: int) -> int:
        """Bytes the consumer holds per image of a batch until the batch's last block (T = ``tokens``): what it must
        keep across blocks, not a block's passing buffers. The plan caps the images per forward by it
        (``images_per_forward``). 0 (the default): nothing grows with the batch beyond a block."""
        return 0

    def result(self, spec: ModelSpec | str) -> Any:
        """The finished result; ``spec`` names the model (a ``ModelSpec`` or its name)."""
        raise NotImplementedError

    def merge(self: C, other: C) -> C:
        """A consumer whose state covers the images of both (disjoint image sets)."""
        raise NotImplementedError

    def hooks(self) -> contextlib.AbstractContextManager:
        """Further hooks the consumer needs while the images run (none by default)."""
        return contextlib.nullcontext()

    def state(self) -> dict[str, np.ndarray]:
        """The partial state as plain arrays (what crosses processes); see ``from_state``."""
        raise NotImplementedError(f"{type(self).__name__} does not travel as a state.")

    @classmethod
    def from_state(cls: type[C], state: dict[str, np.ndarray]) -> C:
        """The consumer a ``state()`` came from (enough of it to ``merge`` and give its result)."""
        raise NotImplementedError(f"{cls.__name__} does not travel as a state.")

    def __call__(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        # a consumer is also a capture callback; whole maps reach one written as on_attention(layer, attn)
        if rows is None:
            self.on_attention(layer, attn)
        else:
            self.on_attention(layer, attn, rows)


def query_rows(attn: torch.Tensor, rows: slice | None) -> tuple[int, int, bool]:
    """Where an ``on_attention`` call's attention sits among the layer's queries.

    Args:
        attn: the attention handed over, [B, heads, queries, T].
        rows: the slice of queries it holds (None: the whole map).

    Returns:
        (first query, stop, whether it is the layer's last block).

    Raises:
        InvalidParameterError: rows that do not match the block's shape.
    """
    t = attn.shape[-1]
    if rows is None:
        return 0, attn.shape[-2], True
    start, stop = int(rows.start or 0), int(rows.stop)
    if stop - start != attn.shape[-2] or not 0 <= start < stop <= t:
        raise InvalidParameterError(f"Rows {start}:{stop} do not match an attention block of {attn.shape[-2]} "
                                    f"queries over {t} keys.")
    return start, stop, stop == t


__all__ = ["AttentionConsumer", "BatchInfo", "query_rows"]
