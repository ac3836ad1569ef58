"""The paper's attention views for a ViT with class-attention layers (CaiT: ``spec.kind == "class-attention"``,
``vitlens.families.cait``): mean attention distance of its self-attention blocks (Fig. 7 right, Fig. 11) and
attention rollout from the class token through the class-attention layers and the self-attention blocks (Fig. 6).

Definitions (docs/definitions.md, "CaiT: talking heads and class attention"):

- a self-attention block's map is each head's softmax output (after the talking heads' pre-softmax mixing
  ``proj_l``, before the post-softmax mixing ``proj_w``): each row a probability distribution over the N patch
  tokens, its queries and keys the patch grid (no prefix token). The weights ``proj_w`` makes, which multiply v,
  are signed and their rows do not sum to 1, so they are not read as attention;
- distance: as for a ViT (``vitlens.views.distance``, no prefix keys) on those maps, block by block. A
  class-attention layer's one query is the class token, which has no position in the image: it has no distance,
  and the result says so (``ClassAttentionDistanceResult.note``) rather than give a number;
- rollout: the source is the class token at the last class-attention layer (the head reads it; with
  ``global_pool="avg"`` the head reads the mean of the patch tokens, which the class-attention layers leave as
  they are, and that mean is the source at the last self-attention block). Back through each class-attention
  layer, a dense (1 + N) x (1 + N) map over [class token, patches] whose class row is the layer's head-fused row a
  and whose patch rows are the identity (the layer does not update the patches), A' = (A + I) / rowsum(A + I):
  the class token's row becomes (a + e_cls) / (sum(a) + 1) ((a + e_cls) / 2 with mean fusion), the patches pass
  unchanged. At the entry of the class-attention layers the class token is the learned ``cls_token`` (no image
  content): its share is dropped, and the patch part goes back through the self-attention blocks with the usual
  (A + I) / rowsum(A + I) of the head-fused map over the patches. The map is that row on the patch grid,
  divided by its maximum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ..core.spec import ModelSpec
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..errors import InvalidParameterError, UnsupportedModelError
from .distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .rollout import RolloutBatches, RolloutResult
from .rollout_math import check_rollout_params, fuse, rollout_row, row_map

if TYPE_CHECKING:  # for the annotations only, as in rollout.py
    from ..loading.model import LoadedModel

#: the kinds of a CaiT's blocks (``Family.block_layout``)
SELF_ATTENTION, CLASS_ATTENTION = "global", "class-attention"


def model_layout(m: LoadedModel) -> list[dict[str, str]]:
    """Every block's kind and the tokens of its queries and keys (``Family.block_layout``).

    Raises:
        UnsupportedModelError: the model's family has blocks of one kind only (a ViT).
    """
    layout = m.family.block_layout  # an optional ability: None for blocks of one kind
    if layout is None:
        raise UnsupportedModelError(f"{m.spec.name}: its family ({m.family.name}) has blocks of one kind; "
                                    "the class-attention views are for CaiT.")
    return list(layout(m.model))


def _self_attention_depth(layout: list[dict[str, str]]) -> int:
    kinds = [b["kind"] for b in layout]
    depth = kinds.count(SELF_ATTENTION)
    if kinds != [SELF_ATTENTION] * depth + [CLASS_ATTENTION] * (len(kinds) - depth):
        raise InvalidParameterError(f"Blocks of kinds {kinds}: the class-attention views read self-attention blocks "
                                    "followed by class-attention layers.")
    return depth


@dataclass(eq=False, repr=False)
class ClassAttentionDistanceResult(AttentionDistanceResult):
    """Mean attention distance of every head of a CaiT's self-attention blocks, averaged over images.

    As ``AttentionDistanceResult``, over the self-attention blocks only (layer l of ``mean_px`` is block l; they
    come first). The class-attention layers that follow have no row: their one query, the class token, has no
    position in the image, so it has no distance (``note``).

    Attributes:
        mean_px: [L, H] mean over images of the per-image attention distance of the self-attention blocks, in pixels.
        std_px: [L, H] standard deviation over images (population).
        m2: [L, H] sum of squared deviations over images.
        n_images: images averaged.
        image_size: (H, W) input size in pixels.
        grid: (gh, gw) token grid.
        stride_px: (sy, sx) pixels between neighbouring tokens.
        renormalize: whether weights over patch keys were renormalised per query (no prefix keys: a no-op).
        model_name: the model's name.
        block_kinds: every block's kind, first to last: "global" (talking-heads self-attention over the patches),
            then "class-attention".
        block_queries: the tokens of every block's queries.
        block_keys: the tokens of every block's keys.
    """

    kind = "class_attention_distance"
    block_kinds: tuple[str, ...] = ()
    block_queries: tuple[str, ...] = ()
    block_keys: tuple[str, ...] = ()

    @property
    def class_attention_layers(self) -> int:
        return sum(k == CLASS_ATTENTION for k in self.block_kinds)

    @property
    def note(self) -> str:
        """Why the class-attention layers have no distance, in words."""
        k, depth = self.class_attention_layers, self.mean_px.shape[0]
        if not k:
            return ""
        which = f"block {depth + 1}" if k == 1 else f"blocks {depth + 1}-{depth + k}"
        return (f"the {k} class-attention layer{'s' if k > 1 else ''} ({which}) {'have' if k > 1 else 'has'} no "
                "distance: the one query is the class token, which has no position in the image")

    figure_note = note

    def summary(self) -> str:
        return f"{super().summary()}; {self.note}" if self.note else super().summary()

    def to_rows(self) -> list[dict]:
        """One row per (self-attention block, head), both 1-based, with the block's kind."""
        return [{**row, "attention": self.block_kinds[row["layer"] - 1] if self.block_kinds else SELF_ATTENTION}
                for row in super().to_rows()]

    def merge(self, other: "AttentionDistanceResult") -> "ClassAttentionDistanceResult":
        if not isinstance(other, ClassAttentionDistanceResult) or other.block_kinds != self.block_kinds:
            raise InvalidParameterError("Only distances of the same CaiT and settings merge.")
        merged = super().merge(other)
        return ClassAttentionDistanceResult(**{**merged.__dict__, "block_kinds": self.block_kinds,
                                               "block_queries": self.block_queries, "block_keys": self.block_keys})


