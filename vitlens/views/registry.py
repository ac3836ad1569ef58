"""The one list of vitlens's views, ``VIEWS``: what ``analyze(views=...)``, the command line, the HTML
report and the app offer is read from here.

Each ``View`` says its name, the figure of the paper it serves, how it is computed (a consumer
of the streaming engine, fed from the one forward per batch that every attention view shares,
or a function of the weights alone), the result class it gives, and what a survey keeps of a
weight-only view. The figure that draws a result is registered beside the figure function, by the
result's class (``vitlens.figures.draws``; the figures sit above the views, which name none). Adding
a view is its module, its figure function decorated with ``@draws(ItsResult)``, and one entry here.

What a survey keeps per (model, image shard) is the survey's own list, ``vitlens.survey.stats.SURVEY_VIEWS``
(the survey sits above the views, so it names the views' consumers, never the other way round).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..kinds import all_kinds, kind_names, kind_of
from .class_attention import ClassAttentionDistanceAccumulator, ClassAttentionRolloutAccumulator
from .distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .filters import FilterPCAResult, embedding_filter_pca, max_filter_components
from .position import PositionSimilarityResult, neighbour_similarity, position_similarity
from .prefix import PrefixDiagnostics, PrefixDiagnosticsResult
from .relpos import RelativePositionBiasResult, offset_structure, relative_position_bias
from .rollout import RolloutAccumulator, RolloutResult
from .windowed import WindowedDistanceAccumulator, WindowedRolloutAccumulator

if TYPE_CHECKING:
    from ..loading.model import LoadedModel
    from ..engine.consumer import AttentionConsumer


@dataclass(frozen=True)
class ViewParams:
    """The parameters ``analyze`` hands every view's builder (each takes what it needs)."""

    n_components: int = 28
    renormalize: bool = True
    head_fusion: str = "mean"
    discard_ratio: float = 0.0


def _filters(m: "LoadedModel", p: ViewParams) -> Any:
    return embedding_filter_pca(m, min(p.n_components, max_filter_components(m)))


def _position(m: "LoadedModel", p: ViewParams) -> Any:
    return position_similarity(m)


def _relpos(m: "LoadedModel", p: ViewParams) -> Any:
    return relative_position_bias(m)


def _filters_summary(result: Any) -> dict[str, float]:
    return {"filter_pca_top1": float(result.explained_variance_ratio[0]),
            "filter_pca_top28": float(result.explained_variance_ratio.sum())}


def _position_summary(result: Any) -> dict[str, float]:
    return {f"position_{k}": float(v) for k, v in neighbour_similarity(result).items()}


def _relpos_summary(result: Any) -> dict[str, float]:
    return {f"relpos_{k}": float(v) for k, v in offset_structure(result).items()}


def reader_for(m: "LoadedModel", view: str) -> Any:
    """The consumer class of ``view`` (``View.readers``) that reads ``m``'s kind of maps (``Kind.reader_among``).

    Raises:
        ViewNotAvailableError: no consumer of the view reads them (the view is not defined for the kind).
    """
    found = kind_of(m).reader_among(VIEWS[view].readers)
    if found is None:
        raise ViewNotAvailableError(f"The {view} view is not defined for {m.spec.name} ({kind_of(m).label}): no "
                                    "consumer of it reads its attention maps.")
    return found


