"""Mean attention distance (Fig. 7 right, Fig. 11): each head by layer, a windowed model's per block and stage, and
models side by side by relative depth; the prefix tokens' parked attention beside it."""
from __future__ import annotations

from typing import Sequence, cast

import numpy as np
import plotly.graph_objects as go

from ..views.distance import AttentionDistanceResult, uniform_distance
from ..views.prefix import PrefixDiagnosticsResult
from ..views.windowed import WindowedDistanceResult
from ..words import counted
from .colours import PALETTE, model_colours
from .registry import draws


#: the uniform-attention reference lines' colour: no model's (``model_colours``)
UNIFORM_GREY = "#7f7f7f"


@draws(AttentionDistanceResult, WindowedDistanceResult)
def distance_figure(results: AttentionDistanceResult | WindowedDistanceResult
                    | Sequence[AttentionDistanceResult | WindowedDistanceResult],
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
        if len(results) == 1 and isinstance(results[0], WindowedDistanceResult):
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
                           f"mean distance %{{y:.{'1f' if units == 'px' else '3f'}}} "
                           f"{units if units == 'px' else 'of width'}"
                           "<br>std over images %{customdata[2]:.1f} px<extra></extra>"),
        ))
    # what every head would show if it attended uniformly: a dotted line per distinct level, named
    # in the legend (a label on the plot sat over the last layer's dots)
    levels: list[float] = []
    depth = max(r.mean_px.shape[0] for r in results)
    # none of them is windowed here (those returned above)
    for res, name in zip(cast(list[AttentionDistanceResult], results), names):
        uniform = uniform_distance(res.grid, res.stride_px)
        if units != "px":
            uniform /= res.image_size[1]
        if any(abs(uniform - u) < 0.03 * max(u, 1e-9) for u in levels):
            continue
        levels.append(uniform)
        fig.add_trace(go.Scatter(
            x=[0.5, depth + 0.5], y=[uniform, uniform], mode="lines", hoverinfo="skip",
            # grey, not the model's colour: a model's dots on a line of their own colour read as one trace
            line=dict(dash=("dot", "dash", "dashdot")[len(levels) % 3 - 1], width=1.5, color=UNIFORM_GREY),
            name="uniform attention" + (f" ({name})" if len(results) > 1 else "")))
    first = results[0]
    conv = "renormalised over patch keys" if first.renormalize else "raw weights"
    # a result that leaves blocks out says why (a CaiT's class-attention layers: no position for the class token)
    notes = "".join(f"<br><sup>{'' if len(results) == 1 else name + ': '}{getattr(r, 'figure_note', '')}</sup>"
                    for r, name in zip(results, names) if getattr(r, "figure_note", ""))
    fig.update_layout(
        title=title or f"Mean attention distance by head<br><sup>{conv}; mean over {counted(first.n_images, 'image')}; "
                       f"dotted: uniform attention</sup>{notes}",
        xaxis=dict(title="Network depth (layer)", dtick=1, range=[0.5, depth + 0.5]),
        yaxis=dict(title=("Mean attention distance (pixels)" if units == "px"
                          else "Mean attention distance (image widths)"),
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
