"""Plotly figures: pure functions of the result objects.

- ``filters_figure``: paper Fig. 7 left, a grid of RGB filter components.
- ``position_figure``: Fig. 7 centre / Fig. 10, a grid of similarity tiles.
- ``relpos_figure``: its analogue for relative-position models, each head's learned bias by query-to-key offset.
- ``distance_figure``: Fig. 7 right / Fig. 11, mean distance of each head by layer.
- ``rollout_figure``: Fig. 6 / Fig. 14, rollout over the image.
- ``heads_figure``: one query's attention in every head of a layer.
- ``attribution_figure`` / ``faithfulness_figure``: maps of several methods and their curves.
- ``perturbation_figure`` / ``sanity_figure``: Chefer et al.'s and ROAD's perturbation curves; Adebayo et al.'s
  cascading randomisation (Fig. 2).
- ``metric_figure``: any perturbation metric of ``METRIC_TABLE``, drawn from its entry's ``curves``.

Every heatmap puts image row 0 (patch row 0) at the top, as the image itself is shown. A token map over an image
is drawn as tokens (one flat cell per token, ``token_heatmap``) on a perceptually uniform scale from 0 to the
data's maximum (``colour_range``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .core.resample import upsample_map  # noqa: F401  re-exported where it was; the figures draw tokens as tokens
from .errors import InvalidParameterError
from .results import significant
from .views.distance import AttentionDistanceResult, uniform_distance
from .views.filters import FilterPCAResult
from .views.position import PositionSimilarityResult
from .views.prefix import PrefixDiagnosticsResult
from .views.relpos import RelativePositionBiasResult
from .views.rollout import RolloutResult
from .views.windowed import WindowedDistanceResult
from .words import counted

if TYPE_CHECKING:  # figures take typed results; these modules import figures lazily, so no cycle at run time
    from .attribution.faithfulness import FaithfulnessResult
    from .attribution.methods import AttributionResult
    from .attribution.metrics import Metric
    from .attribution.perturbation import PerturbationResult, RoadResult
    from .attribution.sanity import SanityResult
    from .compare.cka import CKAResult
    from .compare.heads import HeadImportanceResult

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def model_colours(names: Sequence[str], weights: Sequence[str] | None = None) -> list[str]:
    """The colour of each model of one analysis, the same in every figure of it whatever order the models come in
    (the app's Compare with the hybrid picked first, the survey's sorted table, compare.html): the models are put in
    a stable order, the named presets first in the registry's order (``vitlens.loading.presets.PRESETS``: ref-vit,
    then ref-hybrid), then the others by name (then weights, then their place when the same name comes twice), and
    take ``PALETTE`` in that order: the embedded ViT blue and its hybrid red, wherever they are drawn together.

    Args:
        names: the models' names (a ``ModelSpec.name`` or the name they were loaded by).
        weights: each model's weights ("pretrained", "random init", ...), to tell one model's two runs apart.

    Returns:
        [len(names)] CSS colours, in the order of ``names``.
    """
    from .loading.presets import PRESETS

    rank = {p.name: i for i, p in enumerate(PRESETS)}
    extra = list(weights) if weights is not None else [""] * len(names)
    order = sorted(range(len(names)), key=lambda i: (rank.get(names[i], len(rank)), names[i], extra[i], i))
    colours = [""] * len(names)
    for place, i in enumerate(order):
        colours[i] = PALETTE[place % len(PALETTE)]
    return colours


#: one colour per attribution method, indexed by the method's place in the registry
#: (``vitlens.attribution.methods.METHODS``): every method of the registry has its own colour, the same one in
#: every figure. A qualitative palette of distinct hues (Tableau 10, then darker Tableau 20b/c hues), placed so the
#: methods the app preselects and AttnLRP sit at least 60 degrees of hue apart: rollout blue, gradient rollout
#: orange, saliency purple, AttnLRP (place 14) green (gradient rollout pink beside saliency red read alike); none
#: is a placeholder Streamlit's chart theme swaps (#0000xx)
METHOD_PALETTE = ("#1F77B4", "#FF7F0E", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#BCBD22", "#17BECF",
                  "#7F7F7F", "#393B79", "#637939", "#8C6D31", "#843C39", "#7B4173", "#2CA02C", "#6B6ECF",
                  "#E7BA52", "#9C9EDE", "#CEDB9C", "#E7969C", "#DE9ED6", "#AD494A", "#31A354", "#3182BD")


def method_colour(method: str, position: int = 0) -> str:
    """The colour of one attribution method in every figure (``METHOD_PALETTE``, by its place in the registry;
    a name the registry does not hold takes its ``position`` in the figure).

    Args:
        method: a name in ``vitlens.attribution.METHOD_TABLE`` (or any other name).
        position: the method's place in the figure, used only for a name the registry does not hold.

    Returns:
        A CSS colour string from ``METHOD_PALETTE``.
    """
    from .attribution.methods import METHOD_TABLE

    names = list(METHOD_TABLE)  # read at call time: a method registered later has its own place
    index = names.index(method) if method in names else position
    return METHOD_PALETTE[index % len(METHOD_PALETTE)]


def method_label(method: str) -> str:
    """A method's name as legends and panel titles show it (``vitlens.attribution.methods.method_label``).

    Args:
        method: the method's identifier in ``METHOD_TABLE`` (e.g. ``grad_rollout``).

    Returns:
        Its entry's label, e.g. "gradient rollout".
    """
    from .attribution.methods import method_label as label

    return label(method)


def component_rgb(component: np.ndarray) -> np.ndarray:
    """[C, kh, kw] component -> uint8 [kh, kw, 3], min-max scaled per component (gray if C != 3).

    Args:
        component: [C, kh, kw] one principal component of the filters.

    Returns:
        uint8 [kh, kw, 3] pixels.
    """
    c = component.astype(np.float64)
    span = c.max() - c.min()
    c = (c - c.min()) / span if span > 0 else np.zeros_like(c)
    img = np.moveaxis(c, 0, -1)
    if img.shape[-1] != 3:
        img = np.repeat(img.mean(-1, keepdims=True), 3, axis=-1)
    return np.round(img * 255).astype(np.uint8)


@dataclass(frozen=True)
class Drawer:
    """How a view's result is drawn (``draws``).

    Attributes:
        fn: the figure function, ``fn(result)`` or ``fn(result, images)``.
        images: whether it takes the images as the model sees them (the rollout's overlays).
        when: result -> whether there is anything to draw (None: always).
    """

    fn: Callable[..., go.Figure]
    images: bool = False
    when: Callable[[Any], bool] | None = None


#: the figure function of each view's result class, registered where the function is written (``draws``): the
#: one place the report and the app find how to draw a view's result (``figure_for``), so no view names a figure
DRAWERS: dict[type, Drawer] = {}


def draws(*result_types: type, images: bool = False, when: Callable[[Any], bool] | None = None) -> Callable:
    """Register the decorated figure function as the one that draws results of ``result_types`` (``figure_for``).

    Args:
        *result_types: the result classes it draws.
        images: it takes the images as the model sees them as its second argument.
        when: result -> whether the result has anything to draw (None: always).

    Returns:
        The decorator (the function is returned unchanged).
    """
    def register(fn: Callable[..., go.Figure]) -> Callable[..., go.Figure]:
        for t in result_types:
            DRAWERS[t] = Drawer(fn, images, when)
        return fn
    return register


def figure_for(result: Any, images: Sequence[np.ndarray] | None = None) -> go.Figure | None:
    """The figure of a view's result, by its class (``DRAWERS``); None when it has nothing to draw (the prefix
    diagnostics of a model without prefix tokens).

    Args:
        result: a view's result (``AnalysisResult.view(name)``).
        images: uint8 [H, W, 3] images as the model sees them, for a figure that overlays them (rollout).

    Returns:
        A plotly ``Figure``, or None.

    Raises:
        InvalidParameterError: no figure is registered for the result's class, or it needs images and got none.
    """
    drawer = next((DRAWERS[t] for t in type(result).__mro__ if t in DRAWERS), None)
    if drawer is None:
        raise InvalidParameterError(f"No figure draws a {type(result).__name__}; register one with "
                                    "vitlens.figures.draws.")
    if drawer.when is not None and not drawer.when(result):
        return None
    if drawer.images:
        if images is None:
            raise InvalidParameterError(f"{drawer.fn.__name__} overlays the images: pass them as the model sees them.")
        return drawer.fn(result, images)
    return drawer.fn(result)


@draws(FilterPCAResult)
def filters_figure(result: FilterPCAResult, columns: int = 7, title: str | None = None) -> go.Figure:
    """Grid of the top principal components as small RGB images, with explained variance.

    Args:
        result: the filter PCA (``embedding_filter_pca``).
        columns: tiles per row.
        title: the figure's title (default: the model and how much variance the components explain).

    Returns:
        A plotly ``Figure``.
    """
    k = len(result.components)
    cols = min(columns, k)
    rows = math.ceil(k / cols)
    fig = make_subplots(rows=rows, cols=cols, horizontal_spacing=0.01, vertical_spacing=0.06,
                        subplot_titles=[f"PC{i + 1} {100 * v:.1f}%" for i, v in enumerate(result.explained_variance_ratio)])
    for i, comp in enumerate(result.components):
        fig.add_trace(go.Image(z=component_rgb(comp), hovertemplate=f"PC{i + 1}<extra></extra>"),
                      row=i // cols + 1, col=i % cols + 1)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_annotations(font_size=10)
    total = 100 * float(np.sum(result.explained_variance_ratio))
    fig.update_layout(
        title=title or f"Embedding filters, top {k} principal components ({total:.1f}% of variance)"
                       f"<br><sup>{result.source}</sup>",
        height=max(260, 110 * rows + 90), margin=dict(l=10, r=10, t=90, b=10),
    )
    return fig


def position_mosaic(result: PositionSimilarityResult) -> tuple[np.ndarray, np.ndarray]:
    """The tile grid as one array with a NaN gap between tiles, and [4] patch coords per cell.

    Args:
        result: the position similarity (``position_similarity``).

    Returns:
        ``(mosaic, coords)``: mosaic [gh*(gh+1) - 1, gw*(gw+1) - 1] of cosine similarities in [-1, 1],
            NaN in the one-cell gaps between tiles; coords [same, 4] int64 (tile row, tile column, patch row,
            patch column) per cell, -1 in the gaps.
    """
    gh, gw = result.grid
    h, w = gh * (gh + 1) - 1, gw * (gw + 1) - 1
    mosaic = np.full((h, w), np.nan)
    coords = np.full((h, w, 4), -1, dtype=np.int64)
    rr, cc = np.mgrid[0:gh, 0:gw]
    for r in range(gh):
        for c in range(gw):
            y, x = r * (gh + 1), c * (gw + 1)
            mosaic[y:y + gh, x:x + gw] = result.similarity[r, c]
            coords[y:y + gh, x:x + gw] = np.stack([np.full_like(rr, r), np.full_like(cc, c), rr, cc], -1)
    return mosaic, coords


@draws(PositionSimilarityResult)
def position_figure(result: PositionSimilarityResult, title: str | None = None) -> go.Figure:
    """Fig. 7 centre: tile (r, c) shows the cosine similarity of patch (r, c) to every patch; the axes name the
    input patch's row and column (0-based, as the app's patch boxes) at the tiles' centres.

    Args:
        result: the position similarity (``position_similarity``).
        title: the figure's title (default: the model's name and grid).

    Returns:
        A plotly ``Figure``.
    """
    mosaic, coords = position_mosaic(result)
    gh, gw = result.grid
    fig = go.Figure(go.Heatmap(
        z=mosaic, customdata=coords, colorscale="Viridis", zmin=-1, zmax=1,
        colorbar=dict(title="cosine"),
        hovertemplate="patch (%{customdata[0]}, %{customdata[1]}) vs (%{customdata[2]}, %{customdata[3]})"
                      "<br>cosine %{z:.3f}<extra></extra>",
    ))
    # the outer axes say whose tile it is: a tick at each (or every few) tile's centre, the input patch's row / column
    cols, rows = range(0, gw, max(1, gw // 8)), range(0, gh, max(1, gh // 8))
    fig.update_xaxes(range=[-0.5, mosaic.shape[1] - 0.5], constrain="domain", showgrid=False, zeroline=False,
                     title="input patch column (tile)", tickvals=[c * (gw + 1) + (gw - 1) / 2 for c in cols],
                     ticktext=[str(c) for c in cols])
    fig.update_yaxes(range=[mosaic.shape[0] - 0.5, -0.5], scaleanchor="x", constrain="domain", showgrid=False,
                     zeroline=False, title="input patch row (tile)", tickvals=[r * (gh + 1) + (gh - 1) / 2 for r in rows],
                     ticktext=[str(r) for r in rows])
    note = f", E_pos resampled from {result.model_grid[0]}x{result.model_grid[1]}" if result.resized else ""
    fig.update_layout(title=title or f"Position embedding similarity, {gh}x{gw} patches{note}",
                      height=560, margin=dict(l=10, r=10, t=60, b=10))
    return fig


def similarity_tile_figure(result: PositionSimilarityResult, row: int, col: int) -> go.Figure:
    """One tile large: cosine similarity of patch (row, col) to every patch, row 0 at the top.

    Args:
        result: the position similarity.
        row: the patch's row (0-based).
        col: the patch's column (0-based).

    Returns:
        A plotly ``Figure``.
    """
    gh, gw = result.grid
    fig = go.Figure(go.Heatmap(z=result.similarity[row, col], x=list(range(gw)), y=list(range(gh)),
                               colorscale="Viridis", zmin=-1, zmax=1, colorbar=dict(title="cosine"),
                               hovertemplate="patch (%{y}, %{x})<br>cosine %{z:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[col], y=[row], mode="markers", marker=dict(symbol="x", size=10, color="white"),
                             hoverinfo="skip", showlegend=False))
    fig.update_xaxes(title="patch column", range=[-0.5, gw - 0.5], constrain="domain", dtick=max(1, gw // 8))
    fig.update_yaxes(title="patch row", range=[gh - 0.5, -0.5], scaleanchor="x", constrain="domain",
                     dtick=max(1, gh // 8))
    fig.update_layout(title=f"Similarity of patch ({row}, {col}) to all patches", height=420,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


@draws(RelativePositionBiasResult)
def relpos_figure(result: RelativePositionBiasResult, layer: int | None = None, columns: int = 6,
                  title: str | None = None) -> go.Figure:
    """The analogue of Fig. 7 centre for relative-position models: each head's learned bias as a heatmap over the
    offset from the query patch to the key patch (dx across, dy down, the query at the centre, marked x).

    Args:
        result: the relative-position bias (``relative_position_bias``).
        layer: the block to show, 0-based; None: every block, the first shown, with a slider to step through them
            (one block when all blocks add the same bias).
        columns: heads per row.
        title: the figure's title (default: what is shown, and for which block).

    Returns:
        A plotly ``Figure``, one colour scale for all heads (and all blocks on the slider), centred on zero when the
            bias takes both signs.
    """
    layers, heads = result.bias.shape[:2]
    gh, gw = result.grid
    shared = layers > 1 and result.shared_by_all_blocks()
    if layer is not None and not 0 <= layer < layers:
        raise InvalidParameterError(f"layer must be between 0 and {layers - 1} for {layers} blocks; got {layer}.")
    shown = [0] if shared else list(range(layers)) if layer is None else [layer]
    dys, dxs = result.offsets
    values = result.bias[shown]
    # blocks with fewer heads than others (Swin's early stages) are NaN at the heads they lack: panels for the
    # heads some shown block has
    heads = int(max(np.flatnonzero(~np.isnan(result.bias[l]).all(axis=(-2, -1))).max(initial=0) + 1 for l in shown))
    low, high = float(np.nanmin(values)), float(np.nanmax(values))  # NaN: an offset or head a block has not
    both = low < 0 < high
    reach = max(-low, high)
    cols = min(columns, heads)
    rows = math.ceil(heads / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"head {h + 1}" for h in range(heads)],
                        horizontal_spacing=0.06, vertical_spacing=0.12 if rows > 1 else 0.08)
    for n, l in enumerate(shown):
        for h in range(heads):
            r, c = h // cols + 1, h % cols + 1
            # float32: every bias vitlens reads is float32 or narrower, so the values are exact and the page lighter
            fig.add_trace(go.Heatmap(
                z=result.bias[l, h].astype(np.float32), x=dxs, y=dys, coloraxis="coloraxis", visible=n == 0,
                hovertemplate=f"block {l + 1}, head {h + 1}<br>key %{{y}} rows down, %{{x}} columns right of the "
                              "query<br>bias %{z:.4g} logits<extra></extra>"), row=r, col=c)
            fig.add_trace(go.Scatter(x=[0], y=[0], mode="markers", hoverinfo="skip", showlegend=False,
                                     visible=n == 0, marker=dict(symbol="x-thin", size=9, line=dict(width=2,
                                                                                                      color="black"))),
                          row=r, col=c)
    step = max(1, (max(gh, gw) - 1) // 2)  # five ticks at most: the offsets 0, +-(g-1)/2, +-(g-1)
    fig.update_xaxes(range=[-(gw - 0.5), gw - 0.5], dtick=step, constrain="domain", showgrid=False, zeroline=False,
                     tickfont_size=9)
    fig.update_yaxes(range=[gh - 0.5, -(gh - 0.5)], dtick=step, constrain="domain", showgrid=False, zeroline=False,
                     tickfont_size=9)  # dy < 0 (keys above the query) at the top, as in the image
    for h in range(heads):
        fig.update_yaxes(scaleanchor=f"x{h + 1 if h else ''}", row=h // cols + 1, col=h % cols + 1)
    fig.update_xaxes(title_text="dx (columns)", title_font_size=10, row=rows, col=1)
    fig.update_yaxes(title_text="dy (rows)", title_font_size=10, row=rows, col=1)
    which = ("the same in every block" if shared else f"block {shown[0] + 1} of {layers}" if len(shown) == 1 else
             f"block 1 of {layers} (the slider shows the others)")
    # say it in words: a flat colour could be any value
    zero = "every entry is 0 (BEiT's tables start at zero: untrained); " if low == high == 0 else ""
    fig.update_layout(
        title=title or f"Relative-position bias by offset, {which}<br><sup>{zero}offset = key minus query, in patch "
                       f"rows (dy, down) and columns (dx, right) of the {gh}x{gw} grid; x marks the query</sup>",
        # fixed limits: plotly would rescale to the visible traces, a different scale for each block on the slider
        coloraxis=dict(colorscale="RdBu_r" if both else "Viridis", cmin=-reach if both else low,
                       cmax=reach if both else high,
                       colorbar=dict(title=dict(text="bias (logits)", side="right"))),
        # rows about as tall as square cells make them in a figure about 1000 px wide, plus a subplot title
        height=int(max(300, rows * (900 / cols * (2 * gh - 1) / (2 * gw - 1) + 50) + 110 + 70 * (len(shown) > 1))),
        margin=dict(l=10, r=10, t=90, b=80 if len(shown) > 1 else 10))
    fig.update_annotations(font_size=11)
    if len(shown) > 1:
        per_block = 2 * heads
        steps = [dict(method="update", label=str(l + 1),
                      args=[{"visible": [n == i for n in range(len(shown)) for _ in range(per_block)]},
                            {"title.text": fig.layout.title.text.replace(which, f"block {l + 1} of {layers}")}])
                 for i, l in enumerate(shown)]
        fig.update_layout(sliders=[dict(active=0, steps=steps, currentvalue=dict(prefix="block "), pad=dict(t=40))])
    return fig


@draws(AttentionDistanceResult, WindowedDistanceResult)
def distance_figure(results: AttentionDistanceResult | Sequence[AttentionDistanceResult],
                    names: Sequence[str] | None = None, units: str = "px", title: str | None = None) -> go.Figure:
    """Fig. 7 right / Fig. 11: one dot per head at its layer, several models side by side.

    Args:
        results: one result, or several (e.g. a ViT and its hybrid) to overlay.
        names: legend names (default: the results' model names).
        units: "px" (input pixels) or "width" (fraction of the image width, for models whose
            input sizes differ).
        title: the figure's title (default: what is shown and over how many images).

    Returns:
        A plotly ``Figure``. The dashed line is the uniform-attention distance.
    """
    results = [results] if isinstance(results, (AttentionDistanceResult, WindowedDistanceResult)) else list(results)
    names = list(names) if names is not None else [r.model_name or f"model {i + 1}" for i, r in enumerate(results)]
    if any(isinstance(r, WindowedDistanceResult) for r in results):  # hierarchical: by stage, or against depth
        if len(results) == 1:
            return windowed_distance_figure(results[0], names[0], units, title)
        return depth_distance_figure(results, names, title)
    fig = go.Figure()
    offsets = np.linspace(-0.15, 0.15, len(results)) if len(results) > 1 else [0.0]
    colours = model_colours(names)
    for i, (res, name) in enumerate(zip(results, names)):
        values = res.mean_px if units == "px" else res.mean_fraction_of_width
        layers, heads = np.meshgrid(np.arange(values.shape[0]), np.arange(values.shape[1]), indexing="ij")
        fig.add_trace(go.Scatter(
            x=layers.ravel() + 1 + offsets[i], y=values.ravel(), mode="markers", name=name,
            marker=dict(size=7, color=colours[i], opacity=0.8),
            customdata=np.stack([layers.ravel() + 1, heads.ravel() + 1, res.std_px.ravel()], -1),
            hovertemplate=(f"{name}<br>layer %{{customdata[0]}}, head %{{customdata[1]}}<br>"
                           f"mean distance %{{y:.{'1f' if units == 'px' else '3f'}}} {units if units == 'px' else 'of width'}"
                           "<br>std over images %{customdata[2]:.1f} px<extra></extra>"),
        ))
    # what every head would show if it attended uniformly: a dotted line per distinct level, named
    # in the legend (a label on the plot sat over the last layer's dots)
    levels: list[float] = []
    depth = max(r.mean_px.shape[0] for r in results)
    for i, (res, name) in enumerate(zip(results, names)):
        uniform = uniform_distance(res.grid, res.stride_px)
        if units != "px":
            uniform /= res.image_size[1]
        if any(abs(uniform - u) < 0.03 * max(u, 1e-9) for u in levels):
            continue
        levels.append(uniform)
        fig.add_trace(go.Scatter(
            x=[0.5, depth + 0.5], y=[uniform, uniform], mode="lines", hoverinfo="skip",
            line=dict(dash="dot", width=1.5, color=colours[i]),
            name="uniform attention" + (f" ({name})" if len(results) > 1 else "")))
    first = results[0]
    conv = "renormalised over patch keys" if first.renormalize else "raw weights"
    # a result that leaves blocks out says why (a CaiT's class-attention layers: no position for the class token)
    notes = "".join(f"<br><sup>{'' if len(results) == 1 else name + ': '}{r.figure_note}</sup>"
                    for r, name in zip(results, names) if getattr(r, "figure_note", ""))
    fig.update_layout(
        title=title or f"Mean attention distance by head<br><sup>{conv}; mean over {counted(first.n_images, 'image')}; "
                       f"dotted: uniform attention</sup>{notes}",
        xaxis=dict(title="Network depth (layer)", dtick=1, range=[0.5, depth + 0.5]),
        yaxis=dict(title="Mean attention distance (pixels)" if units == "px" else "Mean attention distance (image widths)",
                   rangemode="tozero"),
        height=460, margin=dict(l=10, r=10, t=70, b=10), legend=dict(orientation="h", y=-0.18),
    )
    return fig


def windowed_distance_figure(result: WindowedDistanceResult, name: str | None = None, units: str = "px",
                             title: str | None = None) -> go.Figure:
    """Fig. 7 right for a windowed, hierarchical model (Swin): one dot per head at its block, coloured by stage,
    and per block a dash at the distance uniform attention over each query's window gives (what the window
    allows: a head at 1.0x it only fills its window).

    Args:
        result: the model's windowed attention distance.
        name: the model's name (default ``result.model_name``).
        units: "px" (input pixels) or "width" (fraction of the image width).
        title: the figure's title (default: what is shown and over how many images).

    Returns:
        A plotly ``Figure``.
    """
    name = name or result.model_name or "model"
    scale = 1.0 if units == "px" else 1.0 / float(result.image_size[1])
    fig = go.Figure()
    layers = np.arange(result.mean_px.shape[0])
    for stage in sorted(set(result.stages.tolist())):
        at = layers[result.stages == stage]
        blocks, heads = np.meshgrid(at, np.arange(result.mean_px.shape[1]), indexing="ij")
        values = result.mean_px[at] * scale
        keep = ~np.isnan(values.ravel())
        stride = result.stride_px[at[0]]
        fig.add_trace(go.Scatter(
            x=(blocks.ravel() + 1)[keep], y=values.ravel()[keep], mode="markers",
            name=f"stage {stage + 1} ({stride[0]} px tokens)", marker=dict(size=7, color=PALETTE[stage % len(PALETTE)]),
            customdata=np.stack([blocks.ravel() + 1, heads.ravel() + 1, result.of_window[at].ravel()], -1)[keep],
            hovertemplate=(f"{name}<br>block %{{customdata[0]}}, head %{{customdata[1]}}<br>"
                           f"mean distance %{{y:.{'1f' if units == 'px' else '3f'}}} "
                           f"{'px' if units == 'px' else 'of width'}<br>%{{customdata[2]:.2f}}x its window's uniform "
                           "distance<extra></extra>")))
    fig.add_trace(go.Scatter(
        x=np.repeat(layers + 1, 3) + np.tile([-0.35, 0.35, np.nan], len(layers)),
        y=np.repeat(result.window_uniform_px * scale, 3) * np.tile([1.0, 1.0, np.nan], len(layers)),
        mode="lines", line=dict(dash="dot", width=2, color="#555"), hoverinfo="skip",
        name="uniform attention over each query's window"))
    kinds = ", ".join(f"{k}" for k in dict.fromkeys(result.kinds))
    fig.update_layout(
        title=title or f"Mean attention distance by head, {name}<br><sup>{kinds} attention; mean over "
                       f"{counted(result.n_images, 'image')}; dotted: uniform attention over the window</sup>",
        xaxis=dict(title="Network depth (block)", dtick=1, range=[0.5, len(layers) + 0.5]),
        yaxis=dict(title="Mean attention distance (pixels)" if units == "px" else
                   "Mean attention distance (image widths)", rangemode="tozero"),
        height=460, margin=dict(l=10, r=10, t=70, b=10), legend=dict(orientation="h", y=-0.18))
    return fig


def depth_distance_figure(results: Sequence[AttentionDistanceResult | WindowedDistanceResult],
                          names: Sequence[str], title: str | None = None) -> go.Figure:
    """Fig. 11's question across kinds of model (a Swin beside a ViT): every head's mean attention distance in
    units of the image width against its block's depth as a fraction of the model's ((l + 1) / L), with each
    model's uniform-attention distance (a ViT's over its grid, a windowed model's over each query's window).

    Args:
        results: one attention distance per model, windowed or not.
        names: their legend names.
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    fig = go.Figure()
    colours = model_colours(names)
    for i, (res, name) in enumerate(zip(results, names)):
        depth = res.mean_px.shape[0]
        frac = (np.arange(depth) + 1) / depth
        values = res.mean_fraction_of_width
        xs = np.repeat(frac, values.shape[1])
        keep = ~np.isnan(values.ravel())
        colour = colours[i]
        fig.add_trace(go.Scatter(x=xs[keep], y=values.ravel()[keep], mode="markers", name=name,
                                 marker=dict(size=6, color=colour, opacity=0.8),
                                 hovertemplate=f"{name}<br>depth %{{x:.2f}}<br>%{{y:.3f}} of the width<extra></extra>"))
        if isinstance(res, WindowedDistanceResult):
            uniform = res.window_uniform_px / float(res.image_size[1])
        else:
            uniform = np.full(depth, uniform_distance(res.grid, res.stride_px) / float(res.image_size[1]))
        fig.add_trace(go.Scatter(x=frac, y=uniform, mode="lines", line=dict(dash="dot", width=1.5, color=colour),
                                 hoverinfo="skip", name=f"uniform attention ({name})"))
    fig.update_layout(
        title=title or "Mean attention distance against depth<br><sup>in image widths; dotted: uniform attention "
                       "(over the grid for a ViT, over each query's window for a windowed model)</sup>",
        xaxis=dict(title="Depth (fraction of the model's blocks)", range=[0, 1.02]),
        yaxis=dict(title="Mean attention distance (image widths)", rangemode="tozero"),
        height=460, margin=dict(l=10, r=10, t=70, b=10), legend=dict(orientation="h", y=-0.18))
    return fig