def _distance(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    # a ViT's; windowed stages: in image pixels per block and stage; CaiT: the self-attention blocks
    return reader_for(m, "distance").for_model(m, p.renormalize)


def _rollout(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    # a ViT's; through the windows and the patch mergings to the first stage's grid; CaiT: from the class token
    # through the class-attention layers, then the rest
    return reader_for(m, "rollout").for_model(m, p.head_fusion, p.discard_ratio)


def _prefix(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
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
        result_type: the class of the result it gives.
        default: one of ``analyze``'s default views (the paper's four).
        label: its short name in the app's view selector.
        shown_in: the app page that shows it beside another view ("" : a page of its own; a view
            without a page written for it gets a generic one, its figure and its numbers).
        summary: for a weight-only view, result -> the few numbers a survey's table keeps of it
            (its "weights" rows, once per model).
        readers: an attention view's consumer classes, the one for a ViT's maps first, then one per kind of maps
            it also reads (flagged with that kind's ``Kind.reader``: ``reads_windows``, ``reads_class_attention``);
            ``build`` makes the one that reads the model's maps (``reader_for``). Empty: ``build``'s consumer reads
            a ViT's maps only.

    ``kinds`` (the ``ModelSpec.kind`` values the view is defined for: ``available_views``) follows: every registered
    kind for a weight-only view, the kinds one of its ``readers`` reads for an attention view (a hierarchical model's
    windows have no prefix tokens, and a CaiT's self-attention blocks none either).
    """

    name: str
    title: str
    paper: str
    kind: str
    build: Callable[["LoadedModel", ViewParams], Any]
    result_type: type
    default: bool = True
    label: str = ""
    shown_in: str = ""
    summary: Callable[[Any], dict[str, float]] | None = None
    readers: tuple[type, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """The registered kinds the view is defined for (see the class docstring)."""
        if self.kind == "weights":
            return kind_names()
        return tuple(k.name for k in all_kinds()
                     if (k.reader_among(self.readers) is not None if self.readers else k.token_attention))

    @property
    def heading(self) -> str:
        """The title with its figure, e.g. "Mean attention distance (Fig. 7 right)"."""
        return f"{self.title} ({self.paper})" if self.paper else self.title

    def result_class(self) -> type:
        """The class of the result it gives (``result_type``)."""
        return self.result_type


VIEWS: dict[str, View] = {v.name: v for v in (
    View("filters", "Embedding filters", "Fig. 7 left", "weights", _filters,
         FilterPCAResult, label="Filters",
         summary=_filters_summary),
    View("position", "Position embedding similarity", "Fig. 7 centre", "weights", _position,
         PositionSimilarityResult,
         label="Position embeddings", summary=_position_summary),
    View("relpos", "Relative-position bias by offset", "analogue of Fig. 7 centre", "weights", _relpos,
         RelativePositionBiasResult, default=False, label="Relative position bias",
         shown_in="Position embeddings", summary=_relpos_summary),
    View("distance", "Mean attention distance", "Fig. 7 right", "attention", _distance,
         AttentionDistanceResult, label="Attention distance",
         readers=(AttentionDistanceAccumulator, WindowedDistanceAccumulator, ClassAttentionDistanceAccumulator)),
    View("rollout", "Attention rollout", "Fig. 6", "attention", _rollout,
         RolloutResult, label="Attention rollout", shown_in="Attention maps",
         readers=(RolloutAccumulator, WindowedRolloutAccumulator, ClassAttentionRolloutAccumulator)),
    View("prefix", "Prefix tokens: attention parked and token norms", "", "attention", _prefix,
         PrefixDiagnosticsResult, default=False,
         label="Prefix tokens", shown_in="Attention distance", readers=(PrefixDiagnostics,)),
)}

#: the view names ``analyze`` takes, and the paper's four it computes by default
VIEW_NAMES: tuple[str, ...] = tuple(VIEWS)
DEFAULT_VIEWS: tuple[str, ...] = tuple(name for name, v in VIEWS.items() if v.default)


def available_views(m: "LoadedModel | Any", names: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The views defined for a model's kind (``View.kinds``, from the kind registry and the views' consumers).

    Args:
        m: the model, its ``ModelSpec``, or a kind's name (what ``kind_of`` takes).
        names: the views to choose from (default every one of ``VIEWS``).

    Returns:
        Those of ``names`` defined for it, in their order.

    Raises:
        UnsupportedModelError: the model's kind is not registered.
    """
    kind = kind_of(m).name
    return tuple(n for n in (VIEW_NAMES if names is None else names) if kind in VIEWS[n].kinds)


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


__all__ = ["DEFAULT_VIEWS", "VIEWS", "VIEW_NAMES", "View", "ViewParams", "available_views", "check_views", "reader_for"]
