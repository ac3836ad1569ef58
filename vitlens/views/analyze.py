"""The views as one call each, and all four from one pass: attention distance (Fig. 7 right,
Fig. 11) and rollout (Fig. 6) share one forward per batch; ``analyze`` adds the two weight-only
views (Fig. 7 left and centre).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..images import Images
from ..kinds import kind_of
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..progress import ProgressArg
from ..results import Result
from .distance import AttentionDistanceResult
from ..engine.stream import stream_attention
from .filters import FilterPCAResult
from .position import PositionSimilarityResult
from .prefix import PrefixDiagnosticsResult
from .registry import VIEWS, ViewParams, check_views, default_views, other_inputs, reserve_names, resolve_view
from .rollout import RolloutAccumulator, RolloutResult
from ..engine.sources import check_fps
from .spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult
from .rollout_store import check_precision
from .windowed import WindowedDistanceResult
from ..words import counted


def attention_distance(
    m: LoadedModel,
    images: Images,
    batch_size: int = 32,
    renormalize: bool = True,
    progress: ProgressArg = None,
    memory_budget_mb: float | None = None,
    fps: float | None = None,
) -> AttentionDistanceResult | WindowedDistanceResult | SpaceTimeDistanceResult:
    """Mean attention distance of every head, averaged over images (paper Fig. 7 right, Fig. 11).

    For a hierarchical model (Swin: ``spec.kind == "hierarchical"``) the distance is in image pixels per block
    and stage, beside the distance uniform attention over each query's window gives (``WindowedDistanceResult``,
    ``vitlens.views.windowed``). For a CaiT (``spec.kind == "class-attention"``) it is the distance of the
    self-attention blocks (``ClassAttentionDistanceResult``, ``vitlens.views.class_attention``): the class-attention
    layers' one query, the class token, has no position in the image, and the result's ``note`` says so.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        batch_size: images per forward.
        renormalize: renormalise each query's weights over patch keys (the default choice);
            False keeps the raw weights (the keras example's convention).
        progress: True for a progress bar, or a callable ``f(done, total)``.
        memory_budget_mb: megabytes of attention probabilities allowed at once; above it the
            probabilities are computed a block of query rows at a time (``capture_plan``; None:
            one block's MLP activation, so whole maps up to 256 tokens for 64-dim heads).
        fps: a video model's clips' frame rate (frames per second): the temporal distance in seconds too.

    A video model (``spec.kind == "space-time"``: VideoMAE, ViViT, V-JEPA 2, TimeSformer) takes preprocessed clips
    [B, frames, 3, H, W] and gives a ``SpaceTimeDistanceResult`` (``vitlens.views.spacetime``): each map's spatial
    distance in pixels (across and within time steps) and temporal distance in frames, beside their baselines.

    One pass over the images for this view alone; for several views of the same images, ask
    ``analyze(m, images, views=(...))``, which computes them all from one forward per batch.

    Returns:
        An ``AttentionDistanceResult``: ``mean_px`` and ``std_px`` [layers, heads] in pixels of the input,
            over ``n_images`` images.
    """
    params = ViewParams(renormalize=renormalize, fps=_fps_of(m, fps))
    # the distance view's consumer for the kind: windowed for a hierarchical model, space-time for a video model
    acc = VIEWS[resolve_view(m, "distance")].build(m, params)
    return _stream_one(m, images, batch_size, progress, "attention distance", acc, memory_budget_mb)


def attention_rollout(
    m: LoadedModel,
    images: Images,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    batch_size: int = 32,
    progress: ProgressArg = None,
    source: str | None = None,
    memory_budget_mb: float | None = None,
    precision: str = "auto",
) -> RolloutResult | SpaceTimeRolloutResult:
    """Attention rollout maps (paper Fig. 6, Fig. 14) with the model's predictions.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        head_fusion: "mean" (default), "max" or "min" over heads.
        discard_ratio: fraction of the smallest fused weights zeroed per image and block.
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.
        source: the row rolled out: None (the class token, or without one the mean over the patch tokens) or
            "pool": a MAP head's own attention (its probe queries over the tokens, heads fused as the blocks,
            queries averaged) as the class-like row, for models that pool through one (SigLIP, timm MAP heads);
            ``RolloutResult.source_token`` says which row was used.
        memory_budget_mb: as for ``attention_distance`` (the capture's blocks; rollout itself keeps
            every block's head-fused map of the batch, L x B x T x T float32: see ``RolloutAccumulator``).
        precision: how those maps are held: "auto" (the default: float16 scaled by 2^15 where one image's float32
            maps exceed ``rollout_store.HALF_ABOVE_MB``, float32 below, bit-identical), "float32" or "float16";
            the row is then within the bound docs/definitions.md states, and ``RolloutResult.map_storage`` says
            which was used. A ViT's rollout (one sequence of tokens); the windowed and class-attention rollouts hold
            float32.

    Raises:
        ViewNotAvailableError: ``source="pool"`` for a model without an attention pool.

    One pass over the images for this view alone; ``analyze(m, images, views=("distance",
    "rollout"))`` gives both views from one forward per batch.

    A video model takes preprocessed clips [B, frames, 3, H, W] and gives a ``SpaceTimeRolloutResult``: ``maps``
    [B, T', gh, gw], a map per time step (docs/definitions.md, "Video: space and time").

    Returns:
        A ``RolloutResult``: ``maps`` [B, gh, gw] (each image's rolled-out row over the patch tokens,
            summing to at most 1) with the model's predictions.
    """
    check_precision(precision)
    kind = kind_of(m)
    if kind.pool_refusal and source is not None:  # a CaiT's class token is read through its class-attention layers
        raise ViewNotAvailableError(kind.pool_refusal.format(name=m.spec.name))
    if source is None:  # the rollout view's consumer for the kind: windowed, CaiT's two kinds of block, a video
        # model's through space-time (a map per time step), a ViT's
        acc = VIEWS[resolve_view(m, "rollout")].build(m, ViewParams(head_fusion=head_fusion,
                                                                    discard_ratio=discard_ratio,
                                                                    rollout_precision=precision))
    else:
        acc = RolloutAccumulator.for_model(m, head_fusion, discard_ratio, source, precision)  # its hooks read the pool
    return _stream_one(m, images, batch_size, progress, "rollout", acc, memory_budget_mb)


def _fps_of(m: LoadedModel, fps: float | None) -> float | None:
    """``fps`` checked (a positive frame rate, or None), and refused in one line for a model whose kind reads images."""
    if fps is not None and not kind_of(m).clips:
        raise InvalidParameterError(f"fps is a video model's frame rate; {m.spec.name} reads images.")
    return check_fps(fps)


def _stream_one(m: LoadedModel, images: Images, batch_size: int, progress: ProgressArg, desc: str, acc: Any,
                memory_budget_mb: float | None = None) -> Any:
    """One consumer's result over ``images`` (nothing is kept between calls)."""
    stream_attention(m, images, [acc], batch_size, progress, desc=desc, capture_mode=None,
                     memory_budget_mb=memory_budget_mb)
    return acc.result(m.spec)


@dataclass(eq=False, repr=False)
class AnalysisResult(Result):
    """The views of one model over one image set (by default the paper's four).

    Attributes:
        spec: the model's spec.
        filters: embedding-filter PCA (Fig. 7 left).
        position: position-embedding similarity (Fig. 7 centre), or None (see ``position_note``).
        distance: attention distance (Fig. 7 right).
        rollout: rollout maps of every image (Fig. 6).
        position_note: why ``position`` is None, if it is (``notes["position"]``, kept by that name).
        prefix: attention parked on prefix tokens and token norms, when asked for.
        views: the views computed (the others are None).
        notes: why each weight view that was asked for and is not available is None, by view name
            (every one, e.g. a position table a family does not have or filters it cannot read).
    """

    kind = "analysis"
    spec: ModelSpec
    filters: FilterPCAResult | None
    position: PositionSimilarityResult | None
    distance: AttentionDistanceResult | None
    rollout: RolloutResult | None
    position_note: str = ""
    prefix: PrefixDiagnosticsResult | None = None
    views: tuple = field(default_factory=default_views)
    #: results of registered views without a field of their own, by name (``view(name)`` reads both)
    others: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def view(self, name: str) -> Any:
        """The result of view ``name`` (None when it was not asked for or is not available)."""
        if name in self.others:
            return self.others[name]
        if name not in VIEWS:
            raise InvalidParameterError(f"No view {name!r}; the views are {', '.join(VIEWS)}.")
        return getattr(self, name, None)

    def summary(self) -> str:
        n = getattr(self.distance, "n_images", getattr(self.distance, "n_clips", 0)) if self.distance is not None \
            else (len(self.rollout.maps) if self.rollout is not None else 0)
        what = "clip" if isinstance(self.distance or self.rollout, (SpaceTimeDistanceResult, SpaceTimeRolloutResult)) \
            else "image"
        return f"{self.spec.name}: {', '.join(self.views)} over {counted(n, what)}"

    def to_rows(self) -> list[dict[str, Any]]:
        """The attention-distance rows (the view with a number per head)."""
        if self.distance is None:
            raise InvalidParameterError("This analysis has no attention distance; ask for views=(..., 'distance').")
        return self.distance.to_rows()


# a view registered as "notes", "spec" or "save" would be dropped or shadow what the result holds under that name
reserve_names(set(AnalysisResult.__dataclass_fields__) | {n for n in dir(AnalysisResult) if not n.startswith("_")})


def analyze(
    m: LoadedModel,
    images: Images,
    batch_size: int = 32,
    n_components: int = 28,
    renormalize: bool = True,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    progress: ProgressArg = None,
    views: Sequence[str] | None = None,
    memory_budget_mb: float | None = None,
    fps: float | None = None,
    rollout_precision: str = "auto",
) -> AnalysisResult:
    """Several views at once; every attention view comes from ONE forward per batch.

    This is the fast path when more than one view of the same images is wanted: calling
    ``attention_distance`` and then ``attention_rollout`` runs the images twice, while
    ``analyze(m, x, views=("distance", "rollout"))`` runs them once.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        batch_size: images per forward.
        n_components: filter-PCA components, capped at the number the model's filters allow.
        renormalize: as for ``attention_distance``.
        head_fusion: as for ``attention_rollout``.
        discard_ratio: as for ``attention_rollout``.
        progress: True for a progress bar, or a callable ``f(done, total)``.
        views: any of ``VIEWS`` ("filters", "position", "relpos", "distance", "rollout", "prefix"; the registry of
            ``vitlens.views.registry`` lists them); None: the registry's default views when called (the paper's four,
            and any registered with ``default=True``).
        memory_budget_mb: megabytes of attention probabilities allowed at once (``capture_plan``: whole
            maps within it, query-chunked side capture above; None: one block's MLP activation).
        rollout_precision: how rollout holds its per-block maps, as ``attention_rollout``'s ``precision`` ("auto":
            float16 only where they are large).
        fps: a video model's clips' frame rate (``attention_distance``).

    A video model takes preprocessed clips [B, frames, 3, H, W] (the engine's batch source of its kind): "distance"
    and "rollout" are its space-time views from one forward per batch (``SpaceTimeDistanceResult``,
    ``SpaceTimeRolloutResult``: the registry's views that answer those names for its kind, ``resolve_view``); a view
    of images asked of it is None, with a note saying why (and a view of clips asked of an image model likewise).

    Returns:
        An ``AnalysisResult`` with the views asked for (the others None): ``filters`` (Fig. 7 left),
            ``position`` (Fig. 7 centre; None with ``position_note`` saying why for a model without a learned
            E_pos), ``distance`` (Fig. 7 right) and ``rollout`` (Fig. 6), ``prefix`` when asked for; ``view("relpos")``
            the learned relative-position bias by offset when asked for (None, with ``notes["relpos"]`` saying why, for
            a model without one).

    Raises:
        InvalidParameterError: an unknown view name or a bad parameter.
    """
    views = check_views(default_views() if views is None else views)
    if n_components < 1:
        raise InvalidParameterError(f"n_components must be >= 1; got {n_components}.")
    params = ViewParams(n_components=n_components, renormalize=renormalize, head_fusion=head_fusion,
                        discard_ratio=discard_ratio, rollout_precision=check_precision(rollout_precision),
                        fps=_fps_of(m, fps))
    chosen = {name: resolve_view(m, name) for name in views}  # the view of the model's kind that answers each name
    # a view of another kind's inputs (a video model's clips, or images for a video model): None, with a note
    notes = {name: why for name, why in ((name, other_inputs(m, view)) for name, view in chosen.items()) if why}
    wanted = dict.fromkeys(view for name, view in chosen.items() if name not in notes)  # each view computed once
    consumers = {view: VIEWS[view].build(m, params) for view in wanted if VIEWS[view].kind == "attention"}
    if consumers:
        stream_attention(m, images, list(consumers.values()), batch_size, progress, desc="analyze", capture_mode=None,
                         memory_budget_mb=memory_budget_mb)
    made: dict[str, Any] = {view: c.result(m.spec) for view, c in consumers.items()}
    for view in wanted:
        if VIEWS[view].kind == "weights":
            try:
                made[view] = VIEWS[view].build(m, params)
            except ViewNotAvailableError as e:
                notes.update({name: str(e) for name in views if chosen[name] == view})
    results = {name: made[chosen[name]] for name in views if chosen[name] in made}
    named = {f.name for f in fields(AnalysisResult)}
    return AnalysisResult(spec=m.spec, filters=results.get("filters"), position=results.get("position"),
                          distance=results.get("distance"), rollout=results.get("rollout"),
                          position_note=notes.get("position", ""), prefix=results.get("prefix"), views=views,
                          others={k: v for k, v in results.items() if k not in named}, notes=notes)


__all__ = ["AnalysisResult", "VIEWS", "analyze", "attention_distance", "attention_rollout"]
