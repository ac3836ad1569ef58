"""The Position embeddings page (Fig. 7 centre): the learned table's similarity tiles, a tile clicked shown
large, and a learned relative-position bias by offset for the models that have one."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app.caches import position_result, relpos_result
from vitlens_app.context import Context, downloads
from vitlens_app.library import VIEWS, listed_some, round_significant
from vitlens_app.library import RelativePositionBiasResult


def clickable_tiles(fig: go.Figure, grid: tuple[int, int], shown: tuple[int, int]) -> go.Figure:
    """The tile mosaic with one invisible marker on each tile's centre, carrying its patch (row, column),
    and the tile of patch ``shown`` outlined.

    Plotly selects points of a scatter trace on a click (Streamlit's ``selection_mode="points"``), never
    cells of a heatmap, so a click on the mosaic alone selects nothing. With no hover cutoff the marker
    nearest to the pointer is the one hovered and clicked: a click anywhere in a tile selects its patch.
    The outline also makes the chart new whenever the shown patch changes, which clears Plotly's
    selection: a tile clicked before is not still selected, where a second click would only unselect it.
    """
    gh, gw = grid
    rows, cols = np.mgrid[0:gh, 0:gw]
    out = go.Figure(fig)
    r, c = shown
    out.add_shape(type="rect", x0=c * (gw + 1) - 0.5, x1=c * (gw + 1) + gw - 0.5, y0=r * (gh + 1) - 0.5,
                  y1=r * (gh + 1) + gh - 0.5, line=dict(color="#d62728", width=2), layer="above")
    out.add_trace(go.Scatter(
        x=(cols * (gw + 1) + (gw - 1) / 2).ravel(), y=(rows * (gh + 1) + (gh - 1) / 2).ravel(), mode="markers",
        # plain lists: a numpy array would travel as a typed array and come back as {"0": r, "1": c}
        customdata=np.stack([rows.ravel(), cols.ravel()], -1).tolist(), showlegend=False, name="tiles",
        marker=dict(symbol="square", size=12, color="rgba(0,0,0,0)"),
        selected=dict(marker=dict(opacity=0)), unselected=dict(marker=dict(opacity=0)),
        hovertemplate="tile of patch (%{customdata[0]}, %{customdata[1]})<br>click to see it large<extra></extra>"))
    out.update_layout(hoverdistance=-1, clickmode="event+select")
    return out


def tile_clicked() -> None:
    """A tile clicked in the mosaic: its patch goes into the patch row and column boxes, the one place
    the shown patch is kept (so the boxes and a click never disagree)."""
    state = st.session_state.get("pos-fig") or {}
    for point in (state.get("selection") or {}).get("points") or []:
        where = point.get("customdata")
        if isinstance(where, dict):  # a typed array's row, as the browser serialises it
            where = [where.get("0"), where.get("1")]
        if isinstance(where, (list, tuple)) and len(where) == 2 and all(isinstance(v, (int, float)) for v in where):
            st.session_state["pr"], st.session_state["pc"] = int(where[0]), int(where[1])
            return


def recentre() -> None:
    """A new grid: the patch boxes start again at its centre."""
    for key in ("pr", "pc"):
        st.session_state.pop(key, None)


def render_position(ctx: Context) -> None:
    """Fig. 7 centre: the learned absolute table's similarity tiles and, for a model with a learned relative-position
    bias (the registry's view shown on this page), that bias by offset; a model with neither is told why, twice."""
    relative, no_relative = relpos_result(ctx.m, ctx.mkey)
    try:
        position_result(ctx.m, ctx.mkey, ctx.m.spec.grid)
        no_table = ""
    except vl.ViewNotAvailableError as e:
        no_table = e.message_for("app")
    if no_table and relative is None:
        st.error(no_table)
        st.info(no_relative)
        return
    if no_table:
        st.info(no_table)
    else:
        render_position_table(ctx)
    if relative is not None:
        render_relpos(ctx, relative)


def render_relpos(ctx: Context, res: RelativePositionBiasResult) -> None:
    """Each head's learned bias by query-to-key offset, for a chosen block, and the class token's biases apart."""
    import pandas as pd

    st.subheader(VIEWS["relpos"].heading)
    layers = res.bias.shape[0]
    shared = layers == 1 or res.shared_by_all_blocks()
    layer = 0 if shared else st.slider("Block", 1, layers, 1, key="relpos-layer") - 1
    fig = figures.relpos_figure(res, layer=None if shared else layer)
    st.plotly_chart(fig, key="relpos-fig")
    gh, gw = res.grid
    st.caption(f"Each cell is what a head adds to a query patch's attention score (in logits, before the softmax) for "
               f"the key patch dy rows below and dx columns right of it, the same wherever the query sits on the "
               f"{gh}x{gw} grid (checked). Read from {res.sources[layer]}.")
    if res.prefix_labels:
        st.caption(f"The {listed_some(list(res.prefix_labels), 4)} token has no place on the grid: its biases, one "
                   "number per head and pair (query -> key), the same for every patch:")
        st.dataframe(round_significant(pd.DataFrame(res.prefix_rows(layer))), hide_index=True)
    downloads(res, fig, "relative_position_bias")


def render_position_table(ctx: Context) -> None:
    """The learned table's similarity tiles on a grid the boxes set, one patch's tile shown large beside it."""
    spec = ctx.m.spec
    c = st.columns(4)
    gh = int(c[0].number_input("Grid rows", 1, 64, spec.grid[0], key="gh", on_change=recentre))
    gw = int(c[1].number_input("Grid columns", 1, 64, spec.grid[1], key="gw", on_change=recentre))
    res = position_result(ctx.m, ctx.mkey, (gh, gw))
    st.session_state.setdefault("pr", gh // 2)
    st.session_state.setdefault("pc", gw // 2)
    r = int(c[2].number_input("Patch row", 0, gh - 1, key="pr"))
    col = int(c[3].number_input("Patch column", 0, gw - 1, key="pc"))
    fig = figures.position_figure(res)
    left, right = st.columns([3, 2])
    left.plotly_chart(clickable_tiles(fig, res.grid, (r, col)), key="pos-fig", on_select=tile_clicked,
                      selection_mode="points")
    right.plotly_chart(figures.similarity_tile_figure(res, r, col), key="tile-fig")
    right.caption("Click a tile on the left (the one shown here is outlined), or set the patch row and column "
                  "above.")
    downloads(res, fig, "position_similarity")
