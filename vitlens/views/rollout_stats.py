"""What a survey keeps of attention rollout (Fig. 6) per image shard: statistics of each image's rolled-out row, as
sums that merge exactly (rollout's maps themselves grow with the images, so a survey keeps none).

For the source row r of R (class token, or the mean of the patch rows; a windowed model's over the first stage's
grid, a CaiT's over the patches) over all tokens: ``prefix_mass`` = its mass on prefix tokens; ``entropy`` = entropy
(nats) of its patch part normalised to sum 1; with masks, ``mass_in_mask`` = share of the patch part on the object.
The row comes from the rollout view's own accumulator for the model (``VIEWS["rollout"].build``), which it feeds
(``batch_row``, ``row_layout``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.resample import patch_coverage
from ..core.spec import ModelSpec
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..kinds import all_kinds


class RolloutStats(AttentionConsumer):
    """Per-image rollout statistics, accumulated as sums and sums of squares (no map is kept).

    Args:
        rollout: the rollout view's accumulator for the model (None: a statistic read back from a state, which
            merges and gives its rows but reads no images).
    """

    METRICS = ("prefix_mass", "entropy", "mass_in_mask")

    def __init__(self, rollout: Any = None) -> None:
        self.rollout = rollout
        # it reads the maps its accumulator reads (a windowed model's windows, a CaiT's class-attention layers:
        # every registered kind's reader flag, as the accumulator has it)
        for kind in all_kinds():
            if kind.reader:
                setattr(self, kind.reader, kind.reads(rollout))
        self.sums = np.zeros(len(self.METRICS))
        self.squares = np.zeros(len(self.METRICS))
        self.counts = np.zeros(len(self.METRICS), dtype=np.int64)
        self._masks: np.ndarray | None = None

    def begin_batch(self, batch: BatchInfo) -> None:
        self.rollout.begin_batch(batch)
        self._masks = batch.masks

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.rollout.on_attention(layer, attn, rows)

    def held_bytes_per_image(self, tokens: int) -> int:
        """What its rollout accumulator holds per image across blocks (``AttentionConsumer.held_bytes_per_image``)."""
        held = getattr(self.rollout, "held_bytes_per_image", None)
        return int(held(tokens)) if held is not None else 0

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        row = self.rollout.batch_row().cpu().numpy()
        p, grid = self.rollout.row_layout()
        patch = row[:, p:]
        share = patch / np.maximum(patch.sum(1, keepdims=True), np.finfo(np.float64).tiny)
        values = [row[:, :p].sum(1), -(share * np.log(np.where(share > 0, share, 1.0))).sum(1)]
        if self._masks is not None:
            cover = np.stack([patch_coverage(mk, grid) for mk in np.asarray(self._masks, dtype=bool)])
            values.append((share * cover.reshape(len(cover), -1)).sum(1))
        for i, v in enumerate(values):
            self.sums[i] += v.sum()
            self.squares[i] += (v ** 2).sum()
            self.counts[i] += v.size

    def state(self) -> dict[str, np.ndarray]:
        return {"sums": self.sums, "squares": self.squares, "counts": self.counts}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "RolloutStats":
        out = cls()
        out.sums, out.squares, out.counts = (np.asarray(state[k]) for k in ("sums", "squares", "counts"))
        return out

    def merge(self, other: "RolloutStats") -> "RolloutStats":
        out = RolloutStats()
        out.sums, out.squares, out.counts = (self.sums + other.sums, self.squares + other.squares,
                                             self.counts + other.counts)
        return out

    def result(self, spec: ModelSpec | str = "") -> dict[str, float]:
        """The mean of each metric over the images that have it."""
        return {f"rollout_{k}": float(self.sums[i] / self.counts[i]) for i, k in enumerate(self.METRICS)
                if self.counts[i]}

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """One row per metric: its mean over the images that have it."""
        return [dict(metric=f"rollout_{k}", value=self.sums[i] / self.counts[i], n=int(self.counts[i]))
                for i, k in enumerate(self.METRICS) if int(self.counts[i])]


__all__ = ["RolloutStats"]