class ClassAttentionDistanceAccumulator(AttentionConsumer):
    """Streams the attention distance of a CaiT's self-attention blocks (an ``AttentionDistanceAccumulator`` over
    their [B, heads, N, N] maps, no prefix token); the class-attention layers' maps are checked and passed over.
    Its ``state()`` is the inner accumulator's (after ``per_class``, per class too): what a survey keeps of it, read
    back (``from_state``) as that accumulator, whose ``table_rows`` are the survey's rows."""

    reads_class_attention = True

    def __init__(self, layout: list[dict[str, str]], num_heads: int, stride_px: tuple[int, int],
                 renormalize: bool = True) -> None:
        self.layout = list(layout)
        self.depth = _self_attention_depth(self.layout)
        self.inner = AttentionDistanceAccumulator(self.depth, num_heads, 0, stride_px, renormalize)

    @classmethod
    def for_model(cls, m: LoadedModel, renormalize: bool = True) -> "ClassAttentionDistanceAccumulator":
        return cls(model_layout(m), m.spec.num_heads, m.spec.stride_px, renormalize)

    def per_class(self, num_classes: int) -> "ClassAttentionDistanceAccumulator":
        """Keep the self-attention blocks' moments per class too (``AttentionDistanceAccumulator.per_class``)."""
        self.inner.per_class(num_classes)
        return self

    def state(self) -> dict[str, np.ndarray]:
        """The self-attention blocks' moments (``AttentionDistanceAccumulator.state``)."""
        return self.inner.state()

    @classmethod
    # the self-attention blocks' accumulator, not this class: the state is its inner one's, which merges
    def from_state(cls, state: dict[str, np.ndarray]) -> AttentionDistanceAccumulator:  # type: ignore[override]
        """The self-attention blocks' accumulator of a ``state()`` (it merges, gives its result and table rows)."""
        return AttentionDistanceAccumulator.from_state(state)

    def table_rows(self, spec: dict, classes: list[str], renormalize: bool = True) -> list[dict]:
        """The survey table's rows: the self-attention blocks' (``AttentionDistanceAccumulator.table_rows``)."""
        return self.inner.table_rows(spec, classes, renormalize)

    def begin_batch(self, batch: BatchInfo) -> None:
        self.inner.begin_batch(batch)

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        if layer < self.depth:
            self.inner.on_attention(layer, attn, rows)
        elif attn.shape[-2] != 1 and rows is None:
            raise InvalidParameterError(f"Block {layer} is a class-attention layer, one query; got {attn.shape[-2]}.")

    def merge(self, other: "ClassAttentionDistanceAccumulator") -> "ClassAttentionDistanceAccumulator":
        out = ClassAttentionDistanceAccumulator(self.layout, self.inner.mean.shape[1], self.inner.stride_px,
                                                self.inner.renormalize)
        out.inner = self.inner.merge(other.inner)
        return out

    def result(self, spec: ModelSpec | str = "") -> ClassAttentionDistanceResult:
        plain = self.inner.result(spec)
        return ClassAttentionDistanceResult(
            **plain.__dict__, block_kinds=tuple(b["kind"] for b in self.layout),
            block_queries=tuple(b["queries"] for b in self.layout), block_keys=tuple(b["keys"] for b in self.layout))


