"""View 4, paper Fig. 6 and Fig. 14: attention rollout (Abnar & Zuidema, 2020).

Per block: fuse heads (mean, or max/min), optionally zero the smallest ``discard_ratio`` of the
fused weights of each image (never the class token's attention to itself), add the residual
path and renormalise rows, A' = (A + I) / rowsum(A + I), then multiply first block first:
R = A'_L ... A'_1. The map is the class token's row of R over patch tokens (for models
without a class token: the mean of the patch tokens' rows), divided by its maximum.

Rollout shows where information was mixed, not what caused the prediction; compare it with
attribution methods before reading it as an explanation.

Memory (what it must hold, and holds no more): the chain runs from the last block back, so every
block's head-fused map of the batch is kept until the batch's last block, L x B x T x T float32
(vit_base: 1.0 GB at 768 px batch 4, T = 2,305; 1.6 GB at 1024 px batch 2, T = 4,097), plus the
block in flight's one [B, T, T] buffer, filled row block by row block under query-chunked
capture (none where the maps are held in float16 and the native softmax pass writes each block's mean straight
into its place in the store); the float64 chain converts at most ``ROLLOUT_ROWS_BYTES`` of rows at a time. Where
the views choose their capture (``vl.analyze``, ``attention_rollout``), the stream caps the images per forward so
that these maps stay within about the plain forward's own peak (``held_bytes_per_image``,
``vitlens.engine.plan.images_per_forward``): at 768 px and 1024 px a ViT-B runs one image per forward. Where one
image's maps are large (more than ``HALF_ABOVE_MB`` in float32: 0.74 GB at 1024 px), they are held in float16
scaled by 2^15, half the bytes, within a stated bound (``precision``, ``vitlens.views.rollout_store``,
docs/definitions.md); the maps of a batch live in one store made once and reused by the next sub-batch. A running
product from the first block would hold one [B, T, T] but cost T^3 per block and image (12 GFLOP
at T = 2,305, more than the block's own forward), so it is not used.
``discard_ratio > 0`` adds, per block, ``topk``'s k = discard_ratio x T^2 values and indices
(12 bytes each per image) while it ranks; the map itself is zeroed in place.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING, cast

import numpy as np
import torch

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..families.pooling import capture_pool_attention
from ..core.native import SoftmaxTaps, compiled_wanted
from ..core.pages import large_empty
from ..core.spec import ModelSpec
from ..results import Result
from ..engine.consumer import AttentionConsumer, BatchInfo, query_rows
from ..engine.stream import model_name
from .rollout_store import HALF_SCALE, MapStore, check_precision, storage_for, store_half
from .rollout_math import (check_rollout_params, fused_dtype, fuse, discard_smallest, source_vector, pool_vector,
                           rollout_row, ROLLOUT_ROWS_BYTES, row_map, predictions)

#: the rows rollout starts from: None (the class token, or the mean over the patch tokens without one) or
#: "pool" (a MAP head's own attention: its probe queries over the tokens, heads fused, queries averaged)
ROLLOUT_SOURCES = (None, "pool")

if TYPE_CHECKING:
    from ..loading.model import LoadedModel


def format_probability(p: float) -> str:
    """A probability as a percentage with the digits it needs: "92%", "4.3%", "0.2%", "<0.1%", ">99.9%".

    Whole percents from 10% up (one decimal near 100%), one decimal below 10%, and bounds rather than a
    misleading "0%" or "100%" for a probability that is neither (the app's top-5 and every caption).
    """
    pct = 100 * float(p)
    if not np.isfinite(pct):
        return "n/a"
    if pct <= 0 or pct >= 100:
        return f"{pct:.0f}%"
    if pct < 0.1:
        return "<0.1%"
    if pct > 99.9:
        return ">99.9%"
    if pct < 10 or pct >= 99.5:
        return f"{pct:.1f}%"
    return f"{pct:.0f}%"


@dataclass(eq=False, repr=False)
class RolloutResult(Result):
    """Rollout maps of a batch of images.

    Attributes:
        maps: [B, gh, gw] rollout over patch tokens, each divided by its maximum.
        predictions: [B] predicted class index (-1 for a model without classifier).
        probabilities: [B] softmax probability of the predicted class (nan without classifier).
        grid: (gh, gw).
        image_size: (H, W) input size.
        head_fusion: "mean", "max" or "min".
        discard_ratio: fraction of fused weights zeroed per image and block.
        source_token: the row shown: "class token", "mean over patch tokens" (no class token), or
            "attention pool" (a MAP head's probe row, ``attention_rollout(source="pool")``); for a windowed or
            pooling model, the source and the path in words (``vitlens.views.windowed_rollout.rollout_source``:
            "mean over the last stage's tokens, through the windows and patch mergings", ...).
        predicted_labels: class names of the predictions when known.
        model_name: the model's name.
        map_storage: how the per-block maps were held until the chain: "float32", or "float16" (scaled by 2^15, the
            row within the bound of ``vitlens.views.rollout_store``; docs/definitions.md).
    """

    kind = "attention_rollout"
    maps: np.ndarray
    predictions: np.ndarray
    probabilities: np.ndarray
    grid: tuple[int, int]
    image_size: tuple[int, int]
    head_fusion: str
    discard_ratio: float
    source_token: str
    predicted_labels: list[str] = field(default_factory=list)
    model_name: str = ""
    map_storage: str = "float32"

    def _held(self) -> str:
        return "" if self.map_storage == "float32" else f", maps held in {self.map_storage}"

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}: {len(self.maps)} maps of {self.grid[0]}x{self.grid[1]}, "
                f"{self.head_fusion} fusion, discard {self.discard_ratio:.2f}, {self.source_token}{self._held()}")

    def title(self) -> str:
        """The figures' title: how the maps were made (and, when not float32, how they were held)."""
        return (f"Attention rollout ({self.head_fusion} fusion, discard {self.discard_ratio:.2f}, "
                f"{self.source_token}{self._held()})")

    def caption(self, index: int) -> str:
        """'ring (92%)' / 'class 3 (40%)' for image ``index``; '' for a model without classifier."""
        if self.predicted_labels:
            return f"{self.predicted_labels[index]} ({format_probability(self.probabilities[index])})"
        if self.predictions[index] >= 0:
            return f"class {self.predictions[index]} ({format_probability(self.probabilities[index])})"
        return ""

    def to_rows(self) -> list[dict]:
        """One row per (image, patch row, patch column), all 0-based: the map's value there."""
        b, gh, gw = self.maps.shape
        return [{"image": i, "row": r, "col": c, "rollout": float(self.maps[i, r, c])}
                for i in range(b) for r in range(gh) for c in range(gw)]


def rollout_sources(m: "LoadedModel") -> tuple[str | None, ...]:
    """The rows rollout can start from for ``m`` (``ROLLOUT_SOURCES``): None (the class token, or the mean over the
    patch tokens) always, and "pool" when the model pools through an attention pool (a MAP head) whose attention is
    read: what ``attention_rollout(source=...)`` and ``attention_maps``' pool row take for it.

    It opens (and closes) a pool capture session on the model without a forward: a caller that serves several
    threads on one model takes its lock around it, as around any hook session.

    Args:
        m: the model.

    Returns:
        ``(None,)`` or ``(None, "pool")``.
    """
    try:
        with capture_pool_attention(m):
            return ROLLOUT_SOURCES
    except ViewNotAvailableError:
        return (None,)


class RolloutAccumulator(AttentionConsumer):
    """Keeps each block's head-fused map of the batch (B x T x T float32 numbers per block, L x B x T
    x T in all: see the module docstring) and, when the batch ends, rolls out the source row as a
    vector-matrix chain from the last block back (``rollout_row``), recording each image's map and
    prediction.

    A consumer of the streaming engine (``vitlens.engine``); accumulators over disjoint
    image sets merge (the maps of ``self`` first, then ``other``'s).
    """

    def __init__(self, num_layers: int, num_prefix_tokens: int, has_class_token: bool,
                 head_fusion: str = "mean", discard_ratio: float = 0.0, label_names: list[str] | None = None,
                 has_classifier: bool = True, source: str | None = None, precision: str = "auto") -> None:
        check_rollout_params(head_fusion, discard_ratio)
        #: how the maps are held until the chain (``vitlens.views.rollout_store``): "auto", "float32", "float16"
        self.precision = check_precision(precision)
        #: how they were held: "float32" (as made: float32 maps, float64 for a float64 model) or "float16"
        self.map_storage = "float32"
        self._store = MapStore()
        if source not in ROLLOUT_SOURCES:
            raise InvalidParameterError(f"source must be None or 'pool'; got {source!r}.")
        self.has_classifier = has_classifier
        self.num_layers = num_layers
        self.num_prefix_tokens = num_prefix_tokens
        self.has_class_token = has_class_token
        self.head_fusion = head_fusion
        self.discard_ratio = float(discard_ratio)
        self.label_names = list(label_names) if label_names else None
        self.grid: tuple[int, int] | None = None
        self.image_size: tuple[int, int] | None = None
        self._fused: list[torch.Tensor] = []
        self._layer: torch.Tensor | None = None  # the fused map of the block in flight, filled row block by row block
        self._layer_half = False  # whether ``_layer`` is the block's float16 store slot, written by its softmax pass
        self._tap: tuple[int, int, SoftmaxTaps] | None = None  # (layer, first row, head mean) asked of the next block
        self._device = torch.device("cpu")  # the batch's
        self.batches = RolloutBatches()
        #: the row rolled out: None (the class token, or the patch mean) or "pool" (a MAP head's own attention)
        self.source = source
        self._model: "LoadedModel | None" = None  # the model whose pool ``hooks`` reads (source "pool")
        self._pool: Any = None  # the pool's capture while a stream runs

    @classmethod
    def for_model(cls, m: "LoadedModel", head_fusion: str = "mean", discard_ratio: float = 0.0,
                  source: str | None = None, precision: str = "auto") -> "RolloutAccumulator":
        """The accumulator for ``m``; ``source="pool"`` rolls out from its attention pool, whose capture
        the accumulator's own ``hooks`` put on the model for the stream; ``precision``: how the maps are held."""
        s = m.spec
        acc = cls(s.num_layers, s.num_prefix_tokens, s.has_class_token, head_fusion, discard_ratio, m.label_names(),
                  has_classifier=s.num_classes > 0, source=source, precision=precision)
        acc._model = m if source == "pool" else None
        return acc

    def hooks(self) -> contextlib.AbstractContextManager:
        """For ``source="pool"``: the capture of the model's attention pool (side hooks beside the blocks')."""
        if self.source != "pool":
            return contextlib.nullcontext()
        if self._model is None:
            raise InvalidParameterError("Rollout from the attention pool needs the model: build the accumulator "
                                        "with RolloutAccumulator.for_model(m, source='pool').")

        self._pool = capture_pool_attention(self._model)
        return self._pool

    @property
    def source_token(self) -> str:
        if self.source == "pool":
            return "attention pool"
        return "class token" if self.has_class_token else "mean over patch tokens"

    def begin_batch(self, batch: BatchInfo) -> None:
        grid, image_size = batch.grid, batch.input_size
        self.grid = (int(grid[0]), int(grid[1]))
        if image_size is not None and min(image_size) > 0:
            self.image_size = (int(image_size[0]), int(image_size[1]))
        self._fused, self._layer, self._layer_half = [], None, False
        self._device = batch.device
        self._last: list[torch.Tensor] | None = None

    def __getstate__(self) -> dict:
        # a batch in flight, the model and its pool's capture do not travel
        return {**self.__dict__, "_fused": [], "_layer": None, "_layer_half": False, "_model": None, "_pool": None,
                "_last": None, "_tap": None, "_store": MapStore()}

    def _streams_last_block(self) -> bool:
        """Whether the last block is rolled out as its rows come (only the source's rows of it are needed: the
        class token's one row, or the patch rows' mean, summed into the chain's first step as they arrive, so its
        map is never kept nor, for the class token, fused beyond that row): not with a pool's source (it arrives
        after the blocks) or ``discard_ratio`` (it reads the whole map)."""
        return self.source is None and self.discard_ratio == 0

    def _kept(self) -> int:
        """The maps kept until the batch's last block: L, one fewer when the last block is streamed."""
        return self.num_layers - (1 if self._streams_last_block() else 0)

    def held_bytes_per_image(self, tokens: int) -> int:
        """The head-fused maps kept per image until the batch's last block: ``_kept`` x T x T, float32 or float16
        (``storage_for``) (the plan caps the images per forward by it, ``images_per_forward``)."""
        kept = self._kept()
        return (2 if storage_for(self.precision, kept, tokens) == "float16" else 4) * kept * int(tokens) ** 2

    def _stream_last(self, attn: torch.Tensor, start: int, stop: int, last: bool) -> None:
        """The first step of ``rollout_row`` for the last block, v A' = w (A + I) with w = v / rowsum(A + I), on
        the rows [start, stop) of its map: only the rows where the source v is not zero."""
        b, t = attn.shape[0], attn.shape[-1]
        if start == 0:
            v = source_vector(b, t, self.num_prefix_tokens, self.has_class_token, attn.device)
            self._last = [v, torch.zeros_like(v), torch.zeros_like(v)]  # the source, w, w A
        v, w, out = self._last  # type: ignore[misc]  # set at the layer's first rows (start == 0) above
        need = (0, 1) if self.has_class_token else (self.num_prefix_tokens, t)  # the rows where v is not zero
        lo, hi = max(start, need[0]), min(stop, need[1])
        step = max(1, ROLLOUT_ROWS_BYTES // (8 * b * t))
        for r0 in range(lo, hi, step):
            r1 = min(hi, r0 + step)
            part = fuse(attn[:, :, r0 - start:r1 - start], self.head_fusion).to(torch.float64)  # [B, rows, T]
            w[:, r0:r1] = v[:, r0:r1] / (part.sum(dim=-1) + 1.0)
            out += torch.bmm(w[:, None, r0:r1], part).squeeze(1)
        if last:
            self._last = [out + w]
            self._fused.append(None)  # type: ignore[arg-type]  # the block's place in the chain: already stepped

    def _new_layer(self, batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """The buffer the block's map is made in, row block by row block: its place in the store (float32 maps held as
        made), or the store's float32 buffer (maps held in float16); float64 maps in a buffer of their own. Huge pages
        advised (``large_empty``): each 4 KB page's first write would be a fault inside the kernel that fills it."""
        if fused_dtype(dtype) != torch.float32:
            self._layer = large_empty(batch, tokens, tokens, dtype=fused_dtype(dtype), device=device)
        elif storage_for(self.precision, self._kept(), tokens) == "float16":
            self._layer = self._store.buffer(batch, tokens, device)
        else:
            self._layer = self._store.slot(len(self._fused), self._kept(), batch, tokens, torch.float32, device)

    def _hold(self, fused: torch.Tensor) -> torch.Tensor:
        """The block's finished map [B, T, T] as held until the chain: itself, or (float16 storage) its store slot,
        scaled by 2^15 and rounded (``store_half``; ``fused`` is the accumulator's own and is scaled in place)."""
        b, t = fused.shape[0], fused.shape[-1]
        if storage_for(self.precision, self._kept(), t) != "float16":
            return fused
        slot = self._store.slot(len(self._fused), self._kept(), b, t, torch.float16, fused.device)
        store_half(fused, slot)
        self.map_storage = "float16"
        return slot

    def _half_from_pass(self, tokens: int) -> bool:
        """Whether the softmax pass writes the block's map straight into its float16 store slot (``softmax_tap``):
        where it is held in float16 and nothing reads it in float32 before (``discard_smallest`` ranks the float32
        map)."""
        return self.discard_ratio == 0 and storage_for(self.precision, self._kept(), tokens) == "float16"

    def softmax_tap(self, layer: int, rows: slice, shape: tuple) -> SoftmaxTaps | None:
        """Mean fusion of the block's rows by its softmax pass (float32 attention; the mean summed in head order, as
        ``torch.mean``), straight into the layer's buffer, or, where the map is held in float16 (``_half_from_pass``),
        scaled and rounded straight into its store slot (``store_half``'s numbers to the bit; no float32 map, no
        second pass); not for the last block when it is streamed (only the source's rows of it are read) nor for
        max/min fusion."""
        b, _, r, t = shape
        start = int(rows.start or 0)
        if self.head_fusion != "mean" or (layer == self.num_layers - 1 and self._streams_last_block()) \
                or layer != len(self._fused) or (start > 0 and self._layer is None) \
                or not compiled_wanted(self._device, t):  # no kernel to fill it: no buffer made twice
            return None
        if start == 0:
            self._layer_half = self._half_from_pass(t)
            if self._layer_half:
                self._layer = self._store.slot(len(self._fused), self._kept(), b, t, torch.float16, self._device)
            else:
                self._new_layer(b, t, torch.float32, self._device)
        # the ignores below: the layer's buffer or slot was made at its first rows
        block = self._layer[:, start:start + r]  # type: ignore[index]
        tap = SoftmaxTaps(half_mean=block, half_scale=HALF_SCALE) if self._layer_half else SoftmaxTaps(mean=block)
        self._tap = (layer, start, tap)
        return tap

    def _rows_into_slot(self, attn: torch.Tensor, start: int, stop: int, last: bool, filled: bool) -> None:
        """A row block of a layer whose softmax pass writes its float16 slot (``softmax_tap``): rows the pass did
        not fill (the kernel refused them) are fused and stored as ``_hold`` stores a whole map, row by row the same
        numbers; at the last rows the slot is the layer's held map."""
        slot = cast(torch.Tensor, self._layer)  # the slot softmax_tap took at the layer's first rows
        if not filled:
            store_half(fuse(attn, self.head_fusion), slot[:, start:stop])
        if last:
            self._layer, self._layer_half = None, False
            self.map_storage = "float16"
            self._fused.append(slot)

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        """Whole maps or blocks of query rows: rollout needs every block's head-fused map (B x T x T
        numbers per block: the chain runs from the last block back), assembled from its rows."""
        if layer != len(self._fused):
            raise RuntimeError(f"Rollout expected block {len(self._fused)}, got block {layer}.")
        start, stop, last = query_rows(attn, rows)
        if layer == self.num_layers - 1 and self._streams_last_block():
            self._stream_last(attn, start, stop, last)
            return
        # the fused map is kept in the attention's dtype (max/min exact, the mean rounds like the
        # attention itself); zeroing the smallest weights needs only their order, which float32 keeps
        tap, self._tap = self._tap, None
        filled = tap is not None and tap[:2] == (layer, start) and tap[2].filled  # the softmax pass fused the rows
        if self._layer_half:
            self._rows_into_slot(attn, start, stop, last, filled)
            return
        if not filled and (rows is None or (start == 0 and last)):
            fused = fuse(attn, self.head_fusion)
        else:  # row blocks are fused into the layer's one [B, T, T] buffer (no list of blocks, no concatenation)
            if not filled:
                if start == 0:
                    self._new_layer(attn.shape[0], attn.shape[-1], attn.dtype, attn.device)
                # the buffer _new_layer made at the layer's first rows
                fuse(attn, self.head_fusion, out=cast(torch.Tensor, self._layer)[:, start:stop])
            if not last:
                return
            # filled row by row above, or by the softmax pass (the tap) in the buffer of the layer's first rows
            fused, self._layer = cast(torch.Tensor, self._layer), None
        if self.discard_ratio > 0:
            fused = discard_smallest(fused, self.discard_ratio, protect_class_token=self.has_class_token,
                                     inplace=fused.is_contiguous() and fused.data_ptr() != attn.data_ptr())
        self._fused.append(self._hold(fused))

    def batch_row(self) -> torch.Tensor:
        """The batch's rolled-out source row [b, T] over all tokens (float64); the blocks' fused maps
        are let go. ``end_batch`` calls it; a consumer that keeps statistics of the row instead of
        maps (the survey's ``RolloutStats``, ``vitlens.views.rollout_stats``) calls it from its own ``end_batch``."""
        if len(self._fused) != self.num_layers or self.grid is None:
            raise RuntimeError("Rollout needs one complete forward per batch.")
        start = None
        if self.source == "pool":
            pool = self._pool.maps[0] if self._pool is not None and self._pool.maps else None
            if pool is None:
                raise RuntimeError("Rollout from the attention pool saw no pool attention in this forward.")
            start = pool_vector(pool, self._fused[0].shape[-1], self.head_fusion)
        fused = self._fused
        if fused and fused[-1] is None:  # the last block streamed: the chain goes on from its step
            start, fused = self._last[0], fused[:-1]
        row = rollout_row(fused, self.num_prefix_tokens, self.has_class_token, start) if fused else start
        if row is None:
            raise RuntimeError("Rollout needs one complete forward per batch.")
        self._fused, self._layer, self._layer_half, self._last = [], None, False, None
        return row

    def row_layout(self) -> tuple[int, tuple[int, int]]:
        """(prefix tokens at the start of ``batch_row``'s row, the grid of its patch part)."""
        return self.num_prefix_tokens, cast(tuple[int, int], self.grid)  # set: batch_row refuses a batch without it

    def end_batch(self, logits: torch.Tensor | None = None) -> np.ndarray:
        """Close the batch: its maps [b, gh, gw] (max-normalised) and, from ``logits``, its predictions."""
        row = self.batch_row()
        maps = row_map(row, *self.row_layout())
        self.batches.add(maps, logits, self.has_classifier)
        return maps

    @property
    def maps(self) -> np.ndarray:
        return np.concatenate(self.batches.maps) if self.batches.maps else np.zeros((0, 0, 0))

    def merge(self, other: "RolloutAccumulator") -> "RolloutAccumulator":
        if (self.head_fusion, self.discard_ratio, self.num_prefix_tokens, self.has_class_token) != (
                other.head_fusion, other.discard_ratio, other.num_prefix_tokens, other.has_class_token):
            raise InvalidParameterError("Only rollout accumulators of the same model and settings merge.")
        if self.grid is not None and other.grid is not None and self.grid != other.grid:
            raise InvalidParameterError(f"Rollout maps of grid {self.grid} and {other.grid} do not merge.")
        if self.source != other.source:
            raise InvalidParameterError("Rollout from the attention pool and from another row do not merge.")
        out = RolloutAccumulator(self.num_layers, self.num_prefix_tokens, self.has_class_token, self.head_fusion,
                                 self.discard_ratio, self.label_names, self.has_classifier, self.source, self.precision)
        out.map_storage = "float16" if "float16" in (self.map_storage, other.map_storage) else "float32"
        out._model = self._model
        out.grid, out.image_size = self.grid or other.grid, self.image_size or other.image_size
        out.batches = self.batches + other.batches
        return out

    def result(self, spec: ModelSpec | str = "") -> RolloutResult:
        if self.grid is None:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        self._store.release()  # the maps' store is not needed after the stream
        return self.batches.result(self.grid, self.image_size or (0, 0), self.head_fusion, self.discard_ratio,
                                   self.source_token, self.label_names, spec, self.map_storage)


class RolloutBatches:
    """The maps a rollout consumer has rolled out, batch by batch, each image's prediction beside its map (the plain,
    windowed and class-attention rollout accumulators keep them so): two over disjoint image sets add up (``self``'s
    first), and ``result`` makes the ``RolloutResult``, the predicted classes named where the model names them all."""

    def __init__(self) -> None:
        self.maps: list[np.ndarray] = []
        self.preds: list[np.ndarray] = []
        self.probs: list[np.ndarray] = []

    def add(self, maps: np.ndarray, logits: torch.Tensor | None, has_classifier: bool) -> None:
        """Keep a batch's maps [b, gh, gw] and, from its ``logits``, its predictions (``predictions``)."""
        preds, probs = predictions(logits, maps.shape[0], has_classifier)
        self.maps.append(maps)
        self.preds.append(preds)
        self.probs.append(probs)

    def __add__(self, other: "RolloutBatches") -> "RolloutBatches":
        out = RolloutBatches()
        out.maps, out.preds, out.probs = self.maps + other.maps, self.preds + other.preds, self.probs + other.probs
        return out

    def result(self, grid: tuple[int, int], image_size: tuple[int, int], head_fusion: str, discard_ratio: float,
               source_token: str, label_names: list[str] | None, spec: ModelSpec | str = "",
               map_storage: str = "float32") -> RolloutResult:
        """The result of the batches kept.

        Args:
            grid: (gh, gw) of the maps.
            image_size: (H, W) input size.
            head_fusion: "mean", "max" or "min".
            discard_ratio: the share of fused weights zeroed.
            source_token: the row rolled out, in words.
            label_names: the model's class names, or None.
            spec: the model's spec or name (the result's ``model_name``).
            map_storage: how the maps were held (``RolloutResult.map_storage``).

        Returns:
            The ``RolloutResult``.

        Raises:
            InvalidParameterError: no batch was kept.
        """
        if not self.maps:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        preds, names = np.concatenate(self.preds), label_names
        return RolloutResult(
            maps=np.concatenate(self.maps), predictions=preds, probabilities=np.concatenate(self.probs), grid=grid,
            image_size=image_size, head_fusion=head_fusion, discard_ratio=discard_ratio, source_token=source_token,
            predicted_labels=[names[i] for i in preds] if names and (preds >= 0).all() and
            len(names) > int(preds.max()) else [],
            model_name=model_name(spec), map_storage=map_storage)


