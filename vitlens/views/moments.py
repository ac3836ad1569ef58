"""Running moments that merge exactly: (mean, sum of squared deviations, count) per counter, folded in sample by
sample and combined by Chan et al.'s parallel update (float64), so partial statistics over disjoint image sets (a
survey's shards, in any order) give the statistics over all of them.

``ClassMoments`` keeps them per class of the images (labels from ``BatchInfo.labels``; -1 or a label outside the
classes is not counted): the per-class part of an attention view's own accumulator, so the view's state serves a
survey's per-class table directly.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def merge_moments(mean_a: np.ndarray, m2_a: np.ndarray, n_a: int,
                  mean_b: np.ndarray, m2_b: np.ndarray, n_b: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Combine (mean, sum of squared deviations, count) of two disjoint samples."""
    n = n_a + n_b
    if n_a == 0:
        return mean_b.copy(), m2_b.copy(), n_b
    if n_b == 0:
        return mean_a.copy(), m2_a.copy(), n_a
    delta = mean_b - mean_a
    return mean_a + delta * (n_b / n), m2_a + m2_b + delta**2 * (n_a * n_b / n), n


def merge_moment_rows(mean_a: np.ndarray, m2_a: np.ndarray, n_a: np.ndarray, mean_b: np.ndarray,
                      m2_b: np.ndarray, n_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``merge_moments`` for arrays whose leading axes index separate counters (``n`` has those
    axes, e.g. one count per layer, or per class and layer)."""
    mean, m2, n = mean_a.copy(), m2_a.copy(), n_a.copy()
    for idx in np.ndindex(n_a.shape):
        mean[idx], m2[idx], n[idx] = merge_moments(mean_a[idx], m2_a[idx], int(n_a[idx]), mean_b[idx], m2_b[idx],
                                                   int(n_b[idx]))
    return mean, m2, n


def add_samples(mean: np.ndarray, m2: np.ndarray, n: int, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Fold ``samples`` [k, ...] into running (mean, sum of squared deviations, count)."""
    batch_mean = samples.mean(axis=0)
    return merge_moments(mean, m2, n, batch_mean, ((samples - batch_mean) ** 2).sum(axis=0), samples.shape[0])


class ClassMoments:
    """Running moments of per-image values, per class: ``mean`` and ``m2`` [C, *counters, *values], ``n``
    [C, *counters] (one count per class and counter, e.g. per class and layer).

    Args:
        num_classes: C (0: nothing is kept).
        counters: the shape of the separately counted parts (``(layers,)`` when each layer is folded in on its own,
            ``()`` when every layer comes at once).
        values: the shape of one image's values at one counter (``(heads,)``, or ``(layers, heads)``).
    """

    KEYS = ("class_mean", "class_m2", "class_n")

    def __init__(self, num_classes: int, counters: tuple[int, ...], values: tuple[int, ...]) -> None:
        self.num_classes = int(num_classes)
        self.mean = np.zeros((self.num_classes, *counters, *values))
        self.m2 = np.zeros((self.num_classes, *counters, *values))
        self.n = np.zeros((self.num_classes, *counters), dtype=np.int64)

    def add(self, labels: np.ndarray | None, values: np.ndarray, at: tuple[int, ...] = ()) -> None:
        """Fold the batch's per-image ``values`` [B, *values] at counter ``at`` into each image's class."""
        if not self.num_classes or labels is None:
            return
        for c in np.unique(labels):
            if 0 <= c < self.num_classes:
                i = (int(c), *at)
                self.mean[i], self.m2[i], self.n[i] = add_samples(self.mean[i], self.m2[i], int(self.n[i]),
                                                                  values[labels == c])

    def merge(self, other: "ClassMoments") -> "ClassMoments":
        """The moments over the images of both."""
        out = ClassMoments(0, (), ())
        out.num_classes = self.num_classes
        out.mean, out.m2, out.n = merge_moment_rows(self.mean, self.m2, self.n, other.mean, other.m2, other.n)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return dict(zip(self.KEYS, (self.mean, self.m2, self.n)))

    @classmethod
    def from_state(cls, state: dict[str, Any], counters: tuple[int, ...], values: tuple[int, ...]) -> "ClassMoments":
        """The moments of a ``state()`` (none kept when the state has no class keys: a view's own run)."""
        if "class_n" not in state:
            return cls(0, counters, values)
        out = cls(0, (), ())
        out.mean, out.m2 = (np.asarray(state[k], dtype=np.float64) for k in cls.KEYS[:2])
        out.n = np.asarray(state["class_n"])
        out.num_classes = len(out.n)
        return out

    def has(self, c: int) -> bool:
        """Whether class ``c`` has images at every counter."""
        return c < self.num_classes and int(self.n[c].min()) > 0
