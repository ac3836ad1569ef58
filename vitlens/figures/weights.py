"""The weight-only views' figures: the embedding filters (Fig. 7 left), the position-embedding similarity (Fig. 7
centre, Fig. 10) and, for relative-position models, each head's learned bias by query-to-key offset."""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..errors import InvalidParameterError
from ..views.filters import FilterPCAResult
from ..views.position import PositionSimilarityResult
from ..views.relpos import RelativePositionBiasResult
from .colours import component_rgb
from .registry import draws


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
                        subplot_titles=[f"PC{i + 1} {100 * v:.1f}%"
                                        for i, v in enumerate(result.explained_variance_ratio)])
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
                     zeroline=False, title="input patch row (tile)",
                     tickvals=[r * (gh + 1) + (gh - 1) / 2 for r in rows],
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
