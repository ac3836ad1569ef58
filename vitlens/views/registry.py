"""The one list of vitlens's views, ``VIEWS``: what ``analyze(views=...)``, the command line, the HTML
report, the app and the survey offer is read from here.

Each ``View`` says its name, the figure of the paper it serves, how it is computed (a consumer
of the streaming engine, fed from the one forward per batch that every attention view shares,
or a function of the weights alone), the result class it gives, what a survey keeps of it (a weight-only
view's ``summary``; an attention view's ``survey``: its own mergeable state, read back by ``SurveyStat.from_state``)
and, for a view registered outside ``vitlens.figures``, the function that draws its result (``draw``; the
built-in views' figures are registered beside the figure functions by result class, ``vitlens.figures.draws``: the
figures sit above the views, which import none).

Adding a view is its module and one ``register_view(View(...))`` (the built-in views are the entries below):
``analyze``, the survey (``vitlens.survey.stats.survey_views``) and ``vitlens.figures.figure_for`` read it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..kinds import Kind, all_kinds, kind_of, takes_clips, takes_images
from .class_attention import ClassAttentionDistanceAccumulator, ClassAttentionRolloutAccumulator
from .distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .filters import FilterPCAResult, embedding_filter_pca, max_filter_components
from .position import PositionSimilarityResult, neighbour_similarity, position_similarity
from .prefix import PrefixDiagnostics, PrefixDiagnosticsResult
from .relpos import RelativePositionBiasResult, offset_structure, relative_position_bias
from .rollout import RolloutAccumulator, RolloutResult
from .rollout_stats import RolloutStats
from .spacetime import SpaceTimeAccumulator, SpaceTimeDistanceResult, SpaceTimeRolloutResult
from .video_weights import (TubeletFilterPCAResult, VideoPositionSimilarityResult, video_filter_pca,
                            video_position_similarity, video_weights)
from .windowed import WindowedDistanceAccumulator
from .windowed_rollout import WindowedRolloutAccumulator

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
    #: how a ViT's rollout holds its per-block maps ("auto", "float32", "float16": ``vitlens.views.rollout_store``)
    rollout_precision: str = "auto"
    #: a video model's clips' frame rate (frames per second; None: unknown): the space-time distance in seconds too
    fps: float | None = None


def _filters(m: "LoadedModel", p: ViewParams) -> Any:
    return embedding_filter_pca(m, min(p.n_components, max_filter_components(m)))


def _position(m: "LoadedModel", p: ViewParams) -> Any:
    return position_similarity(m)


def _relpos(m: "LoadedModel", p: ViewParams) -> Any:
    return relative_position_bias(m)


def not_for_kind(m: "LoadedModel", name: str) -> str:
    """Why view ``name`` is not defined for ``m``'s kind ("" when it is): what ``analyze`` notes for it."""
    kind = kind_of(m)
    if kind.name in VIEWS[name].kinds:
        return ""
    reads = "a video model's clips" if VIEWS[name].for_kind is takes_clips else "images"
    return (f"The {name} view reads {reads}; {m.spec.name} is a {kind.label} model (its views: "
            f"{', '.join(available_views(m))}).")


def clips_only(m: "LoadedModel", name: str) -> None:
    """Refuse a model that reads images for a view of clips (``View.for_kind`` = ``takes_clips``), in one line."""
    if not kind_of(m).clips:
        raise ViewNotAvailableError(not_for_kind(m, name))


def _spacetime_distance(m: "LoadedModel", p: ViewParams) -> SpaceTimeAccumulator:
    # a clip's space-time distance: the engine feeds it from the video kind's batch source (the clips)
    clips_only(m, "spacetime_distance")
    return SpaceTimeAccumulator.for_model(m, "distance", renormalize=p.renormalize, fps=p.fps)


def _spacetime_rollout(m: "LoadedModel", p: ViewParams) -> SpaceTimeAccumulator:
    clips_only(m, "spacetime_rollout")
    if p.discard_ratio:
        raise InvalidParameterError(f"{m.spec.name} is a video model: its rollout through space-time takes "
                                    "head_fusion alone (discard_ratio=0).")
    return SpaceTimeAccumulator.for_model(m, "rollout", head_fusion=p.head_fusion)