#: the colour scale of every token map over an image: perceptually uniform (equal steps of value look like equal
#: steps of colour; jet's bright bands drew edges the map does not have), and its darkest colour is not one of the
#: placeholders Streamlit's chart theme swaps (#0000xx)
TOKEN_COLORSCALE = "Viridis"


def colour_range(maps: Sequence[np.ndarray]) -> tuple[float, float]:
    """The colour range of token maps: from 0 (or the data's minimum, when it is below 0) to the data's maximum, so
    the colour bar spans what is drawn and 0 keeps its colour.

    Args:
        maps: the maps drawn on one colour scale.

    Returns:
        (low, high), high > low.
    """
    low = min(0.0, min(float(np.nanmin(m)) for m in maps))
    high = max(float(np.nanmax(m)) for m in maps)
    return low, max(high, low + 1e-12)


def token_heatmap(values: np.ndarray, size: tuple[int, int], **kw: Any) -> go.Heatmap:
    """A [gh, gw] token map drawn as tokens over an image of ``size`` (H, W) pixels: one flat cell per token,
    covering the token's H/gh x W/gw pixels (no interpolation: nothing finer than a token is drawn, and the
    colours are the map's own values, its maximum included).

    Args:
        values: [gh, gw] the map.
        size: (H, W) of the image under it, in pixels.
        **kw: the heatmap's other settings (colour scale or axis, opacity).

    Returns:
        A ``go.Heatmap`` whose cells sit on the tokens' pixels; hover names the patch (row, column).
    """
    values = np.asarray(values, dtype=np.float64)
    gh, gw = values.shape
    h, w = size
    dy, dx = h / gh, w / gw
    rows, cols = np.mgrid[0:gh, 0:gw]
    return go.Heatmap(z=values, x0=dx / 2 - 0.5, dx=dx, y0=dy / 2 - 0.5, dy=dy, zsmooth=False,
                      customdata=np.stack([rows, cols], -1),
                      hovertemplate="patch (%{customdata[0]}, %{customdata[1]})<br>value %{z:.3f}<extra></extra>", **kw)


