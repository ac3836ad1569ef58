"""The statistics a survey keeps per (model, image shard): streaming consumers whose partial
states are plain arrays, saved as npz and merged exactly on the driver.

- ``SurveyDistance``: attention distance per head (paper Fig. 7 right, Fig. 11) over all images
  and, with labels, per class (running mean and sum of squared deviations, Chan et al.'s merge);
- ``RolloutStats``: per image, the rollout row's mass on prefix tokens, the entropy of its patch
  part, and with masks the share of patch mass on the object (Fig. 6), as sums and sums of squares;
- ``Predictions``: how many images were predicted right, overall and per class.

``SURVEY_VIEWS`` is the survey's one list of what it keeps (``vitlens survey --views``, the worker, the
store): each entry names its consumer class; the views registry (``vitlens.views.registry``) sits below
and names none of them.

They are ordinary consumers of the streaming engine: a shard's states are their ``state()``
arrays, and two shards merge as ``from_state(x).merge(from_state(y))``. Merging is exact up to
float64 rounding, so a survey equals one process over the same images
whatever the shard size and the order shards finish in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..attribution.masks import patch_coverage
from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..views.distance import (AttentionDistanceAccumulator, AttentionDistanceResult, add_samples, merge_moment_rows,
                              merge_moments)
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..kinds import kind_of
from ..views.class_attention import ClassAttentionRolloutAccumulator
from ..views.registry import VIEWS, ViewParams
from ..views.windowed import WindowedDistanceAccumulator, WindowedDistanceResult, WindowedRolloutAccumulator


class SurveyDistance(AttentionConsumer):
    """Attention distance per head over all images, and per class when the images have labels."""

    #: a CaiT's maps too: the distance of its self-attention blocks (the distance view's consumer for it)
    reads_class_attention = True

    def __init__(self, m: LoadedModel | None, num_classes: int = 0, renormalize: bool = True) -> None:
        self.all = AttentionDistanceAccumulator.for_model(m.spec, renormalize) if m is not None else None
        self.num_classes = num_classes
        layers, heads = (m.spec.num_layers, m.spec.num_heads) if m is not None else (0, 0)
        #: blocks read: all of a ViT's; a CaiT's self-attention blocks (its class-attention layers' one query, the
        #: class token, has no position: ``vitlens.views.class_attention``)
        self.depth = layers
        if m is not None and not kind_of(m).token_attention:  # a CaiT: its view's distance of those blocks (inner)
            view = VIEWS["distance"].build(m, ViewParams(renormalize=renormalize))
            self.all, self.depth = view.inner, view.depth
            layers = self.depth
        self.class_mean = np.zeros((num_classes, layers, heads))
        self.class_m2 = np.zeros((num_classes, layers, heads))
        self.class_n = np.zeros((num_classes, layers), dtype=np.int64)
        self._labels: np.ndarray | None = None

    @classmethod
    def for_model(cls, m: LoadedModel, num_classes: int, renormalize: bool = True) -> "SurveyDistance":
        return cls(m, num_classes, renormalize)

    @classmethod
    def for_survey(cls, m: LoadedModel, num_classes: int, renormalize: bool = True
                   ) -> "SurveyDistance | SurveyWindowedDistance":
        """The distance statistic that reads ``m``'s kind of maps (``Kind.reader_among``): per block and stage in
        image pixels for a hierarchical model."""
        return kind_of(m).reader_among((cls, SurveyWindowedDistance)).for_model(m, num_classes, renormalize)

    def begin_batch(self, batch: BatchInfo) -> None:
        self.all.begin_batch(batch)
        self._labels = batch.labels

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        if layer >= self.depth:  # a CaiT's class-attention layer: no distance
            return
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

    def state(self) -> dict[str, np.ndarray]:
        return {**self.all.state(), "class_mean": self.class_mean, "class_m2": self.class_m2,
                "class_n": self.class_n}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "SurveyDistance | SurveyWindowedDistance":
        if "window_uniform_px" in state:  # a hierarchical model's (``SurveyWindowedDistance.state``)
            return SurveyWindowedDistance.from_state(state)
        out = cls(None, len(state["class_n"]))
        out.all = AttentionDistanceAccumulator.from_state(state)
        out.class_mean, out.class_m2 = np.asarray(state["class_mean"]), np.asarray(state["class_m2"])
        out.class_n = np.asarray(state["class_n"])
        return out

    def merge(self, other: "SurveyDistance") -> "SurveyDistance":
        out = SurveyDistance(None, self.num_classes)
        out.all = self.all.merge(other.all)
        out.class_mean, out.class_m2, out.class_n = merge_moment_rows(
            self.class_mean, self.class_m2, self.class_n, other.class_mean, other.class_m2, other.class_n)
        return out

    def result(self, spec: ModelSpec | str = "") -> AttentionDistanceResult:
        """Attention distance over all images, as ``vl.attention_distance`` gives it."""
        return self.all.result(spec)

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """The survey table's rows of it (``metric``, ``value``, ``n``, ``layer``, ``head``, ``cls``):
        uniform distance, per head mean / std in pixels and mean in image widths, and per class."""
        if self.all is None or not self.all.counts.size or int(self.all.counts.min()) == 0:
            return []
        acc = AttentionDistanceAccumulator.from_state(self.all.state(), tuple(spec["stride_px"]),
                                                      int(spec.get("num_prefix_tokens", 0)), renormalize)
        d = acc.result()
        n, width = d.n_images, float(d.image_size[1])
        rows = [dict(metric="uniform_distance_px", value=d.uniform_px, n=n)]
        for l, h in np.ndindex(*d.mean_px.shape):
            rows += [dict(metric="mean_distance_px", value=d.mean_px[l, h], n=n, layer=l + 1, head=h + 1),
                     dict(metric="std_distance_px", value=d.std_px[l, h], n=n, layer=l + 1, head=h + 1),
                     dict(metric="mean_distance_width", value=d.mean_px[l, h] / width, n=n, layer=l + 1, head=h + 1)]
        for c, name in enumerate(classes):
            if c < len(self.class_n) and int(self.class_n[c].min()) > 0:
                for l, h in np.ndindex(*self.class_mean.shape[1:]):
                    cn = int(self.class_n[c, l])
                    rows += [dict(metric="mean_distance_px", value=self.class_mean[c, l, h], n=cn, layer=l + 1,
                                  head=h + 1, cls=name),
                             dict(metric="mean_distance_width", value=self.class_mean[c, l, h] / width, n=cn,
                                  layer=l + 1, head=h + 1, cls=name)]
        return rows


class SurveyWindowedDistance(AttentionConsumer):
    """A hierarchical model's attention distance in image pixels per head and block (``WindowedDistanceAccumulator``),
    over all images and per class; its table says each block's stage, its window-uniform distance, each head as a
    multiple of it, and per stage the mean over the stage's heads, from moments that merge exactly."""

    reads_windows = True

    def __init__(self, acc: WindowedDistanceAccumulator, num_classes: int = 0) -> None:
        self.all, self.num_classes = acc, num_classes
        shape = (num_classes, *acc.mean.shape)
        self.class_mean, self.class_m2 = np.zeros(shape), np.zeros(shape)
        self.class_n = np.zeros(num_classes, dtype=np.int64)
        self._labels: np.ndarray | None = None

    @classmethod
    def for_model(cls, m: LoadedModel, num_classes: int, renormalize: bool = True) -> "SurveyWindowedDistance":
        return cls(WindowedDistanceAccumulator.for_model(m, renormalize), num_classes)

    def begin_batch(self, batch: BatchInfo) -> None:
        self.all.begin_batch(batch)
        self._labels = batch.labels

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.all.on_attention(layer, attn, rows)

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        values = np.nan_to_num(self.all.batch_values(), nan=0.0)
        if self.num_classes and self._labels is not None:
            for c in np.unique(self._labels):
                if 0 <= c < self.num_classes:
                    self.class_mean[c], self.class_m2[c], self.class_n[c] = add_samples(
                        self.class_mean[c], self.class_m2[c], int(self.class_n[c]), values[self._labels == c])
        self.all.end_batch(logits)

    def state(self) -> dict[str, np.ndarray]:
        return {**self.all.state(), "class_mean": self.class_mean, "class_m2": self.class_m2, "class_n": self.class_n}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "SurveyWindowedDistance":
        out = cls(WindowedDistanceAccumulator.from_state(state), len(state["class_n"]))
        out.class_mean, out.class_m2 = np.asarray(state["class_mean"]), np.asarray(state["class_m2"])
        out.class_n = np.asarray(state["class_n"])
        return out

    def merge(self, other: "SurveyWindowedDistance") -> "SurveyWindowedDistance":
        out = SurveyWindowedDistance(self.all.merge(other.all), self.num_classes)
        for c in range(self.num_classes):
            out.class_mean[c], out.class_m2[c], out.class_n[c] = merge_moments(
                self.class_mean[c], self.class_m2[c], int(self.class_n[c]), other.class_mean[c], other.class_m2[c],
                int(other.class_n[c]))
        return out

    def result(self, spec: ModelSpec | str = "") -> WindowedDistanceResult:
        """The windowed distance over all images, as ``vl.attention_distance`` gives it for the model."""
        return self.all.result(spec)

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """Per head: mean / std in pixels, mean in image widths and as a multiple of its window's uniform
        distance; per block: the window-uniform distance; per stage: the mean over its heads (in pixels and of
        the window); per class: the heads' means. Every row names its stage (1-based)."""
        if self.all.n == 0:
            return []
        d = self.all.result()
        n, width = d.n_images, float(d.image_size[1])
        rows: list[dict[str, Any]] = []
        for layer in range(d.mean_px.shape[0]):
            stage = int(d.stages[layer]) + 1
            rows.append(dict(metric="window_uniform_px", value=d.window_uniform_px[layer], n=n, layer=layer + 1,
                             stage=stage))
            for h in range(self.all.heads[layer]):
                at = dict(n=n, layer=layer + 1, head=h + 1, stage=stage)
                rows += [dict(metric="mean_distance_px", value=d.mean_px[layer, h], **at),
                         dict(metric="std_distance_px", value=d.std_px[layer, h], **at),
                         dict(metric="mean_distance_width", value=d.mean_px[layer, h] / width, **at),
                         dict(metric="mean_distance_of_window", value=d.of_window[layer, h], **at)]
        for s in np.unique(d.stages):
            sel = d.stages == s
            rows += [dict(metric="mean_distance_px", value=float(np.nanmean(d.mean_px[sel])), n=n, stage=int(s) + 1),
                     dict(metric="mean_distance_of_window", value=float(np.nanmean(d.of_window[sel])), n=n,
                          stage=int(s) + 1)]
        for c, name in enumerate(classes):
            if c < self.num_classes and int(self.class_n[c]) > 0:
                for layer in range(d.mean_px.shape[0]):
                    for h in range(self.all.heads[layer]):
                        rows.append(dict(metric="mean_distance_px", value=self.class_mean[c, layer, h],
                                         n=int(self.class_n[c]), layer=layer + 1, head=h + 1,
                                         stage=int(d.stages[layer]) + 1, cls=name))
        return rows