def class_attention_rollout_row(self_maps: list[torch.Tensor], class_rows: list[torch.Tensor],
                                from_class_token: bool = True) -> torch.Tensor:
    """The rolled-out row over the patch tokens, [B, N] float64 (module docstring).

    Args:
        self_maps: every self-attention block's head-fused map over the patches, [B, N, N], first block first.
        class_rows: every class-attention layer's head-fused class row over [class token, patches], [B, 1 + N].
        from_class_token: start from the class token at the last class-attention layer (False: from the mean of the
            patch tokens after the last self-attention block, what ``global_pool="avg"`` reads).
    """
    b, n = self_maps[0].shape[0], self_maps[0].shape[-1]
    device = self_maps[0].device
    if from_class_token:
        v = torch.zeros(b, 1 + n, dtype=torch.float64, device=device)
        v[:, 0] = 1.0
        for a in reversed(class_rows):
            a = a.to(torch.float64)
            w = v[:, :1] / (a.sum(-1, keepdim=True) + 1.0)  # the class row's weight: v_cls / rowsum(A + I)
            out = w * a  # w A over [class, patches]
            out[:, :1] += w  # + w I at the class token
            out[:, 1:] += v[:, 1:]  # the patch rows are the identity
            v = out
        v = v[:, 1:]  # the learned class token's share at the entry of the class-attention layers is dropped
    else:
        v = torch.full((b, n), 1.0 / n, dtype=torch.float64, device=device)
    return rollout_row(self_maps, 0, False, v)


class ClassAttentionRolloutAccumulator(AttentionConsumer):
    """Keeps each block's head-fused map of the batch (the self-attention blocks' [B, N, N], the class-attention
    layers' class rows [B, 1 + N]) and rolls them out when the batch ends (``class_attention_rollout_row``)."""

    reads_class_attention = True

    def __init__(self, layout: list[dict[str, str]], head_fusion: str = "mean", label_names: list[str] | None = None,
                 has_classifier: bool = True, from_class_token: bool = True) -> None:
        check_rollout_params(head_fusion, 0.0)
        self.layout = list(layout)
        self.depth = _self_attention_depth(self.layout)
        self.head_fusion, self.label_names, self.has_classifier = head_fusion, label_names, has_classifier
        self.from_class_token = from_class_token
        self.grid: tuple[int, int] | None = None
        self.image_size: tuple[int, int] = (0, 0)
        self._self: list[torch.Tensor] = []
        self._class: list[torch.Tensor] = []
        self.batches = RolloutBatches()

    @classmethod
    def for_model(cls, m: LoadedModel, head_fusion: str = "mean", discard_ratio: float = 0.0
                  ) -> "ClassAttentionRolloutAccumulator":
        if discard_ratio:
            raise InvalidParameterError(f"discard_ratio is defined for a ViT's maps over one sequence of tokens; the "
                                        f"rollout of {m.spec.name} (class-attention layers) takes discard_ratio=0.")
        pool = getattr(m.model, "global_pool", "token")
        return cls(model_layout(m), head_fusion, m.label_names(), m.spec.num_classes > 0,
                   from_class_token=pool != "avg")

    @property
    def source_token(self) -> str:
        if self.from_class_token:
            return "class token, through the class-attention layers (its learned initial share dropped)"
        return "mean over patch tokens (global_pool='avg': the head reads them, not the class token)"

    def begin_batch(self, batch: BatchInfo) -> None:
        self.grid = (int(batch.grid[0]), int(batch.grid[1]))
        if batch.input_size is not None and min(batch.input_size) > 0:
            self.image_size = (int(batch.input_size[0]), int(batch.input_size[1]))
        self._self, self._class = [], []

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        if rows is not None or layer != len(self._self) + len(self._class):
            raise InvalidParameterError("The class-attention rollout reads every block's whole maps in order.")
        fused = fuse(attn.detach(), self.head_fusion)
        if layer < self.depth:
            self._self.append(fused)  # [B, N, N]
        else:
            self._class.append(fused[:, 0])  # [B, 1 + N]: the class token's one row

    def batch_row(self) -> torch.Tensor:
        """[B, N] the batch's rolled-out row over the patches (``class_attention_rollout_row``); the blocks' maps
        are let go (a survey's rollout statistics read it)."""
        if len(self._self) + len(self._class) != len(self.layout) or self.grid is None:
            raise RuntimeError("Rollout needs one complete forward per batch.")
        row = class_attention_rollout_row(self._self, self._class, self.from_class_token)
        self._self, self._class = [], []
        return row

    def row_layout(self) -> tuple[int, tuple[int, int]]:
        """(no prefix tokens, the patch grid): ``batch_row``'s row is over the patches."""
        return 0, cast(tuple[int, int], self.grid)  # set: batch_row refuses a batch without it

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        maps = row_map(self.batch_row(), *self.row_layout())
        self.batches.add(maps, logits, self.has_classifier)

    def merge(self, other: "ClassAttentionRolloutAccumulator") -> "ClassAttentionRolloutAccumulator":
        out = ClassAttentionRolloutAccumulator(self.layout, self.head_fusion, self.label_names, self.has_classifier,
                                               self.from_class_token)
        out.grid, out.image_size = self.grid or other.grid, self.image_size
        out.batches = self.batches + other.batches
        return out

    def result(self, spec: ModelSpec | str = "") -> RolloutResult:
        if self.grid is None:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        return self.batches.result(self.grid, self.image_size, self.head_fusion, 0.0, self.source_token,
                                   self.label_names, spec)


__all__ = ["ClassAttentionDistanceAccumulator", "ClassAttentionDistanceResult", "ClassAttentionRolloutAccumulator",
           "class_attention_rollout_row", "model_layout"]