def heatmap_overlay_figure(image: np.ndarray, values: np.ndarray, title: str, opacity: float = 0.5,
                           colorscale: str = TOKEN_COLORSCALE, scale_title: str = "value",
                           patch: tuple[int, int] | None = None) -> go.Figure:
    """A [gh, gw] token map over an RGB uint8 image [H, W, 3], one cell per token (``token_heatmap``), the colour
    bar from 0 to the map's maximum (``colour_range``).

    Args:
        image: uint8 [H, W, 3].
        values: [gh, gw] map.
        title: the figure's title.
        opacity: the map's opacity over the image, in [0, 1].
        colorscale: a plotly colour scale name (default a perceptually uniform one, ``TOKEN_COLORSCALE``).
        scale_title: the colour bar's title (what the colour measures).
        patch: (row, column) of a grid cell to outline (the queried patch), or None.

    Returns:
        A plotly ``Figure``.
    """
    h, w = image.shape[:2]
    low, high = colour_range([values])
    fig = go.Figure(go.Image(z=image, hoverinfo="skip"))
    fig.add_trace(token_heatmap(values, (h, w), opacity=opacity, colorscale=colorscale, zmin=low, zmax=high,
                                showscale=True, colorbar=dict(title=dict(text=scale_title, side="right"))))
    if patch is not None:
        _outline_patch(fig, patch, values.shape, (h, w))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x")
    fig.update_layout(title=title, height=420, margin=dict(l=10, r=10, t=50, b=10))
    return fig


