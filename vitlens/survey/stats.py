"""The statistics a survey keeps per (model, image shard): streaming consumers whose partial
states are plain arrays, saved as npz and merged exactly on the driver.

- ``SurveyDistance``: attention distance per head (paper Fig. 7 right, Fig. 11) over all images
  and, with labels, per class (running mean and sum of squared deviations, Chan et al.'s merge);
- ``RolloutStats``: per image, the rollout row's mass on prefix tokens, the entropy of its patch
  part, and with masks the share of patch mass on the object (Fig. 6), as sums and sums of squares;
- ``Predictions``: how many images were predicted right, overall and per class.

Merging is exact up to float64 rounding, so a survey equals one process over the same images
whatever the shard size and the order shards finish in.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..attribution.masks import patch_coverage
from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from ..views.distance import AttentionDistanceAccumulator, add_samples, merge_moment_rows
from ..views.engine import AttentionConsumer, BatchInfo
from ..views.rollout import RolloutAccumulator, rollout_row


class SurveyDistance(AttentionConsumer):
    """Attention distance per head over all images, and per class when the images have labels."""

    def __init__(self, m: LoadedModel, num_classes: int = 0, renormalize: bool = True) -> None:
        self.all = AttentionDistanceAccumulator.for_model(m.spec, renormalize)
        self.num_classes = num_classes
        layers, heads = m.spec.num_layers, m.spec.num_heads
        self.class_mean = np.zeros((num_classes, layers, heads))
        self.class_m2 = np.zeros((num_classes, layers, heads))
        self.class_n = np.zeros((num_classes, layers), dtype=np.int64)
        self._labels: np.ndarray | None = None

    def begin_batch(self, batch: BatchInfo) -> None:
        self.all.begin_batch(batch)
        self._labels = batch.labels

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        d = self.all.layer_values(layer, attn, rows)
        if d is None:
            return
        self.all.add(layer, d)
        if self.num_classes and self._labels is not None:
            for c in np.unique(self._labels):
                if c < 0:
                    continue
                self.class_mean[c, layer], self.class_m2[c, layer], self.class_n[c, layer] = add_samples(
                    self.class_mean[c, layer], self.class_m2[c, layer], int(self.class_n[c, layer]),
                    d[self._labels == c])

    def state(self) -> dict[str, Any]:
        a = self.all
        return {"mean": a.mean, "m2": a.m2, "counts": a.counts, "grid": np.asarray(a.grid or (0, 0)),
                "image_size": np.asarray(a.image_size or (0, 0)), "class_mean": self.class_mean,
                "class_m2": self.class_m2, "class_n": self.class_n}

    @staticmethod
    def merge_states(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
        out = dict(x)
        out["mean"], out["m2"], out["counts"] = merge_moment_rows(
            x["mean"], x["m2"], x["counts"], y["mean"], y["m2"], y["counts"])
        out["class_mean"], out["class_m2"], out["class_n"] = merge_moment_rows(
            x["class_mean"], x["class_m2"], x["class_n"], y["class_mean"], y["class_m2"], y["class_n"])
        if not np.asarray(x["grid"]).any():
            out["grid"], out["image_size"] = y["grid"], y["image_size"]
        return out


class RolloutStats(RolloutAccumulator):
    """Per-image rollout statistics, accumulated as sums (no map is kept).

    For the source row r of R (class token, or the mean of the patch rows) over all tokens:
    ``prefix_mass`` = its mass on prefix tokens; ``entropy`` = entropy (nats) of its patch part
    normalised to sum 1; with masks, ``mass_in_mask`` = share of the patch part on the object.
    """

    METRICS = ("prefix_mass", "entropy", "mass_in_mask")

    def __init__(self, m: LoadedModel) -> None:
        s = m.spec
        super().__init__(s.num_layers, s.num_prefix_tokens, s.has_class_token)
        self.sums = np.zeros(len(self.METRICS))
        self.squares = np.zeros(len(self.METRICS))
        self.counts = np.zeros(len(self.METRICS), dtype=np.int64)
        self._masks: np.ndarray | None = None

    def begin_batch(self, batch: BatchInfo) -> None:
        super().begin_batch(batch)
        self._masks = batch.masks

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        if len(self._fused) != self.num_layers or self.grid is None:
            raise RuntimeError("Rollout needs one complete forward per batch.")
        row = rollout_row(self._fused, self.num_prefix_tokens, self.has_class_token).cpu().numpy()
        self._fused = []
        p = self.num_prefix_tokens
        patch = row[:, p:]
        share = patch / np.maximum(patch.sum(1, keepdims=True), np.finfo(np.float64).tiny)
        values = [row[:, :p].sum(1), -(share * np.log(np.where(share > 0, share, 1.0))).sum(1)]
        if self._masks is not None:
            cover = np.stack([patch_coverage(mk, self.grid) for mk in np.asarray(self._masks, dtype=bool)])
            values.append((share * cover.reshape(len(cover), -1)).sum(1))
        for i, v in enumerate(values):
            self.sums[i] += v.sum()
            self.squares[i] += (v ** 2).sum()
            self.counts[i] += v.size

    def state(self) -> dict[str, Any]:
        return {"sums": self.sums, "squares": self.squares, "counts": self.counts}

    @staticmethod
    def merge_states(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
        return {"sums": x["sums"] + y["sums"], "squares": x["squares"] + y["squares"],
                "counts": x["counts"] + y["counts"]}


class Predictions(AttentionConsumer):
    """Correct predictions overall and per class (images with labels; label -1 = unknown)."""

    def __init__(self, m: LoadedModel, num_classes: int = 0) -> None:
        self.has_classifier = m.spec.num_classes > 0
        self.correct = np.zeros(max(num_classes, 1), dtype=np.int64)
        self.total = np.zeros(max(num_classes, 1), dtype=np.int64)
        self._labels: np.ndarray | None = None

    def begin_batch(self, batch: BatchInfo) -> None:
        self._labels = batch.labels

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        if not self.has_classifier or logits is None or self._labels is None:
            return
        pred = logits.argmax(-1).cpu().numpy()
        for c in np.unique(self._labels):
            if c < 0 or c >= len(self.total):
                continue
            sel = self._labels == c
            self.correct[c] += int((pred[sel] == c).sum())
            self.total[c] += int(sel.sum())

    def state(self) -> dict[str, Any]:
        return {"correct": self.correct, "total": self.total}

    @staticmethod
    def merge_states(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
        return {"correct": x["correct"] + y["correct"], "total": x["total"] + y["total"]}


#: the consumer behind each state in a shard file
STATS = {"distance": SurveyDistance, "rollout": RolloutStats, "predictions": Predictions}


def merge(x: dict[str, dict[str, Any]], y: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge two shards' states (``{stat name: state}``); stats missing on one side are taken as is."""
    out = dict(x)
    for name, state in y.items():
        out[name] = STATS[name].merge_states(out[name], state) if name in out else state
    return out


def flatten(states: dict[str, dict[str, Any]]) -> dict[str, np.ndarray]:
    """{stat: {key: array}} -> {"stat.key": array} for an npz file."""
    return {f"{name}.{key}": np.asarray(value) for name, state in states.items() for key, value in state.items()}


def unflatten(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in arrays.items():
        name, _, field = key.partition(".")
        if name not in STATS:
            raise InvalidParameterError(f"A survey shard holds an unknown statistic {name!r}.")
        out.setdefault(name, {})[field] = value
    return out