class RolloutStats(AttentionConsumer):
    """Per-image rollout statistics, accumulated as sums (no map is kept).

    For the source row r of R (class token, or the mean of the patch rows) over all tokens:
    ``prefix_mass`` = its mass on prefix tokens; ``entropy`` = entropy (nats) of its patch part
    normalised to sum 1; with masks, ``mass_in_mask`` = share of the patch part on the object.
    The row comes from a ``RolloutAccumulator`` it feeds (``batch_row``).
    """

    METRICS = ("prefix_mass", "entropy", "mass_in_mask")

    def __init__(self, m: LoadedModel | None) -> None:
        self.rollout: Any = None
        if m is not None:
            # the rollout view's consumer for the model's kind of maps: a ViT's; through the windows and stages to the
            # first grid; a CaiT's from the class token through both kinds; it reads them through that consumer
            self.rollout = VIEWS["rollout"].build(m, ViewParams())
            if kind_of(m).reader:
                setattr(self, kind_of(m).reader, True)
        self.sums = np.zeros(len(self.METRICS))
        self.squares = np.zeros(len(self.METRICS))
        self.counts = np.zeros(len(self.METRICS), dtype=np.int64)
        self._masks: np.ndarray | None = None

    @classmethod
    def for_survey(cls, m: LoadedModel, num_classes: int, renormalize: bool = True) -> "RolloutStats":
        return cls(m)

    def begin_batch(self, batch: BatchInfo) -> None:
        self.rollout.begin_batch(batch)
        self._masks = batch.masks

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.rollout.on_attention(layer, attn, rows)

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        row = self.rollout.batch_row().cpu().numpy()
        if isinstance(self.rollout, WindowedRolloutAccumulator):  # no prefix tokens; the first block's input grid
            p, grid = 0, self.rollout.windows[0].in_grid
        elif isinstance(self.rollout, ClassAttentionRolloutAccumulator):  # the row over the patches
            p, grid = 0, self.rollout.grid
        else:
            p, grid = self.rollout.num_prefix_tokens, self.rollout.grid
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
        out = cls(None)
        out.sums, out.squares, out.counts = (np.asarray(state[k]) for k in ("sums", "squares", "counts"))
        return out

    def merge(self, other: "RolloutStats") -> "RolloutStats":
        out = RolloutStats(None)
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