def _video_position(m: "LoadedModel", p: ViewParams) -> Any:
    clips_only(m, "video_position")
    return video_position_similarity(m)


def _video_filters(m: "LoadedModel", p: ViewParams) -> Any:
    clips_only(m, "video_filters")
    d, c, tt, ph, pw = video_weights(m).filters.shape
    return video_filter_pca(m, min(p.n_components, d, c * tt * ph * pw))


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
    kind = kind_of(m)
    found = kind.reader_among(VIEWS[view].readers)
    if found is None:
        raise ViewNotAvailableError(f"The {view} view is not defined for {m.spec.name} ({kind.label}): no "
                                    "consumer of it reads its attention maps.")
    return found


def _distance(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    # a ViT's; windowed stages: in image pixels per block and stage; CaiT: the self-attention blocks
    return reader_for(m, "distance").for_model(m, p.renormalize)


def _rollout(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    # a ViT's; through the windows and the patch mergings to the first stage's grid; CaiT: from the class token
    # through the class-attention layers, then the rest
    reader = reader_for(m, "rollout")
    if reader is RolloutAccumulator:  # the maps over one sequence of tokens, T x T a block: held as asked
        return reader.for_model(m, p.head_fusion, p.discard_ratio, precision=p.rollout_precision)
    return reader.for_model(m, p.head_fusion, p.discard_ratio)


def _prefix(m: "LoadedModel", p: ViewParams) -> "AttentionConsumer":
    return PrefixDiagnostics(m)


def _distance_state(state: dict[str, Any]) -> Any:
    """A saved distance state as its accumulator: a hierarchical model's per block and stage (it holds the windows'
    uniform distances), another's per layer."""
    if "window_uniform_px" in state:
        return WindowedDistanceAccumulator.from_state(state)
    return AttentionDistanceAccumulator.from_state(state)


def _same(consumer: Any, num_classes: int) -> Any:
    return consumer


@dataclass(frozen=True)
class SurveyStat:
    """What a survey keeps of an attention view per (model, image shard): the view's own consumer, whose ``state()``
    (plain arrays) is saved per shard and whose ``merge`` combines two shards exactly, whose
    ``table_rows(spec, classes, renormalize)`` gives the survey table's rows (``metric``, ``value``, ``n``, and
    ``layer``, ``head``, ``stage``, ``cls`` where they apply).

    Attributes:
        describes: what its table rows mean (``vitlens survey --views``' help).
        from_state: a saved ``state()`` -> an object that merges and gives its ``state`` and ``table_rows``.
        keep: (the view's consumer for the model, the image set's number of classes) -> what the survey feeds (by
            default the consumer itself; the distance view's keeps its moments per class too, the rollout view's
            statistics of each image's row instead of the maps).
    """

    describes: str
    from_state: Callable[[dict[str, Any]], Any]
    keep: Callable[[Any, int], Any] = _same


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
            without a page written for it gets a generic one, its figure and its numbers); ``CLIP_PAGES`` for a
            view of a video model's clip, shown among the clip's pages (``vitlens_app``'s video pages).
        summary: for a weight-only view, result -> the few numbers a survey's table keeps of it
            (its "weights" rows, once per model).
        readers: an attention view's consumer classes, the one for a ViT's maps first, then one per kind of maps
            it also reads (flagged with that kind's ``Kind.reader``: ``reads_windows``, ``reads_class_attention``);
            ``build`` makes the one that reads the model's maps (``reader_for``). Empty: ``build``'s consumer reads
            a ViT's maps only.
        survey: for an attention view, what a survey keeps of it per image shard (None: nothing).
        draw: result -> its plotly figure, for a view registered outside ``vitlens.figures`` (None: the figure
            registered there for its result class, ``figures.draws``).
        for_kind: which kinds of model it is defined for, as a test of the kind's record (``vitlens.kinds``:
            ``takes_clips`` for the views of a video model's clips); None: as below.
        answers: the names of other views it stands for on the kinds it is defined for (``resolve_view``): a video
            model's "distance" is its space-time distance, so ``analyze(m, clips, views=("distance",))`` computes it.

    ``kinds`` (the ``ModelSpec.kind`` values the view is defined for: ``available_views``) follows: the kinds
    ``for_kind`` passes when it is given; else every registered kind that reads images for a weight-only view, the
    kinds one of its ``readers`` reads for an attention view (a hierarchical model's windows have no prefix tokens,
    and a CaiT's self-attention blocks none either).
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
    survey: SurveyStat | None = None
    draw: Callable[[Any], Any] | None = None
    for_kind: Callable[[Kind], bool] | None = None
    answers: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """The registered kinds the view is defined for (see the class docstring)."""
        if self.for_kind is not None:
            return tuple(k.name for k in all_kinds() if self.for_kind(k))
        if self.kind == "weights":
            return tuple(k.name for k in all_kinds() if takes_images(k))
        return tuple(k.name for k in all_kinds()
                     if (k.reader_among(self.readers) is not None if self.readers else k.token_attention))

    @property
    def heading(self) -> str:
        """The title with its figure, e.g. "Mean attention distance (Fig. 7 right)"."""
        return f"{self.title} ({self.paper})" if self.paper else self.title

    def result_class(self) -> type:
        """The class of the result it gives (``result_type``)."""
        return self.result_type


#: ``View.shown_in`` of the views of a video model's clip: the app shows them among the clip's pages
CLIP_PAGES = "the clip's pages"

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
         AttentionDistanceResult, label="Attention distance", survey=SurveyStat(
             "attention distance per head (Fig. 7 right, Fig. 11), over all images and per class", _distance_state,
             lambda acc, num_classes: acc.per_class(num_classes)),
         readers=(AttentionDistanceAccumulator, WindowedDistanceAccumulator, ClassAttentionDistanceAccumulator)),
    View("rollout", "Attention rollout", "Fig. 6", "attention", _rollout,
         RolloutResult, label="Attention rollout", shown_in="Attention maps", survey=SurveyStat(
             "the rollout row's prefix mass, patch entropy and mass in the object mask (Fig. 6)",
             RolloutStats.from_state, lambda acc, num_classes: RolloutStats(acc)),
         readers=(RolloutAccumulator, WindowedRolloutAccumulator, ClassAttentionRolloutAccumulator)),
    View("prefix", "Prefix tokens: attention parked and token norms", "", "attention", _prefix,
         PrefixDiagnosticsResult, default=False,
         label="Prefix tokens", shown_in="Attention distance", readers=(PrefixDiagnostics,)),
    # a video model's views (docs/definitions.md, "Video: space and time", "Video: weights"): of its clips and its
    # weights, defined for the kinds that read clips; analyze computes the two of the clips from one forward
    View("video_filters", "Tubelet filters by time step", "Fig. 7 left, per time step", "weights", _video_filters,
         TubeletFilterPCAResult, default=False, label="Tubelet filters", shown_in=CLIP_PAGES, for_kind=takes_clips),
    View("video_position", "Position embedding similarity over space and time", "Fig. 7 centre, in space and time",
         "weights", _video_position, VideoPositionSimilarityResult, default=False,
         label="Position embeddings (space and time)", shown_in=CLIP_PAGES, for_kind=takes_clips),
    View("spacetime_distance", "Mean attention distance in space and time", "Fig. 7 right, in space and time",
         "attention", _spacetime_distance, SpaceTimeDistanceResult, default=False, label="Space-time distance",
         shown_in=CLIP_PAGES, readers=(SpaceTimeAccumulator,), for_kind=takes_clips, answers=("distance",)),
    View("spacetime_rollout", "Attention rollout through space-time", "Fig. 6, a map per time step", "attention",
         _spacetime_rollout, SpaceTimeRolloutResult, default=False, label="Rollout through time", shown_in=CLIP_PAGES,
         readers=(SpaceTimeAccumulator,), for_kind=takes_clips, answers=("rollout",)),
)}


#: the views vitlens itself defines, as they are at import: what ``registered_views`` leaves out
BUILTIN_VIEWS: dict[str, View] = dict(VIEWS)


def registered_views() -> tuple[View, ...]:
    """The views registered in this process beyond (or in place of) vitlens's own (``BUILTIN_VIEWS``): what a
    survey sends its Ray workers, which import vitlens afresh and would not know them (issue 62, item 14)."""
    return tuple(v for name, v in VIEWS.items() if BUILTIN_VIEWS.get(name) is not v)


def register_view(view: View, replace: bool = False) -> View:
    """Add ``view`` to ``VIEWS``: ``analyze(views=...)`` computes it, ``figures.figure_for`` draws its result (by
    ``View.draw``, or the drawer registered for its result class), a survey keeps its ``View.survey`` state (an
    attention view) or its ``View.summary`` (a weight view), the app lists it.

    Args:
        view: the view.
        replace: replace a view of the same name (otherwise that is an error).

    Returns:
        The view.

    Raises:
        InvalidParameterError: a name already taken, a name the analysis result holds something else under
            (``reserved_names``), or a kind other than "weights" and "attention".
    """
    if view.kind not in ("weights", "attention"):
        raise InvalidParameterError(f"A view is computed from the \"weights\" or from the \"attention\"; "
                                    f"{view.name!r} says {view.kind!r}.")
    if not isinstance(view.name, str) or not view.name.isidentifier() or view.name.startswith("_") \
            or view.name in reserved_names():
        raise InvalidParameterError(f"A view's name must be an identifier that the analysis result does not hold "
                                    f"something else under ({', '.join(sorted(reserved_names()))}); got "
                                    f"{view.name!r}: pick another name.")
    if view.name in VIEWS and not replace:
        raise InvalidParameterError(f"A view named {view.name!r} is registered already; pick another name, or pass "
                                    "replace=True.")
    VIEWS[view.name] = view
    return view


#: what an ``AnalysisResult`` holds besides the views' results (``reserve_names``): ``vitlens.views.analyze`` adds them
#: where it defines that class (it imports this registry, which therefore does not import it)
_RESERVED: set[str] = set()


def reserve_names(names: Any) -> None:
    """Names no view may take from now on (``register_view``): what a result that holds the views holds else."""
    _RESERVED.update(str(n) for n in names)


def reserved_names() -> frozenset[str]:
    """The names no view may take: what an ``AnalysisResult`` holds besides the views' results (its other fields,
    methods and properties, e.g. ``notes``, ``spec``, ``views``, ``others``); a built-in view's own field
    (``distance``, ``rollout``, ...) holds that view's result and stays its name."""
    return frozenset(_RESERVED - set(VIEWS))


def view_names() -> tuple[str, ...]:
    """The view names ``analyze`` takes (every registered view), read when called.

    Returns:
        The names, in registration order.
    """
    return tuple(VIEWS)


def default_views() -> tuple[str, ...]:
    """The views ``analyze`` computes by default (the paper's four, and any registered as a default), read when called.

    Returns:
        Their names, in registration order.
    """
    return tuple(name for name, v in VIEWS.items() if v.default)


def __getattr__(name: str) -> tuple[str, ...]:
    """``VIEW_NAMES`` and ``DEFAULT_VIEWS``, read from the registry when asked (a view registered later is in them);
    code of the library calls ``view_names()`` and ``default_views()``."""
    if name == "VIEW_NAMES":
        return view_names()
    if name == "DEFAULT_VIEWS":
        return default_views()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_view(m: "LoadedModel | Any", name: str) -> str:
    """The registered view that answers ``name`` for ``m``'s kind: ``name`` itself where it is defined for the kind,
    else a view defined for the kind that stands for it (``View.answers``: a video model's "distance" is
    "spacetime_distance"), else ``name`` (whose refusal or note then says why)."""
    kind = kind_of(m).name
    if kind in VIEWS[name].kinds:
        return name
    return next((v.name for v in VIEWS.values() if name in v.answers and kind in v.kinds), name)


def other_inputs(m: "LoadedModel | Any", name: str) -> str:
    """Why view ``name`` reads another kind of input than ``m`` takes, images or a video model's clips ("" when it
    reads ``m``'s): ``analyze`` notes such a view and computes the rest (a view of the same inputs that ``m``'s maps
    do not fit is refused by its consumer instead)."""
    reads_clips = VIEWS[name].for_kind is takes_clips
    return not_for_kind(m, name) if reads_clips != kind_of(m).clips else ""


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
    return tuple(n for n in (view_names() if names is None else names) if kind in VIEWS[n].kinds)


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


__all__ = ["BUILTIN_VIEWS", "CLIP_PAGES", "VIEWS", "SurveyStat", "View", "ViewParams", "available_views",
           "check_views", "clips_only", "default_views", "not_for_kind", "other_inputs", "reader_for", "register_view",
           "registered_views", "reserve_names", "reserved_names", "resolve_view", "view_names"]
