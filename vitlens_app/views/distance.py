"""The Attention distance page (Fig. 11): each head's mean attention distance by depth, the attention parked on
prefix tokens beside it, and which heads matter (head importance, on demand)."""
from __future__ import annotations

import streamlit as st

from vitlens import figures
from vitlens_app import kind_choices
from vitlens_app.caches import distance_result, head_result
from vitlens_app.context import Context, downloads, image_count, whole_table
from vitlens_app.library import counted, distance_reading, head_cost, listed_some
from vitlens_app.library import WindowedDistanceResult


def render_distance(ctx: Context) -> None:
    """The distance over the images picked, its reading, the prefix tokens' share and the head importance."""
    c = st.columns(2)
    n = image_count(c[0], len(ctx.images), "n-dist")
    renorm = c[1].checkbox("Renormalise over patch keys (raw weights when off)", True, key="renorm")
    res = distance_result(ctx.m, ctx.mkey, ctx.images[:n], f"{ctx.ikey}-{n}", renorm)
    if kind_choices.distance_by_stage(ctx.m.spec):
        render_windowed_distance(ctx, res.distance)
        return
    fig = figures.distance_figure(res.distance)
    left, right = st.columns([3, 2])
    left.plotly_chart(fig, key="dist-fig")
    left.markdown(distance_reading(res.distance, ctx.m.spec.name, ctx.m.weights))
    if kind_choices.distance_without_prefix(ctx.m.spec):  # CaiT: the self-attention blocks; no prefix token keys
        right.info(f"The self-attention blocks attend over the patches alone (no prefix token); "
                   f"{res.distance.note}.")
        downloads(res.distance, fig, "attention_distance")
        return
    if res.prefix.labels:
        right.plotly_chart(figures.prefix_figure(res.prefix), key="prefix-fig")
        parked = res.prefix.parked()
        right.caption(f"{counted(len(parked), 'head')} park{'s' if len(parked) == 1 else ''} more than half "
                      "their attention on a prefix token"
                      + (": " + listed_some([f"L{p['layer']}H{p['head']}" for p in parked], 8) if parked else "")
                      + ". With raw weights such heads would look local; renormalising over patch keys discounts it.")
    else:
        right.info("No prefix tokens: every token is a patch, so no attention is parked outside the image.")
    downloads(res.distance, fig, "attention_distance")
    # a keyed expander whose state the server keeps: it stays open across the run that brings the result
    with st.expander("Which heads matter? (removes one head at a time; costly)", key="heads-exp",
                     expanded=bool(st.session_state.get("heads-on")), on_change="rerun"):
        k = min(n, 16)
        st.caption(f"Mean-ablation of each of the {ctx.m.spec.num_layers * ctx.m.spec.num_heads} heads on {k} images: "
                   f"{head_cost(ctx.m, k)} image forwards.")
        if ctx.m.spec.num_classes and st.checkbox("Compute head importance", key="heads-on"):
            imp = head_result(ctx.m, ctx.mkey, ctx.images[:k], f"{ctx.ikey}-{k}", ctx.labels)
            st.plotly_chart(figures.head_importance_figure(imp, res.distance), key="heads-imp-fig")
            st.caption(imp.summary())


#: a table longer than this is folded under its title
LONG_TABLE_ROWS = 48


def render_windowed_distance(ctx: Context, d: WindowedDistanceResult) -> None:
    """A hierarchical model's distance: every block's heads coloured by stage beside each window's uniform
    distance, the reading per stage, and the numbers of the stage picked."""
    fig = figures.distance_figure(d)
    st.plotly_chart(fig, key="dist-fig")
    st.markdown(distance_reading(d, ctx.m.spec.name, ctx.m.weights))
    stages = [f"stage {s + 1}" for s in sorted(set(d.stages.tolist()))]
    picked = st.radio("Stage", ["all stages"] + stages, horizontal=True, key="dist-stage")
    frame = d.to_pandas()
    if picked != "all stages":
        frame = frame[frame["stage"] == int(picked.split()[1])]
    # every block and head of the stages picked, no scroll box; folded when long (a Swin's ~200 rows made a
    # 6,581-px page under the chart)
    with st.expander(f"The numbers ({len(frame)} rows)", expanded=len(frame) <= LONG_TABLE_ROWS):
        whole_table(frame.round(3), "attention")
    downloads(d, fig, "attention_distance")