class Predictions(AttentionConsumer):
    """Correct predictions overall and per class (images with labels; label -1 = unknown)."""

    # it reads the logits, no attention map: a hierarchical model's or a CaiT's as any other's
    reads_windows = reads_class_attention = True

    def __init__(self, has_classifier: bool, num_classes: int = 0) -> None:
        self.has_classifier = has_classifier
        self.correct = np.zeros(max(num_classes, 1), dtype=np.int64)
        self.total = np.zeros(max(num_classes, 1), dtype=np.int64)
        self._labels: np.ndarray | None = None

    @classmethod
    def for_survey(cls, m: LoadedModel, num_classes: int, renormalize: bool = True) -> "Predictions | None":
        """None when the images have no classes (nothing to count)."""
        return cls(m.spec.num_classes > 0, num_classes) if num_classes else None

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

    def state(self) -> dict[str, np.ndarray]:
        return {"correct": self.correct, "total": self.total}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "Predictions":
        out = cls(True, len(state["total"]))
        out.correct, out.total = np.asarray(state["correct"]), np.asarray(state["total"])
        return out

    def merge(self, other: "Predictions") -> "Predictions":
        out = Predictions(self.has_classifier, len(self.total))
        out.correct, out.total = self.correct + other.correct, self.total + other.total
        return out

    def result(self, spec: ModelSpec | str = "") -> float:
        """Accuracy over the labelled images (nan without any)."""
        n = int(self.total.sum())
        return float(self.correct.sum() / n) if n else float("nan")

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """Accuracy over all labelled images, then per class."""
        n = int(self.total.sum())
        if not n:
            return []
        rows = [dict(metric="accuracy", value=self.correct.sum() / n, n=n)]
        for c, name in enumerate(classes):
            if c < len(self.total) and int(self.total[c]):
                rows.append(dict(metric="accuracy", value=self.correct[c] / self.total[c], n=int(self.total[c]),
                                 cls=name))
        return rows


