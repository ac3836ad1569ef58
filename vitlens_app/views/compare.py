"""The Compare page (Fig. 11): a second model beside the first, its attention distance over the same images,
rollout on the current image, and layer-by-layer representation similarity (CKA)."""
from __future__ import annotations

import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app.caches import distance_result, load_model, remembered, rollout_result
from vitlens_app.context import Context, downloads, figure_download, image_count, whole_table
from vitlens_app.library import comparison
from vitlens_app.sidebar import model_picker


def render_compare(ctx: Context) -> None:
    """The second model's picker, then the two tabs."""
    st.caption("A second model beside the first (Fig. 11): attention distance over the same images, "
               "rollout on the current image, and how similar their representations are layer by layer (CKA).")
    other = model_picker("m2", "ref-hybrid" if ctx.m.spec.name != "ref-hybrid" else "ref-vit")
    if other is None:
        return
    m2 = load_model(*other)
    n = image_count(st, len(ctx.images), "n-cmp")
    distance_tab, cka_tab = st.tabs(["Attention distance", "Representation similarity (CKA)"])
    with distance_tab:
        render_compare_distance(ctx, m2, other, n)
    with cka_tab:
        render_cka(ctx, m2, f"{other}", n)


def render_cka(ctx: Context, m2: vl.LoadedModel, m2key: str, n: int) -> None:
    """Linear CKA between the two models' layers over the first ``n`` images, by the token policy picked."""
    if n < 4:
        st.info("CKA needs at least 4 images.")
        return
    policy = st.radio("Tokens", ["mean", "cls", "patches"], horizontal=True, key="cka-policy",
                      help="mean of the patch tokens, the class token, or every patch token on a matched grid")
    try:
        res = remembered("cka_memo", (ctx.mkey, m2key, ctx.ikey, n, policy), lambda progress: vl.cka(
            ctx.m, m2, ctx.images[:n], token_policy=policy, batch_size=min(32, max(4, n // 2)), progress=progress),
            f"CKA over {n} images", n)
    except vl.UnsupportedModelError as e:  # a hierarchical model or a CaiT: its own tab says so, the rest stays
        st.info(e.message_for("app"))
        return
    fig = figures.cka_figure(res)
    st.plotly_chart(fig, key="cka-fig")
    st.caption(res.summary())
    downloads(res, fig, "cka")


def render_compare_distance(ctx: Context, m2: vl.LoadedModel, other: tuple, n: int) -> None:
    """Both models' attention distance by depth on one figure, its reading and table, and both rollouts."""
    d1 = distance_result(ctx.m, ctx.mkey, ctx.images[:n], f"{ctx.ikey}-{n}", True).distance
    d2 = distance_result(m2, f"{other}", ctx.images[:n], f"{ctx.ikey}-{n}", True).distance
    data = comparison([d1, d2], [ctx.m.spec.name, m2.spec.name], weights=[ctx.m.weights, m2.weights],
                      kinds=[ctx.m.spec.kind, m2.spec.kind])
    if data.units == "width":
        st.info("The models see inputs of different widths: distances are in units of the image width.")
    distance_fig = figures.distance_figure(data.distances, names=data.models, units=data.units)
    st.plotly_chart(distance_fig, key="cmp-fig")
    st.markdown(data.reading())
    local = data.local_statement()
    st.caption(f"Layer 1, median head: {m2.spec.name} / {ctx.m.spec.name} = {data.layer1_median_ratio():.2f}. "
               f"{local[:1].upper()}{local[1:]}.")
    st.caption(f"Attention distance per layer over heads, in {data.unit_label()}.")
    whole_table(data.table_with_units().round(3), "model")  # every layer of both models, no scroll box
    r1 = rollout_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, "mean", 0.0)
    r2 = rollout_result(m2, f"{other}", ctx.current, ctx.cur_key, "mean", 0.0)
    rollout_fig = figures.overlay_grid_figure(
        [(ctx.shown, r1.maps[0], ctx.m.spec.name), (m2.display([ctx.current])[0], r2.maps[0], m2.spec.name)],
        "Attention rollout on the same image")
    st.plotly_chart(rollout_fig, key="cmp-roll")
    cols = st.columns(4)
    cols[0].download_button("Comparison (JSON)", data.to_json().encode(), "compare.json", "application/json",
                            on_click="ignore")
    cols[1].download_button("Per-layer table (CSV)", data.to_csv(), "compare_layers.csv", "text/csv",
                            on_click="ignore")
    figure_download(cols[2], distance_fig, "compare_distance", "Distances")
    figure_download(cols[3], rollout_fig, "compare_rollout", "Rollout")
