"""The Attention maps page: the rollout of the current image (Fig. 6), then one query's attention per head
(a patch, the class token or an attention pool's probe; a hierarchical model's query in its window)."""
from __future__ import annotations

import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app import kind_choices
from vitlens_app.caches import has_pool_attention, maps_result, parked_result, rollout_result, window_maps_result
from vitlens_app.context import Context, downloads
from vitlens_app.library import (counted, listed_some, model_windows, prefix_labels, query_label,
                                 query_window_attention, whole_maps_fit, whole_maps_mb)


def render_window_maps(ctx: Context, opacity: float) -> None:
    """One query's attention in a hierarchical model: the window it attends in the block picked, per head."""
    st.subheader("One query's attention")
    windows = model_windows(ctx.m)
    c = st.columns(3)
    layer = c[0].slider("Block", 1, len(windows), 1, key="layer") - 1
    g = windows[layer]
    pooled = g.key_index is not None  # pooling attention (MViT v2, Hiera): the keys on a grid of their own
    keys = (f"its keys on a {g.keys_grid[0]}x{g.keys_grid[1]} grid (the map below is on that grid)" if pooled
            else f"windows of {g.window_tokens} tokens")
    st.caption(f"Block {layer + 1}: stage {g.stage + 1}, {g.kind} attention over a {g.grid[0]}x{g.grid[1]} grid of "
               f"{g.stride_px[0]} px tokens, {keys}.")
    row = int(c[1].number_input("Query row", 0, g.grid[0] - 1, g.grid[0] // 2, key="qr"))
    col = int(c[2].number_input("Query column", 0, g.grid[1] - 1, g.grid[1] // 2, key="qc"))
    maps = window_maps_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key)
    head_maps = query_window_attention(maps[layer], g, min(row, g.grid[0] - 1), min(col, g.grid[1] - 1))
    # the query outlined where the map is on its own grid (a pooling block's map is on its keys' finer grid)
    st.plotly_chart(figures.heads_figure(ctx.shown, head_maps, layer, query_label(row, col), opacity,
                                         patch=None if pooled else (row, col)), key="heads-fig")


def render_maps(ctx: Context) -> None:
    """The rollout, then one query's maps per head (or all heads), as the model's kind allows."""
    spec = ctx.m.spec
    c = st.columns(3)
    fusion = c[0].selectbox("Head fusion", ["mean", "max", "min"], key="fusion")
    discard = c[1].slider("Discard ratio", 0.0, 0.95, 0.0, 0.05, key="discard")
    opacity = c[2].slider("Opacity", 0.0, 1.0, 0.5, 0.05, key="opacity")
    pool = has_pool_attention(ctx.m)
    # small models: every query's maps at once (one computation for every query picked); high resolution:
    # the picked query's rows only, computed a block of rows at a time (vitlens.views.attention_maps)
    whole = whole_maps_fit(spec)
    source = None
    if pool:  # a MAP head: its probe's row may stand in for a class token's
        default_row = "class token" if spec.has_class_token else "mean over patch tokens"
        row_choice = st.radio("Rollout row", [default_row, "attention pool"], horizontal=True, key="roll-source",
                              index=0 if spec.has_class_token else 1)
        source = "pool" if row_choice == "attention pool" else None
    if not kind_choices.rollout_discards(spec) and discard:
        st.info("The discard ratio is defined for a ViT's maps over one sequence of tokens; this model's rollout "
                "uses 0.")
        discard = 0.0
    roll = rollout_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, fusion, discard, source)
    fig = figures.rollout_figure(roll, ctx.shown, 0, opacity)
    st.plotly_chart(fig, key="rollout-fig")
    downloads(roll, fig, "rollout")
    if kind_choices.maps_by_window(spec):
        # the model's own path (its windows, mergings, poolings or stage embeddings), as the result states it
        st.caption(f"Rolled out from the {roll.source_token.removeprefix('the ')} (docs/definitions.md).")
        render_window_maps(ctx, opacity)
        return
    if kind_choices.maps_of_class_attention(spec):
        st.caption("Rolled out from the class token at the last class-attention layer back through the "
                   "class-attention layers, then through the self-attention blocks over the patches "
                   "(docs/definitions.md, CaiT).")
        st.info("One query's per-head maps are not offered for a CaiT: its self-attention blocks attend over the "
                "patches alone and its class-attention layers hold one query, the class token; every block's maps "
                "are in vl.capture_attention.")
        return
    render_query_maps(ctx, opacity, pool, whole)


def render_query_maps(ctx: Context, opacity: float, pool: bool, whole: bool) -> None:
    """One query's attention per head over one sequence of tokens: a patch, the class token or the pool's probe;
    every query's maps at once when they fit (``whole``), else the picked query's rows."""
    spec = ctx.m.spec
    st.subheader("One query's attention")
    maps = maps_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key) if whole else None
    parked = maps.parked_heads(prefix_labels(spec)) if maps is not None else \
        parked_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key)
    if not whole:
        st.caption(f"Every query's maps of this image would take {whole_maps_mb(spec):,.0f} MB, so the "
                   "view computes the picked query's rows only (a block of query rows at a time); each new "
                   "query is one more forward.")
    if parked:
        st.warning(f"{counted(len(parked), 'head')} park{'s' if len(parked) == 1 else ''} more than half their "
                   "attention on a prefix token in this image ("
                   + listed_some([f"layer {p['layer']} head {p['head']}: {100 * p['share']:.0f}% on {p['token']}"
                                  for p in parked], 6) + "); rollout counts that mass, though no patch earned it.")
    c = st.columns(4)
    kinds = (["class token"] if spec.has_class_token else []) + ["patch"] + \
        (["attention pool"] if pool else [])  # a MAP head's probe over the tokens
    query_kind = c[1].radio("Query", kinds, key="qkind")
    layer: int | None = None
    if query_kind != "attention pool":
        layer = c[0].slider("Layer", 1, spec.num_layers, 1, key="layer") - 1
    row = col = None
    if query_kind == "patch":
        row = int(c[2].number_input("Query row", 0, spec.grid[0] - 1, spec.grid[0] // 2, key="qr"))
        col = int(c[3].number_input("Query column", 0, spec.grid[1] - 1, spec.grid[1] // 2, key="qc"))
    token = vl.query_token(spec, row, col) if layer is not None else 0
    if maps is None:
        maps = maps_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, (token,))
    if layer is None:
        label = "the pool's probe"
        head_maps = maps.pool_attention(0)
        st.caption("The attention pool (MAP head) pools the image: its probe query's attention over the patch "
                   "tokens, after the last block (the model's output is untouched).")
    else:
        label = query_label(row, col)
        head_maps = maps.query_attention(layer, token)
    head = st.selectbox("Head", ["all heads"] + [f"head {h + 1}" for h in range(len(head_maps))], key="head")
    patch = (row, col) if query_kind == "patch" else None  # outlined on the maps: where the query sits
    if head == "all heads":
        st.plotly_chart(figures.heads_figure(ctx.shown, head_maps, layer, label, opacity, patch=patch),
                        key="heads-fig")
    else:
        st.plotly_chart(figures.head_figure(ctx.shown, head_maps, layer, int(head.split()[1]) - 1, label, opacity,
                                            patch=patch), key="head-fig")
