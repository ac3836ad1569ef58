"""Token maps over the image: a map drawn as tokens (one flat cell per token, ``token_heatmap``) on a perceptually
uniform scale from 0 to the data's maximum (``colour_range``), image row 0 at the top; rollout (Fig. 6, Fig. 14)
and one query's attention head by head."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..views.rollout import RolloutResult
from .registry import draws


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
    # the source on a line of its own: a windowed model's (through its windows and mergings, a DaViT's "channel
    # attention not drawn") ran past the figure's right edge on one line
    title = (f"Attention rollout ({result.head_fusion} fusion, discard {result.discard_ratio:.2f})"
             f"<br><sup>{result.source_token}</sup>{label}")
    fig = heatmap_overlay_figure(image, result.maps[index], title, opacity, scale_title="rollout (÷ max)")
    fig.update_layout(margin=dict(l=10, r=10, t=80 if label else 65, b=10))
    return fig


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
    # a row as tall as a square panel of a ~1,000-px column is wide (six methods in 300-px rows drew thin strips
    # between empty bands), 300 px at most
    row_px = max(160, min(300, 1000 // cols + 40))
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
                      colorbar=dict(title=dict(text=scale_title, side="right"))), height=row_px * rows + 80,
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