def _outline_patch(fig: go.Figure, patch: tuple[int, int], grid: tuple[int, int], size: tuple[int, int],
                   row: int | None = None, col: int | None = None) -> None:
    """Outline grid cell ``patch`` (row, column) of a ``grid`` map drawn over an image of ``size`` (H, W)
    pixels: the queried patch of a per-head map, so the reader sees where the query sits."""
    (r, c), (gh, gw), (h, w) = patch, grid[:2], size
    kw = {} if row is None else dict(row=row, col=col)
    fig.add_shape(type="rect", x0=c * w / gw - 0.5, x1=(c + 1) * w / gw - 0.5, y0=r * h / gh - 0.5,
                  y1=(r + 1) * h / gh - 0.5, line=dict(color="white", width=2), layer="above", **kw)


def rollout_figure(result: RolloutResult, image: np.ndarray, index: int = 0, opacity: float = 0.5) -> go.Figure:
    """Fig. 6: the rollout map of image ``index`` over the image (uint8 [H, W, 3]).

    Args:
        result: rollout maps (``attention_rollout``).
        image: uint8 [H, W, 3], the image as the model sees it.
        index: which image of the result.
        opacity: the map's opacity over the image, in [0, 1].

    Returns:
        A plotly ``Figure``.
    """
    caption = result.caption(index)
    label = f"<br><sup>predicted {caption}</sup>" if caption else ""
    return heatmap_overlay_figure(image, result.maps[index], result.title() + label, opacity,
                                  scale_title="rollout (÷ max)")