@dataclass(frozen=True)
class SurveyView:
    """One statistic a survey keeps per (model, image shard), or once per model ("weights").

    Attributes:
        name: what ``vitlens survey --views`` takes and the shard files name it.
        stat: its consumer class, whose ``for_survey(m, num_classes, renormalize)`` builds it (None when there
            is nothing to keep, e.g. predictions of a model without classes) and whose ``from_state`` /
            ``state`` / ``merge`` carry it between processes; None for the weight-only summary, computed once
            per model from the views' own ``View.summary``.
        describes: what the table rows of it mean.
    """

    name: str
    stat: type[AttentionConsumer] | None
    describes: str

    def stat_class(self) -> type[AttentionConsumer]:
        """Its consumer class.

        Returns:
            ``stat``.

        Raises:
            InvalidParameterError: the weight-only summary, which has no per-shard statistic.
        """
        if self.stat is None:
            raise InvalidParameterError(f"The survey view {self.name!r} has no per-shard statistic.")
        return self.stat


SURVEY_VIEWS: dict[str, SurveyView] = {v.name: v for v in (
    SurveyView("distance", SurveyDistance,
               "attention distance per head (Fig. 7 right, Fig. 11), over all images and per class"),
    SurveyView("rollout", RolloutStats,
               "the rollout row's prefix mass, patch entropy and mass in the object mask (Fig. 6)"),
    SurveyView("predictions", Predictions, "accuracy, overall and per class"),
    SurveyView("weights", None, "filter PCA's explained variance (Fig. 7 left) and position-embedding structure "
               "(Fig. 7 centre) or, for relative-position models, the learned bias's locality by offset, once per "
               "model"),
)}
#: what ``vitlens survey --views`` offers, by default all of it
SURVEY_VIEW_NAMES: tuple[str, ...] = tuple(SURVEY_VIEWS)


def stat_class(name: str) -> type[AttentionConsumer]:
    """The consumer behind a survey state (``SURVEY_VIEWS``)."""
    view = SURVEY_VIEWS.get(name)
    if view is None or view.stat is None:
        raise InvalidParameterError(f"A survey shard holds an unknown statistic {name!r}.")
    return view.stat


def merge(x: dict[str, dict[str, Any]], y: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge two shards' states (``{stat name: state}``) through their consumers' ``merge``; stats
    missing on one side are taken as is."""
    out = dict(x)
    for name, state in y.items():
        if name in out:
            cls = stat_class(name)
            out[name] = cls.from_state(out[name]).merge(cls.from_state(state)).state()
        else:
            out[name] = state
    return out


def flatten(states: dict[str, dict[str, Any]]) -> dict[str, np.ndarray]:
    """{stat: {key: array}} -> {"stat.key": array} for an npz file."""
    return {f"{name}.{key}": np.asarray(value) for name, state in states.items() for key, value in state.items()}


def unflatten(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in arrays.items():
        name, _, field = key.partition(".")
        stat_class(name)  # a clear error for a statistic this vitlens does not know
        out.setdefault(name, {})[field] = value
    return out
