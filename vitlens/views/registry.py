"""The one list of vitlens's views: what ``analyze(views=...)``, the command line, the HTML
report, the app and ``vitlens survey`` offer is read from here.

Each ``View`` says its name, the figure of the paper it serves, how it is computed (a consumer
of the streaming engine, fed from the one forward per batch that every attention view shares,
or a function of the weights alone), the result it gives, the figure that draws it, and what a
survey keeps of it. Adding a view is its module, its figure function, and one entry here.

``SURVEY_VIEWS`` are the statistics a survey keeps per (model, image shard): their consumers'
partial states cross process boundaries through ``state()`` / ``from_state()`` (plain arrays
in an npz file, never a pickle) and merge through the consumers' own ``merge``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from ..loading.model import LoadedModel
    from .engine import AttentionConsumer


@dataclass(frozen=True)
class ViewParams:
    """The parameters ``analyze`` hands every view's builder (each takes what it needs)."""

    n_components: int = 28
    renormalize: bool = True
    head_fusion: str = "mean"
    discard_ratio: float = 0.0


def _filters(m: "LoadedModel", p: ViewParams) -> Any:
    from .filters import embedding_filter_pca, max_filter_components

    return embedding_filter_pca(m, min(p.n_components, max_filter_components(m)))


def _position(m: "LoadedModel", p: ViewParams) -> Any:
    from .position import position_similarity

    return position_similarity(m)


def _filters_summary(result: Any) -> dict[str, float]:
    return {"filter_pca_top1": float(result.explained_variance_ratio[0]),
            "filter_pca_top28": float(result.explained_variance_ratio.sum())}


def _position_summary(result: Any) -> dict[str, float]:
    from .position import neighbour_similarity

    return {f"position_{k}": float(v) for k, v in neighbour_similarity(result).items()}


def _distance(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    from .distance import AttentionDistanceAccumulator

    return AttentionDistanceAccumulator.for_model(m.spec, p.renormalize)


def _rollout(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    from .rollout import RolloutAccumulator

    return RolloutAccumulator.for_model(m, p.head_fusion, p.discard_ratio)


def _prefix(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    from .prefix import PrefixDiagnostics

    return PrefixDiagnostics(m)


@dataclass(frozen=True)
class View:
    """One view of a model over an image set.

    Attributes:
        name: what ``analyze(views=...)``, ``--views`` and the report call it (and the
            ``AnalysisResult`` field that holds its result).
        title: its heading in reports and the app.
        paper: the figure of the ViT paper it serves ("" for vitlens's own views).
        kind: "weights" (a function of the weights: ``build`` returns the result) or
            "attention" (``build`` returns a consumer of the streaming engine, whose
            ``result(spec)`` is the view's result).
        build: (model, ``ViewParams``) -> the result ("weights") or the consumer ("attention").
        result_type: "module:Class" of the result it gives.
        figure: the function of ``vitlens.figures`` that draws the result.
        default: one of ``analyze``'s default views (the paper's four).
        label: its short name in the app's view selector.
        shown_in: the app page that shows it beside another view ("" : a page of its own; a view
            without a page written for it gets a generic one, its figure and its numbers).
        summary: for a weight-only view, result -> the few numbers a survey's table keeps of it
            (its "weights" rows, once per model).
    """

    name: str
    title: str
    paper: str
    kind: str
    build: Callable[["LoadedModel", ViewParams], Any]
    result_type: str
    figure: str
    default: bool = True
    label: str = ""
    shown_in: str = ""
    summary: Callable[[Any], dict[str, float]] | None = None

    @property
    def heading(self) -> str:
        """The title with its figure, e.g. "Mean attention distance (Fig. 7 right)"."""
        return f"{self.title} ({self.paper})" if self.paper else self.title

    def result_class(self) -> type:
        return _resolve(self.result_type)


@dataclass(frozen=True)
class SurveyView:
    """One statistic a survey keeps per (model, image shard), or once per model ("weights").

    Attributes:
        name: what ``vitlens survey --views`` takes and the shard files name it.
        stat: "module:Class" of its consumer, whose ``for_survey(m, num_classes, renormalize)``
            builds it (None when there is nothing to keep, e.g. predictions of a model without
            classes) and whose ``from_state`` / ``state`` / ``merge`` carry it between processes;
            "" for the weight-only summary, computed once per model.
        describes: what the table rows of it mean.
    """

    name: str
    stat: str
    describes: str

    def stat_class(self) -> type:
        if not self.stat:
            raise InvalidParameterError(f"The survey view {self.name!r} has no per-shard statistic.")
        return _resolve(self.stat)


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


VIEWS: dict[str, View] = {v.name: v for v in (
    View("filters", "Embedding filters", "Fig. 7 left", "weights", _filters,
         "vitlens.views.filters:FilterPCAResult", "filters_figure", label="Filters",
         summary=_filters_summary),
    View("position", "Position embedding similarity", "Fig. 7 centre", "weights", _position,
         "vitlens.views.position:PositionSimilarityResult", "position_figure",
         label="Position embeddings", summary=_position_summary),
    View("distance", "Mean attention distance", "Fig. 7 right", "attention", _distance,
         "vitlens.views.distance:AttentionDistanceResult", "distance_figure",
         label="Attention distance"),
    View("rollout", "Attention rollout", "Fig. 6", "attention", _rollout,
         "vitlens.views.rollout:RolloutResult", "rollout_grid_figure", label="Attention rollout",
         shown_in="Attention maps"),
    View("prefix", "Prefix tokens: attention parked and token norms", "", "attention", _prefix,
         "vitlens.views.prefix:PrefixDiagnosticsResult", "prefix_figure", default=False,
         label="Prefix tokens", shown_in="Attention distance"),
)}

#: the view names ``analyze`` takes, and the paper's four it computes by default
VIEW_NAMES: tuple[str, ...] = tuple(VIEWS)
DEFAULT_VIEWS: tuple[str, ...] = tuple(name for name, v in VIEWS.items() if v.default)

SURVEY_VIEWS: dict[str, SurveyView] = {v.name: v for v in (
    SurveyView("distance", "vitlens.survey.stats:SurveyDistance",
               "attention distance per head (Fig. 7 right, Fig. 11), over all images and per class"),
    SurveyView("rollout", "vitlens.survey.stats:RolloutStats",
               "the rollout row's prefix mass, patch entropy and mass in the object mask (Fig. 6)"),
    SurveyView("predictions", "vitlens.survey.stats:Predictions", "accuracy, overall and per class"),
    SurveyView("weights", "", "filter PCA's explained variance (Fig. 7 left) and position-embedding structure "
               "(Fig. 7 centre), once per model"),
)}
SURVEY_VIEW_NAMES: tuple[str, ...] = tuple(SURVEY_VIEWS)


def check_views(views: Any, known: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """``views`` as a tuple of known names (by default those of ``VIEWS``), or a clear error naming
    what is wrong."""
    known = tuple(VIEWS) if known is None else known
    if isinstance(views, str):
        views = (views,)
    views = tuple(views)
    unknown = [v for v in views if v not in known]
    if unknown or not views:
        raise InvalidParameterError(f"views must be among {', '.join(known)}; got {list(views)}.")
    return views


__all__ = ["DEFAULT_VIEWS", "SURVEY_VIEWS", "SURVEY_VIEW_NAMES", "SurveyView", "VIEWS", "VIEW_NAMES", "View",
           "ViewParams", "check_views"]
