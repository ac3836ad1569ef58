"""The video weight views' figures (issue 50): position similarity over time and over space (Fig. 7 centre for
video) and the tubelet filters' components, one image per time step (Fig. 7 left for video)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..views.position import PositionSimilarityResult
from ..views.video_weights import TubeletFilterPCAResult, VideoPositionSimilarityResult
from .colours import component_rgb
from .registry import draws
from .weights import position_mosaic


@draws(VideoPositionSimilarityResult)
def video_position_figure(result: VideoPositionSimilarityResult, title: str | None = None) -> go.Figure:
    """Two panels: the time steps' similarity [nt, nt] (left; absent without a time table) and the cells' tiles
    (right, as Fig. 7 centre: tile (r, c) is cell (r, c)'s similarity to every cell).

    Args:
        result: ``video_position_similarity``'s result.
        title: the figure's title (default: the model, its table and whether it is learned).

    Returns:
        A plotly ``Figure``.
    """
    gh, gw = result.space.shape[:2]
    mosaic, coords = position_mosaic(PositionSimilarityResult(result.space, (gh, gw), (gh, gw), False))
    has_time = result.time is not None
    fig = make_subplots(rows=1, cols=2 if has_time else 1, column_widths=[0.35, 0.65] if has_time else None,
                        subplot_titles=((["over time (same cell)"] if has_time else [])
                                        + ["over space (same time step)"]))
    if result.time is not None:
        n = len(result.time)
        fig.add_trace(go.Heatmap(z=result.time, x=list(range(n)), y=list(range(n)), colorscale="Viridis", zmin=-1,
                                 zmax=1, showscale=False,
                                 hovertemplate="time step %{y} vs %{x}<br>cosine %{z:.3f}<extra></extra>"),
                      row=1, col=1)
        fig.update_xaxes(title="time step", range=[-0.5, n - 0.5], constrain="domain", dtick=1, row=1, col=1)
        fig.update_yaxes(title="time step", range=[n - 0.5, -0.5], scaleanchor="x", constrain="domain", dtick=1,
                         row=1, col=1)
    col = 2 if has_time else 1
    fig.add_trace(go.Heatmap(z=mosaic, customdata=coords, colorscale="Viridis", zmin=-1, zmax=1,
                             colorbar=dict(title="cosine"),
                             hovertemplate="cell (%{customdata[0]}, %{customdata[1]}) vs (%{customdata[2]}, "
                                           "%{customdata[3]})<br>cosine %{z:.3f}<extra></extra>"), row=1, col=col)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, title="cell column (tile)",
                     range=[-0.5, mosaic.shape[1] - 0.5], constrain="domain", row=1, col=col)
    fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, title="cell row (tile)",
                     range=[mosaic.shape[0] - 0.5, -0.5], scaleanchor=f"x{col}", constrain="domain", row=1, col=col)
    code = "fixed sin-cos code, not learned" if result.sinusoidal else f"learned, {result.table} table"
    code += "" if has_time else ", no time table"
    step = f"{result.frames_per_step} frames per time step" if result.frames_per_step > 1 else "one frame per step"
    fig.update_layout(title=title or f"Position embedding similarity, {result.model_name}<br><sup>{code}; {step}</sup>",
                      height=480, margin=dict(l=10, r=10, t=90, b=10))
    return fig


@draws(TubeletFilterPCAResult)
def tubelet_filters_figure(result: TubeletFilterPCAResult, components: int = 8, title: str | None = None) -> go.Figure:
    """One row per component, one column per time step: the component's slice as an RGB image, the slices of a
    component min-max scaled together (a quiet slice looks flat), with its share of the component's energy.

    Args:
        result: ``video_filter_pca``'s result.
        components: how many components to draw (the first ones).
        title: the figure's title (default: the model and how much variance the drawn components explain).

    Returns:
        A plotly ``Figure``.
    """
    k = min(int(components), len(result.components))
    tt = result.components.shape[1]
    names = [f"PC{i + 1} {100 * result.explained_variance_ratio[i]:.1f}% · t{j} {100 * result.time_energy[i, j]:.0f}%"
             for i in range(k) for j in range(tt)]
    fig = make_subplots(rows=k, cols=tt, horizontal_spacing=0.01, vertical_spacing=0.04, subplot_titles=names)
    for i in range(k):
        joint = component_rgb(np.concatenate(list(result.components[i]), axis=-1))  # [P, tt * Q, 3], scaled together
        q = result.components.shape[-1]
        for j in range(tt):
            fig.add_trace(go.Image(z=joint[:, j * q:(j + 1) * q], hovertemplate=f"PC{i + 1}, time step {j}<extra>"
                                                                                "</extra>"), row=i + 1, col=j + 1)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_annotations(font_size=10)
    total = 100 * float(np.sum(result.explained_variance_ratio[:k]))
    fig.update_layout(title=title or f"Tubelet filters by time step<br><sup>top {k} components, {total:.1f}% of "
                                     f"variance;<br>{result.module}</sup>",  # the module's own line: a narrow figure
                      height=max(280, 110 * k + 110), margin=dict(l=10, r=10, t=110, b=10),
                      # square cells side by side: a full-width figure set two time steps' images far apart
                      width=max(360, 130 * tt + 20))
    return fig
