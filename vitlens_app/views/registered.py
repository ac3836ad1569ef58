"""The page of a registered view that has no page written for it (``vitlens.views.registry``)."""
from __future__ import annotations

from typing import Callable

import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app.caches import remembered
from vitlens_app.context import Context, downloads, image_count
from vitlens_app.library import VIEWS


def render_registered(name: str) -> Callable[[Context], None]:
    """The page of a registered view that has no page written for it: its figure over the image set
    and its numbers (``vitlens.views.registry``), from one ``analyze`` pass."""
    view = VIEWS[name]

    def render(ctx: Context) -> None:
        k = image_count(st, len(ctx.images), f"{name}-n")
        result = remembered("view_memo", (ctx.mkey, ctx.ikey, k, name), lambda progress: vl.analyze(
            ctx.m, ctx.images[:k], batch_size=16, progress=progress, views=(name,)).view(name),
            f"{view.title} over {k} images", k)
        if result is None:
            st.info(f"{view.title} is not available for this model.")
            return
        fig = figures.figure_for(result, [ctx.shown])
        st.plotly_chart(fig, key=f"{name}-fig")
        st.dataframe(result.to_pandas(), hide_index=True)
        downloads(result, fig, name)
    return render