def overlay_grid_figure(panels: Sequence[tuple[np.ndarray, np.ndarray, str]], title: str, opacity: float = 0.5,
                        columns: int = 4, scale_title: str = "rollout (÷ max)",
                        patch: tuple[int, int] | None = None) -> go.Figure:
    """Several (image uint8 [H, W, 3], map [gh, gw], caption) overlays in one figure, one colour scale: each map
    drawn as tokens (``token_heatmap``), the colour bar from 0 to the largest value drawn (``colour_range``).

    Args:
        panels: (image uint8 [H, W, 3], map [gh, gw], caption) triples.
        title: the figure's title.
        opacity: the maps' opacity over the images, in [0, 1].
        columns: panels per row.
        scale_title: the shared colour bar's title (what the colour measures).
        patch: (row, column) of a grid cell to outline on every panel (the queried patch), or None.

    Returns:
        A plotly ``Figure``.
    """
    cols = min(columns, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[p[2] for p in panels], horizontal_spacing=0.02,
                        vertical_spacing=0.08)
    for i, (image, values, _caption) in enumerate(panels):
        r, c = i // cols + 1, i % cols + 1
        fig.add_trace(go.Image(z=image, hoverinfo="skip"), row=r, col=c)
        fig.add_trace(token_heatmap(values, image.shape[:2], opacity=opacity, coloraxis="coloraxis"), row=r, col=c)
        if patch is not None:
            _outline_patch(fig, patch, values.shape, image.shape[:2], row=r, col=c)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    for i in range(len(panels)):
        fig.update_yaxes(scaleanchor=f"x{i + 1 if i else ''}", row=i // cols + 1, col=i % cols + 1)
    low, high = colour_range([p[1] for p in panels])
    fig.update_layout(title=title, coloraxis=dict(colorscale=TOKEN_COLORSCALE, cmin=low, cmax=high,
                      colorbar=dict(title=dict(text=scale_title, side="right"))), height=300 * rows + 80,
                      margin=dict(l=10, r=10, t=80, b=10))
    fig.update_annotations(font_size=12)
    return fig


@draws(RolloutResult, images=True)
def rollout_grid_figure(result: RolloutResult, images: Sequence[np.ndarray], opacity: float = 0.5) -> go.Figure:
    """Fig. 6 for several images: rollout over each of ``images`` (result rows 0..n-1).

    Args:
        result: rollout maps of at least ``len(images)`` images.
        images: uint8 [H, W, 3] images, as the model sees them.
        opacity: the maps' opacity, in [0, 1].

    Returns:
        A plotly ``Figure``.
    """
    panels = [(image, result.maps[i], result.caption(i) or f"image {i + 1}") for i, image in enumerate(images)]
    return overlay_grid_figure(panels, result.title(), opacity)


def heads_figure(image: np.ndarray, head_maps: np.ndarray, layer: int | None, query_label: str,
                 opacity: float = 0.5, patch: tuple[int, int] | None = None) -> go.Figure:
    """All heads of one layer as small multiples: where ``query_label`` attends, per head.

    Args:
        image: uint8 [H, W, 3] as the model sees it.
        head_maps: [heads, gh, gw] attention of the query over patch keys (``AttentionMapsResult.query_attention``).
        layer: 0-based block index (shown 1-based), or None for an attention pool's map
            (``AttentionMapsResult.pool_attention``).
        query_label: e.g. "the class token", "patch (3, 4)" or "the pool's probe".
        opacity: the maps' opacity, in [0, 1].
        patch: (row, column) of the query when it is a patch: outlined on every head's map.

    Returns:
        A plotly ``Figure``.
    """
    panels = [(image, hm / max(float(hm.max()), 1e-12), f"head {h + 1}") for h, hm in enumerate(head_maps)]
    columns = grid_columns(len(panels))
    fig = overlay_grid_figure(panels, f"{_where(layer)}: attention of {query_label}<br><sup>each head scaled "
                              "to its max</sup>", opacity, columns=columns,
                              scale_title="attention (÷ head's max)", patch=patch)
    # a square image in a cell taller than wide shrinks its domain to the top of the cell, under its title (the
    # range grew instead and centred the image, ~80 px below its "head N"); rows about as tall as a column of
    # ~800 px of images is wide, so little is left blank under each row
    fig.update_xaxes(constrain="domain")
    fig.update_yaxes(constrain="domain", constraintoward="top")
    return fig.update_layout(height=80 + math.ceil(len(panels) / columns) * round(40 + 780 / columns))


def grid_columns(n: int, most: int = 6) -> int:
    """Columns for ``n`` small multiples: of the counts from ceil(sqrt(n)) up to ``most``, the one that leaves
    the fewest empty cells in the last row, the widest of those (8 heads: 4 x 2, not 6 + 2; 12: 6 x 2; 16: 4 x 4).

    Args:
        n: how many panels.
        most: the most columns a row may have.

    Returns:
        The number of columns (``n`` itself when it fits in one row).
    """
    if n <= most:
        return max(n, 1)
    start = min(math.ceil(math.sqrt(n)), most)
    return min(range(start, most + 1), key=lambda c: (math.ceil(n / c) * c - n, -c))


def _where(layer: int | None) -> str:
    """'Layer 3' for a block (0-based in, 1-based out); 'Attention pool' for the pool (``layer`` None)."""
    return "Attention pool" if layer is None else f"Layer {layer + 1}"


def head_figure(image: np.ndarray, head_maps: np.ndarray, layer: int | None, head: int, query_label: str,
                opacity: float = 0.5, patch: tuple[int, int] | None = None) -> go.Figure:
    """One head of one layer: where ``query_label`` attends (0-based layer and head, shown 1-based).

    Args:
        image: uint8 [H, W, 3] as the model sees it.
        head_maps: [heads, gh, gw] attention of the query over patch keys.
        layer: 0-based block index, or None for an attention pool's map.
        head: 0-based head index.
        query_label: e.g. "the class token" or "patch (3, 4)".
        opacity: the map's opacity, in [0, 1].
        patch: (row, column) of the query when it is a patch: outlined on the map.

    Returns:
        A plotly ``Figure``.
    """
    return heatmap_overlay_figure(image, head_maps[head], f"{_where(layer)}, head {head + 1}: attention of "
                                  f"{query_label}", opacity, scale_title="attention weight", patch=patch)


def attribution_figure(results: Sequence["AttributionResult"], image: np.ndarray, index: int = 0, opacity: float = 0.5) -> go.Figure:
    """Maps of several attribution methods side by side over one image (negative evidence
    clipped, each map scaled to its maximum).

    Args:
        results: one ``AttributionResult`` per method, over the same images.
        image: uint8 [H, W, 3], image ``index`` as the model sees it.
        index: which image of the results.
        opacity: the maps' opacity, in [0, 1].

    Returns:
        A plotly ``Figure``.
    """
    panels = []
    for r in results:
        mp = np.clip(np.asarray(r.maps[index], dtype=np.float64), 0, None)
        panels.append((image, mp / max(float(mp.max()), 1e-12), method_label(r.method)))
    target = results[0].target_name(index) if results else "no class"
    if results and getattr(results[0], "target_kind", "class") == "text":
        target = f"the prompt \"{target}\""
    return overlay_grid_figure(panels, f"Attributions for {target} (positive evidence, scaled to max)",
                               opacity, columns=min(6, len(panels)), scale_title="evidence (÷ map's max)")


def faithfulness_figure(results: Sequence["FaithfulnessResult"]) -> go.Figure:
    """Mean deletion and insertion curves of each method, with their mean areas under the curve.

    Args:
        results: one ``FaithfulnessResult`` per method (``deletion_insertion``).

    Returns:
        A plotly ``Figure``.
    """
    # one y range for both panels: the same probability, read across
    fig = make_subplots(rows=1, cols=2, subplot_titles=["Deletion (lower is more faithful)",
                                                        "Insertion (higher is more faithful)"], shared_yaxes=True)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        # one legend entry per method, under both panels, with both areas (deletion / insertion)
        name = (f"{method_label(r.method)} (AUC deletion {significant(r.deletion_auc.mean())}, "
                f"insertion {significant(r.insertion_auc.mean())})")
        for col, curve, auc, what in ((1, r.deletion, r.deletion_auc, "deletion"),
                                      (2, r.insertion, r.insertion_auc, "insertion")):
            fig.add_trace(go.Scatter(x=r.fractions, y=curve.mean(0), mode="lines", line=dict(color=color),
                                     name=name, legendgroup=r.method, showlegend=col == 1,
                                     hovertemplate=f"{r.method} ({what} AUC {significant(auc.mean())})<br>"
                                                   "%{x:.0%}: %{y:.3f}<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title="share of patches removed / inserted", range=[0, 1])
    text = bool(results) and all(getattr(r, "score", "probability") != "probability" for r in results)
    fig.update_yaxes(rangemode="normal" if text else "tozero")
    fig.update_yaxes(title="cosine similarity to the prompt" if text else "target-class probability", col=1)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(height=420 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=60, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def metric_figure(metric: "Metric", results: Sequence[object]) -> go.Figure:
    """Any perturbation metric's mean curves of each method, one panel per ``Curve`` of its entry, with the method's
    columns (``Metric.columns``) in its legend entry: what the report and the app draw for every metric they score.

    Args:
        metric: the metric's entry (``METRIC_TABLE[name]``).
        results: the metric's result for each method (``ComparisonTable.scores[name]``).

    Returns:
        A plotly ``Figure``.
    """
    panels = [metric.curves(r) for r in results]
    titles = [c.title for c in panels[0]] if panels else [metric.title or metric.name]
    # one y range for every panel: the panels of a metric show one score (deletion beside insertion), read across
    fig = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, shared_yaxes=True)
    for i, (r, curves) in enumerate(zip(results, panels)):
        method = getattr(r, "method", f"method {i + 1}")
        color = method_colour(method, i)
        # one legend entry per method, under every panel, with the method's numbers in the table
        numbers = ", ".join(f"{metric.column_labels.get(k) or k.replace('_', ' ')} {significant(v)}"
                            for k, v in metric.columns(r).items())
        for col, c in enumerate(curves, start=1):
            fig.add_trace(go.Scatter(x=np.asarray(c.x), y=np.asarray(c.y).mean(0), mode="lines+markers",
                                     line=dict(color=color), name=f"{method_label(method)} ({numbers})",
                                     legendgroup=method, showlegend=col == 1,
                                     hovertemplate=f"{method}<br>%{{x:.0%}}: %{{y:.3f}}<extra></extra>"),
                          row=1, col=col)
    scores = {getattr(r, "score", "score") for r in results}
    score = scores.pop() if len(scores) == 1 else "score"
    fig.update_xaxes(title="share of the input changed", range=[0, 1])
    fig.update_yaxes(rangemode="tozero" if score == "probability" else "normal")  # as faithfulness_figure
    # the panels share the y axis: its title once, on the first
    fig.update_yaxes(title="target-class probability" if score == "probability" else score, col=1)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(title=metric.title or metric.name.replace("_", " "),
                      height=440 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=80, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def cka_figure(result: "CKAResult", title: str | None = None) -> go.Figure:
    """Layer-by-layer CKA of two models: model A's layers down (first at the top), model B's across.

    Args:
        result: the CKA (``cka``).
        title: the figure's title (default: the two models).

    Returns:
        A plotly ``Figure``.
    """
    la, lb = result.matrix.shape
    fig = go.Figure(go.Heatmap(
        # sequential over CKA's [0, 1]; not Magma or Inferno, whose first colour #000004 is one of the
        # placeholders Streamlit's chart theme swaps for its palette (a pink band at 0 in the app)
        z=result.matrix, x=list(range(1, lb + 1)), y=list(range(1, la + 1)), zmin=0, zmax=1, colorscale="Plasma",
        customdata=np.stack([result.ci_low, result.ci_high], -1), colorbar=dict(title="CKA"),
        hovertemplate=f"{result.model_a} layer %{{y}} vs {result.model_b} layer %{{x}}<br>CKA %{{z:.3f}} "
                      "(90% CI %{customdata[0]:.3f}-%{customdata[1]:.3f})<extra></extra>"))
    fig.update_xaxes(title=f"{result.model_b} layer", range=[0.5, lb + 0.5], dtick=1 if lb <= 24 else None,
                     constrain="domain")
    fig.update_yaxes(title=f"{result.model_a} layer", range=[la + 0.5, 0.5], dtick=1 if la <= 24 else None,
                     scaleanchor="x", constrain="domain")
    fig.update_layout(title=title or f"Representation similarity (linear CKA)<br><sup>{result.estimator} HSIC, "
                                     f"{result.token_policy} tokens, {counted(result.n_images, 'image')}</sup>",
                      height=480, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def head_importance_figure(importance: "HeadImportanceResult", distance: AttentionDistanceResult, title: str | None = None) -> go.Figure:
    """Do local heads matter? Each head's importance (logit drop when removed) against its mean
    attention distance (paper Fig. 7 right), coloured by layer.

    Args:
        importance: head importance (``head_importance``).
        distance: the same model's attention distance (``attention_distance``).
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    layers, heads = importance.logit_drop.shape
    ll, hh = np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij")
    fig = go.Figure(go.Scatter(
        x=distance.mean_px.ravel(), y=importance.logit_drop.ravel(), mode="markers",
        marker=dict(size=9, color=ll.ravel() + 1, colorscale="Viridis", colorbar=dict(title="layer"), opacity=0.85),
        customdata=np.stack([ll.ravel() + 1, hh.ravel() + 1], -1),
        hovertemplate="layer %{customdata[0]}, head %{customdata[1]}<br>distance %{x:.1f} px<br>"
                      "logit drop %{y:.3f}<extra></extra>"))
    fig.add_vline(x=distance.uniform_px, line=dict(dash="dot", width=1, color="#888"),
                  annotation_text="uniform attention", annotation_position="top right")
    fig.update_layout(title=title or f"Do local heads matter?<br><sup>{importance.ablation}-ablation of one head at "
                                     f"a time, {counted(importance.n_images, 'image')}</sup>",
                      xaxis_title="Mean attention distance (pixels)",
                      yaxis_title="Drop of the predicted class's logit", height=440,
                      margin=dict(l=10, r=10, t=70, b=10))
    return fig


@draws(PrefixDiagnosticsResult, when=lambda r: bool(r.labels))  # no prefix tokens: nothing to draw
def prefix_figure(result: PrefixDiagnosticsResult, title: str | None = None) -> go.Figure:
    """Attention parked on prefix tokens: share of each head's patch-query attention on all prefix
    tokens together, layer by layer (first layer at the top).

    Args:
        result: the prefix diagnostics (``prefix_diagnostics``).
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    total = result.mass.sum(-1) if result.mass.size else np.zeros((0, 0))
    layers, heads = total.shape
    fig = go.Figure(go.Heatmap(
        z=total, x=list(range(1, heads + 1)), y=list(range(1, layers + 1)), zmin=0, zmax=1, colorscale="Blues",
        colorbar=dict(title="share"),
        hovertemplate="layer %{y}, head %{x}<br>attention on prefix tokens %{z:.2f}<extra></extra>"))
    fig.update_xaxes(title="head", range=[0.5, heads + 0.5], constrain="domain", dtick=1 if heads <= 24 else None)
    fig.update_yaxes(title="layer", range=[layers + 0.5, 0.5], constrain="domain", dtick=1 if layers <= 24 else None)
    fig.update_layout(title=title or f"Attention on prefix tokens ({', '.join(result.labels) or 'none'})<br><sup>share "
                                     "of patch queries' attention; above 0.5 a head is parked</sup>",
                      height=380, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def sanity_figure(results: "SanityResult | Sequence[SanityResult]", title: str | None = None) -> go.Figure:
    """Cascading randomisation (Adebayo et al. 2018, Fig. 2): each similarity to the original maps against the
    step of the cascade (original first, then the head, the blocks from the top, the embedding; blocks counted
    from 1), one curve per method; mean over images, NaNs skipped. The verdict's cutoff is drawn, labelled, on the
    panel it is read from (Spearman of |maps|; ``sanity.verdict_rule``), and each legend entry ends with its
    method's verdict.

    Args:
        results: one ``SanityResult`` or several (one per method).
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    results = [results] if not isinstance(results, Sequence) else list(results)
    panels = (("spearman_abs", "Spearman, |maps| (the verdict's)"), ("spearman", "Spearman, signed maps"),
              ("ssim", "SSIM, |maps|"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels], shared_yaxes=True)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        x = ["original", *r.step_labels()]
        rows = r.to_rows()
        for col, (key, _) in enumerate(panels, start=1):
            y = [1.0, *[row[key] for row in rows]]
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", line=dict(color=color), legendgroup=r.method,
                                     name=f"{method_label(r.method)}: {r.verdict_word()}", showlegend=col == 1,
                                     hovertemplate=f"{method_label(r.method)}<br>%{{x}}: %{{y:.3f}}<extra></extra>"),
                          row=1, col=col)
    if results:
        cut = results[0].threshold
        fig.add_hline(y=cut, line=dict(dash="dot", width=1.5, color="#555"), row=1, col=1,
                      annotation_text=f"verdict cutoff {significant(cut)}", annotation_position="bottom left",
                      annotation_font_size=10)
    fig.update_xaxes(title="randomised down to", tickangle=-45)
    fig.update_yaxes(range=[-1.05, 1.05])
    cut_text = significant(results[0].threshold) if results else "0.5"
    fig.update_layout(title=title or "Cascading randomisation (Adebayo et al. 2018)<br><sup>similarity of each step's "
                                     f"maps to the original model's; a map decorrelates where its Spearman of |maps| "
                                     f"falls below the dotted cutoff ({cut_text})</sup>",
                      height=460, margin=dict(l=10, r=10, t=80, b=10), legend=dict(orientation="h", y=-0.45))
    return fig


def perturbation_figure(results: Sequence["PerturbationResult"], roads: Sequence["RoadResult"] = ()) -> go.Figure:
    """Chefer et al.'s positive and negative perturbation curves (and, given, ROAD's MoRF and LeRF curves) of each
    method: mean over images, with the mean AUC (positive: lower is better; negative: higher).

    Args:
        results: one ``PerturbationResult`` per method (``perturbation_test``).
        roads: ``RoadResult`` curves to add (``road``), or none.

    Returns:
        A plotly ``Figure``.
    """
    cols = 2 + 2 * bool(roads)
    titles = ["Positive perturbation (lower is better)", "Negative perturbation (higher is better)"]
    if roads:
        titles += ["ROAD MoRF (lower is better)", "ROAD LeRF (higher is better)"]
    fig = make_subplots(rows=1, cols=cols, subplot_titles=titles)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        for col, curve, auc in ((1, r.positive, r.positive_auc), (2, r.negative, r.negative_auc)):
            fig.add_trace(go.Scatter(x=r.fractions, y=curve.mean(0), mode="lines+markers", line=dict(color=color),
                                     name=method_label(r.method), legendgroup=r.method, showlegend=col == 1,
                                     hovertemplate=f"{r.method} (AUC {significant(auc.mean())})<br>%{{x:.0%}} removed: "
                                                   "%{y:.3f}<extra></extra>"), row=1, col=col)
    for i, r in enumerate(roads):
        color = method_colour(r.method, i)
        for col, curve in ((3, r.morf), (4, r.lerf)):
            fig.add_trace(go.Scatter(x=r.percentages, y=curve.mean(0), mode="lines+markers", line=dict(color=color),
                                     name=method_label(r.method), legendgroup=r.method,
                                     showlegend=not results and col == 3),
                          row=1, col=col)
    fig.update_xaxes(title="share removed", range=[0, 1])
    score = results[0].score if results else (roads[0].score if roads else "score")
    fig.update_yaxes(title=score)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(height=420 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=60, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig
