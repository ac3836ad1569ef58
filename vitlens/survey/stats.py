"""The statistics a survey keeps per (model, image shard): streaming consumers whose partial
states are plain arrays, saved as npz and merged exactly on the driver.

What it keeps of a view is the view's own: each registered attention view with a ``View.survey``
(``vitlens.views.registry``) gives its consumer for the model, whose state is saved and merged as it is:

- ``distance``: the distance view's accumulator with its moments per class too (per head, Fig. 7 right, Fig. 11;
  running mean and sum of squared deviations, Chan et al.'s merge; per block and stage for a hierarchical model);
- ``rollout``: per image, the rollout row's mass on prefix tokens, the entropy of its patch part, and with masks
  the share of patch mass on the object (Fig. 6), as sums and sums of squares (``vitlens.views.rollout_stats``).

Besides them, ``components`` (asked for by name, ``--views components``): each head's part of the predicted class's
logit and the ledger's residual, summed over images (``vitlens.survey.components``; its own pass, not a consumer);
and ``spacetime``, kept by every survey of clips (``sources.clips_source``): a video model's space-time distance and
rollout over the shard's clips (``vitlens.survey.spacetime``; merged with ``SpaceTimeAccumulator.merge``).

Besides them the survey keeps its own ``Predictions`` (how many images were predicted right, overall and per class)
and the weight views' ``View.summary`` once per model. ``survey_views()`` is the one list of what it keeps
(``vitlens survey --views``, the worker, the store), read from the views registry each time.

They are ordinary consumers of the streaming engine: a shard's states are their ``state()``
arrays, and two shards merge as ``from_state(x).merge(from_state(y))``. Merging is exact up to
float64 rounding, so a survey equals one process over the same images
whatever the shard size and the order shards finish in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..views.registry import VIEWS, View, ViewParams, available_views
from ..views.rollout_stats import RolloutStats  # noqa: F401  (importable here, where it was)
from .components import HeadContributions, head_contributions
from .spacetime import SpaceTimeStats, spacetime_stats


class Predictions(AttentionConsumer):
    """Correct predictions overall and per class (images with labels; label -1 = unknown)."""

    # it reads the logits, no attention map: every kind's model as any other's
    reads_every_kind = True

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
        describes: what the table rows of it mean.
        build: (model, number of classes, renormalize) -> its consumer for the model (None when there is nothing to
            keep, e.g. predictions of a model without classes); None for the weight-only summary, computed once per
            model from the views' own ``View.summary``.
        from_state: a shard's saved ``state()`` -> an object that ``merge``s and gives its ``state`` and
            ``table_rows``.
        compute: (model, the shard's images, batch size, renormalize) -> the statistic as that object (None: not
            kept for this model), for a statistic that is no consumer of the streaming engine and runs its own pass
            over the images (``components``: ``decompose``'s own float64 forward; ``spacetime``: the clips' one
            forward); None for a consumer's.
        default: whether a survey keeps it when ``views`` is not given (``DEFAULT_SURVEY_VIEW_NAMES``).
        clips: its ``compute`` reads a shard of clips (a survey of video models, ``sources.clips_source``), not
            images; a survey of clips keeps it whatever ``views`` says, a survey of images never runs it.
    """

    name: str
    describes: str
    build: Callable[[LoadedModel, int, bool], AttentionConsumer | None] | None = None
    from_state: Callable[[dict[str, Any]], Any] | None = None
    compute: Callable[[LoadedModel, list, int, bool], Any] | None = None
    default: bool = True
    clips: bool = False


def _view_stat(view: View) -> SurveyView:
    """A registered attention view's survey statistic: its own consumer for the model, as ``View.survey`` keeps it."""
    kept = view.survey
    assert kept is not None

    def build(m: LoadedModel, num_classes: int, renormalize: bool = True) -> AttentionConsumer | None:
        if not available_views(m, (view.name,)):  # not defined for this kind of model
            return None
        return kept.keep(view.build(m, ViewParams(renormalize=renormalize)), num_classes)

    return SurveyView(view.name, kept.describes, build, kept.from_state)


#: what the survey keeps besides the views' own statistics (``View.survey``, ``View.summary``)
OWN_STATS: tuple[SurveyView, ...] = (
    SurveyView("predictions", "accuracy, overall and per class", Predictions.for_survey, Predictions.from_state),
    SurveyView("components", "each head's mean part of the predicted class's logit (and its spread), each MLP's, and "
               "the ledger's residual (docs/definitions.md, \"Direct contributions\"); asked for by name",
               from_state=HeadContributions.from_state, compute=head_contributions, default=False),
    SurveyView("spacetime", "a video model's space-time attention distance per block and head (spatial px, within "
               "the step, temporal frames; renormalised over cell keys unless renormalize=False) with the uniform "
               "baselines, and its clips' rollout maps, over a folder of clips (docs/definitions.md, \"Video: space "
               "and time\")",
               from_state=SpaceTimeStats.from_state, compute=spacetime_stats, default=False, clips=True),
    SurveyView("weights", "filter PCA's explained variance (Fig. 7 left) and position-embedding structure "
               "(Fig. 7 centre) or, for relative-position models, the learned bias's locality by offset, once per "
               "model"),
)


def survey_views() -> dict[str, SurveyView]:
    """What ``vitlens survey --views`` offers, in order: every registered view with a ``View.survey`` (the views
    registry's order), then predictions and the weight-only summary. Read from ``VIEWS`` each time, so a view
    registered later (``register_view``) is surveyed too."""
    out = {name: _view_stat(v) for name, v in VIEWS.items() if v.survey is not None}
    return {**out, **{v.name: v for v in OWN_STATS}}


def __getattr__(name: str) -> Any:
    """``SURVEY_VIEWS`` (``survey_views()``), ``SURVEY_VIEW_NAMES`` (its names) and ``DEFAULT_SURVEY_VIEW_NAMES``
    (those kept by default), read when asked for."""
    if name == "SURVEY_VIEWS":
        return survey_views()
    if name == "SURVEY_VIEW_NAMES":
        return tuple(survey_views())
    if name == "DEFAULT_SURVEY_VIEW_NAMES":  # what a survey keeps when not told: all but those asked for by name
        return tuple(k for k, v in survey_views().items() if v.default)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_state(name: str, state: dict[str, Any]) -> Any:
    """A saved survey state of statistic ``name`` as the object that merges it and gives its table rows.

    Raises:
        InvalidParameterError: a statistic this vitlens does not know (or the weight-only summary, which has no
            per-shard state).
    """
    view = survey_views().get(name)
    if view is None or view.from_state is None:
        raise InvalidParameterError(f"A survey shard holds an unknown statistic {name!r}.")
    return view.from_state(state)


def merge(x: dict[str, dict[str, Any]], y: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge two shards' states (``{stat name: state}``) through their consumers' ``merge``; stats
    missing on one side are taken as is."""
    out = dict(x)
    for name, state in y.items():
        if name in out:
            out[name] = read_state(name, out[name]).merge(read_state(name, state)).state()
        else:
            out[name] = state
    return out


def flatten(states: dict[str, dict[str, Any]]) -> dict[str, np.ndarray]:
    """{stat: {key: array}} -> {"stat.key": array} for an npz file."""
    return {f"{name}.{key}": np.asarray(value) for name, state in states.items() for key, value in state.items()}


def unflatten(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    views = survey_views()
    for key, value in arrays.items():
        name, _, field = key.partition(".")
        if name not in views or views[name].from_state is None:
            raise InvalidParameterError(f"A survey shard holds an unknown statistic {name!r}.")
        out.setdefault(name, {})[field] = value
    return out
