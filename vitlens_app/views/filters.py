"""The Filters page (Fig. 7 left): the principal components of the patch embedding's filters."""
from __future__ import annotations

import streamlit as st

from vitlens import figures
from vitlens_app import kind_choices
from vitlens_app.caches import filters_result
from vitlens_app.context import Context, downloads
from vitlens_app.library import max_filter_components


def render_filters(ctx: Context) -> None:
    """The top principal components of the embedding filters, and how much of the variance they explain."""
    limit = max_filter_components(ctx.m)
    k = st.slider("Principal components", 1, min(64, limit), min(28, limit), key="k")
    res = filters_result(ctx.m, ctx.mkey, k)
    if kind_choices.filters_read_the_cnn(ctx.m.spec):
        st.info("Hybrid model: its patch embedding acts on CNN channels, so this view shows the CNN's first "
                f"convolution ({res.module}).")
    fig = figures.filters_figure(res)
    st.plotly_chart(fig, key="filters-fig")
    st.caption(f"Explained variance of the top {k}: {100 * res.explained_variance_ratio.sum():.1f}%. "
               "The sign of each component is arbitrary.")
    downloads(res, fig, "filters")
