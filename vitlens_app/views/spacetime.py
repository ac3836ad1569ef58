"""The space-time pages of a video model (issue 50; docs/definitions.md, "Video: ..."): the clip's attention
distance in space and in time with the uniform baselines (the space-time Fig. 7 right), its rollout as frames (a map
per frame or tubelet, the slider's frame over its own step's map), the position embeddings over space and time and
the tubelet embedding's filters. Each is a render function of a ``ClipContext`` (``vitlens_app.context``)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import streamlit as st

from vitlens import figures
from vitlens_app.caches import (spacetime_distance_result, spacetime_rollout_result, video_filters_result,
                                video_position_result)
from vitlens_app.context import ClipContext, downloads, figure_download
from vitlens_app.library import CLIP_PAGES, VIEWS


def render_spacetime_distance(ctx: ClipContext) -> None:
    """How far each head looks across the frame (pixels) and across frames (frames; seconds with a frame rate), beside
    what uniform attention over the same keys gives."""
    renorm = st.checkbox("Renormalise over cell keys (raw weights when off)", True, key="st-renorm")
    res = spacetime_distance_result(ctx.m, ctx.mkey, ctx.x, ctx.ckey, renorm, ctx.fps)
    fig = figures.spacetime_distance_figure(res)
    st.plotly_chart(fig, key="st-dist-fig")
    divided = "temporal" in res.roles
    rate = (f"; seconds at the sampled frames' rate, {ctx.fps:.3g} fps" if ctx.fps else
            "; the clip has no frame rate, so no seconds")
    st.caption(f"Spatial distance: pixels between cell centres over the keys of every time step (the clip's diagonal "
               f"{res.max_spatial_px:.1f} px at most); temporal distance: frames between time-step centres (the span "
               f"{res.max_temporal_frames:g} frames at most){rate}. Dashes: uniform attention over the map's cells"
               + (". Divided blocks: a temporal map's spatial distance and a spatial map's temporal distance are 0 "
                  "by construction." if divided else "."))
    table = res.to_pandas()
    st.dataframe(table.groupby(["block", "role"], sort=False).agg(
        spatial_px=("spatial_px", "mean"), baseline_spatial_px=("baseline_spatial_px", "first"),
        temporal_frames=("temporal_frames", "mean"), baseline_temporal_frames=("baseline_temporal_frames", "first"),
    ).reset_index(), hide_index=True)
    st.caption("Per block and map: the heads' mean, and the uniform baseline. Every head's numbers are in the CSV.")
    downloads(res, fig, "spacetime_distance")


def step_of(frame: int, frames: int, steps: int) -> int:
    """The time step (a frame, or a tubelet of frames / steps frames) frame ``frame`` of ``frames`` belongs to."""
    return min(frame * steps // max(frames, 1), steps - 1)


def render_spacetime_rollout(ctx: ClipContext) -> None:
    """The clip's rollout as frames: the slider's frame under its time step's map, then every step's map."""
    c = st.columns(2)
    fusion = c[0].selectbox("Head fusion", ["mean", "max", "min"], key="st-fusion")
    opacity = c[1].slider("Opacity", 0.0, 1.0, 0.5, 0.05, key="st-opacity")
    res = spacetime_rollout_result(ctx.m, ctx.mkey, ctx.x, ctx.ckey, fusion)
    steps = res.maps.shape[1]
    step = step_of(ctx.frame, len(ctx.shown), steps)
    tubelet = len(ctx.shown) // steps
    what = (f"time step {step} (frames {step * tubelet}-{(step + 1) * tubelet - 1})" if tubelet > 1
            else f"frame {step}")
    left, right = st.columns([2, 3])
    left.plotly_chart(figures.heatmap_overlay_figure(ctx.shown[ctx.frame], res.maps[0, step],
                                                     f"Rollout at {what}", opacity, scale_title="rollout"),
                      key="st-roll-frame")
    left.caption(f"Frame {ctx.frame} (the slider's) under the map of {what}, from the {res.source_token} through "
                 f"every block; colours from 0 to this step's maximum, {res.maps[0, step].max():.2f} of the clip's "
                 "(the steps beside it share one scale: the maps are divided by their maximum over the clip).")
    fig = figures.spacetime_rollout_figure(res, 0, frames=np.stack(ctx.shown), opacity=opacity)
    right.plotly_chart(fig, key="st-roll-fig")
    cols = st.columns(2)  # maps [clips, steps, gh, gw]: no table of rows, so JSON and the figure
    cols[0].download_button("Maps (JSON)", res.to_json().encode(), "spacetime_rollout.json", "application/json",
                            key="json-spacetime_rollout", on_click="ignore")
    figure_download(cols[1], fig, "spacetime_rollout")


def render_video_position(ctx: ClipContext) -> None:
    """The position embeddings' cosine similarity over time steps and over cells (or why the model has none)."""
    res = video_position_result(ctx.m, ctx.mkey)
    fig = figures.video_position_figure(res)
    st.plotly_chart(fig, key="st-pos-fig")
    st.caption(res.summary())
    downloads(res, fig, "video_position")


def render_tubelet_filters(ctx: ClipContext) -> None:
    """The patch embedding's filters' principal components, one column per time step of a tubelet."""
    kept = min(28, ctx.m.spec.embed_dim)  # the paper's 28, at most one per filter
    k = int(st.slider("Components shown", 1, kept, min(8, kept), key="st-filters-k"))
    res = video_filters_result(ctx.m, ctx.mkey, kept)
    fig = figures.tubelet_filters_figure(res, components=k)
    st.plotly_chart(fig, key="st-filters-fig", width="content")  # the figure's own width: its cells side by side
    shown = 100 * float(np.sum(res.explained_variance_ratio[:k]))
    # the components drawn, as the title counts them (the summary's are all those computed)
    st.caption(f"The top {k} of the {len(res.components)} components computed from the {res.n_filters} tubelet "
               f"filters: {shown:.1f}% of their variance ({100 * float(np.sum(res.explained_variance_ratio)):.1f}% "
               f"for all {len(res.components)}), over {res.components.shape[1]} time steps.")
    figure_download(st, fig, "tubelet_filters")


#: the page written for each registered view of a clip (``View.shown_in == CLIP_PAGES``), by the view's name
PAGES: dict[str, Callable[[ClipContext], None]] = {
    "spacetime_distance": render_spacetime_distance, "spacetime_rollout": render_spacetime_rollout,
    "video_position": render_video_position, "video_filters": render_tubelet_filters}


def video_pages() -> dict[str, Callable[[ClipContext], None]]:
    """The clip's pages by their selector labels: the registered views shown among a clip's pages, in the registry's
    order, labelled as the registry labels them (read now: a view registered later gets a page that says where its
    numbers are)."""
    def unwritten(name: str) -> Callable[[ClipContext], None]:
        return lambda ctx: st.info(f"{VIEWS[name].title}: no page is written for it yet; its numbers are in "
                                   f"vl.analyze(m, clip, views=({name!r},)).")
    return {(v.label or name): PAGES.get(name, unwritten(name)) for name, v in VIEWS.items()
            if v.shown_in == CLIP_PAGES}
