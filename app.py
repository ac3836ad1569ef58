"""vitlens app: explore the views of the ViT paper (ICLR 2021, section 4.5) for a Vision Transformer.

Run: streamlit run app.py   (opens on the embedded reference ViT and held-out shape scenes; offline)

Layout and widgets only: every number and figure comes from the ``vitlens`` library. Each view
is one render function of a ``Context`` (model, images, current image), dispatched from ``PAGES``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import plotly.graph_objects as go
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

import vitlens as vl
from vitlens import figures
from vitlens.attribution import METHOD_TABLE, ComparisonTable, compare_methods
from vitlens.attribution.faithfulness import timing_note
from vitlens.attribution.methods import methods_for, preselected_methods
from vitlens.attribution.metrics import METRIC_TABLE, default_metrics, metric_label
from vitlens.attribution.sanity import sanity_table, verdict_rule
from vitlens.attribution.text import has_text_tower
from vitlens.uploads import UploadFolder
from vitlens.images import APP_MAX_SIDE_PX, MAX_UPLOAD_MB, SAMPLE_NAMES, UPLOAD_TYPES, read_uploads
from vitlens.loading.presets import PRESETS
from vitlens.loading.seeded import load_model_seeded
from vitlens.reference.shapes import HELD_OUT_SEED, generate, scene_names
from vitlens.report.data import comparison, distance_reading
from vitlens.report.export import browser_path, figure_html, figure_png
from vitlens.words import counted, listed_some
from vitlens.report.html import attribution_figures
from vitlens.results import round_significant
from vitlens.compare.heads import cost as head_cost
from vitlens.fair_lock import FairLock
from vitlens.progress import time_left
from vitlens.families.pooling import capture_pool_attention
from vitlens.views import attention_maps as maps_view, windowed
from vitlens.views.attention_maps import query_label
from vitlens.views.filters import max_filter_components
from vitlens.views.prefix import prefix_labels
from vitlens.views.registry import VIEWS as REGISTRY
from vitlens.views.rollout import format_probability

MODEL_SOURCES = ["Embedded", "Preset", "Name", "Checkpoint"]
DEVICES = ["auto", "cpu", "cuda"]
PNG_EXPORT = browser_path() is not None  # the browser kaleido would use, found as kaleido finds it


# ---------------------------------------------------------------- cached models and results
def session_id() -> str:
    """The browser session running this script (names the holder in the heavy lock's log)."""
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else threading.current_thread().name


@st.cache_resource
def heavy_lock() -> FairLock:
    """One heavy computation at a time across sessions: two tabs must not thrash 2 cores. Served in the
    order asked (a session waits for at most one computation of each other session); VITLENS_LOCK_LOG=PATH
    logs every hold (analyses/app_load.py reads it)."""
    return FairLock.from_env(owner=session_id)


@st.cache_resource(max_entries=2, show_spinner="Loading model ...")
def load_model(name: str, pretrained: bool, arch: str | None, device: str) -> vl.LoadedModel:
    """Cached by (name, pretrained, arch, device), and the results beside it by the same key: random-init
    weights are seeded (``RANDOM_INIT_SEED``, as the CLI's ``--seed``), so a model evicted and loaded again
    is the model those results were computed on."""
    with heavy_lock():
        return load_model_seeded(name, pretrained=pretrained, arch=arch or None, device=None if device == "auto" else device)


@st.cache_data(max_entries=16, show_spinner=False)
def filters_result(_m: vl.LoadedModel, mkey: str, k: int) -> vl.FilterPCAResult:
    return vl.embedding_filter_pca(_m, n_components=k)


# 4, not 16: one entry is (gh * gw)^2 float64 similarities, 128 MB at the 64 x 64 grid the boxes allow
@st.cache_data(max_entries=4, show_spinner=False)
def position_result(_m: vl.LoadedModel, mkey: str, grid: tuple[int, int]) -> vl.PositionSimilarityResult:
    return vl.position_similarity(_m, grid=grid)


@st.cache_data(max_entries=4, show_spinner=False)
def relpos_result(_m: vl.LoadedModel, mkey: str) -> tuple[vl.RelativePositionBiasResult | None, str]:
    """The learned relative-position bias by offset, or None and why the model has none (weights only: no lock)."""
    try:
        return vl.relative_position_bias(_m), ""
    except vl.ViewNotAvailableError as e:
        return None, e.message_for("app")


@st.cache_data(max_entries=32, show_spinner="Rolling out attention ...")
def rollout_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, fusion: str,
                   discard: float, source: str | None = None) -> vl.RolloutResult:
    with heavy_lock():
        return vl.attention_rollout(_m, [_image], head_fusion=fusion, discard_ratio=discard, source=source)


@st.cache_data(max_entries=8, show_spinner="Capturing attention ...")
def maps_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str,
                queries: tuple[int, ...] | None = None) -> vl.AttentionMapsResult:
    """Every query's maps of the image, or (``queries``) those queries' rows only (high resolution)."""
    with heavy_lock():
        return vl.attention_maps(_m, _image, queries=queries)


@st.cache_data(max_entries=8, show_spinner="Capturing the windows' attention ...")
def window_maps_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> list:
    """Every block's window maps of the image, for a hierarchical model (Swin)."""
    with heavy_lock():
        return windowed.window_maps(_m, _image)


@st.cache_data(max_entries=8, show_spinner="Measuring attention on prefix tokens ...")
def parked_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> list[dict]:
    """Heads parked on a prefix token, from the streaming prefix statistics (no whole map is kept)."""
    with heavy_lock():
        return vl.prefix_diagnostics(_m, [_image]).parked()


def has_pool_attention(m: vl.LoadedModel) -> bool:
    """Whether the model pools through an attention pool (a MAP head) whose attention can be shown: a pool
    capture session, under the heavy lock like every other hook session on a shared model (the session
    holds the model's own lock too)."""
    try:
        with heavy_lock(), capture_pool_attention(m):
            return True
    except vl.ViewNotAvailableError:
        return False


@st.cache_data(max_entries=32, show_spinner=False)  # attributed_table's bar says which method and the time left
def method_table(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, method: str, target: int | str | None,
                 params: tuple, _mask: np.ndarray | None, metrics: tuple[str, ...] | None = None) -> ComparisonTable:
    """One method's maps and its scores by ``metrics`` (names in ``METRIC_TABLE``) on the current image (cached per
    method and metrics)."""
    with heavy_lock():
        return compare_methods(_m, [_image], methods=[method], masks=_mask, target=target,
                               method_params={method: dict(params)}, metrics=metrics)


@st.cache_data(max_entries=64, show_spinner=False)
def predictions_result(_m: vl.LoadedModel, mkey: str, _x: Any, ikey: str) -> list[tuple[str, float]]:
    """The current image's top-5, under the heavy lock like every forward of a shared model: a forward in one
    session while another session's capture hooks the same model feeds its maps into that capture."""
    with heavy_lock():
        return _m.top_predictions(_x)


def remembered(name: str, key: tuple, compute: Callable[[Any], Any], what: str, total: int) -> Any:
    """A heavy result with a progress bar, remembered per session (a few entries per kind). The bar goes whatever
    happens: a refusal or a failure leaves its message, never a bar that looks like a job still running."""
    memo = st.session_state.setdefault(name, {})
    if key not in memo:
        bar = st.progress(0.0, text=f"{what} ...")
        start = time.perf_counter()

        def progress(done: int, n: int | None) -> None:
            left = time_left(time.perf_counter() - start, done, n or total)
            bar.progress(min(done / max(n or total, 1), 1.0),
                         text=f"{what}: {done}/{n or total}" + (f", {left}" if left else ""))

        try:
            with heavy_lock():
                memo[key] = compute(progress)
        finally:
            bar.empty()
        while len(memo) > 6:
            memo.pop(next(iter(memo)))
    return memo[key]


def distance_result(m: vl.LoadedModel, mkey: str, images: list, ikey: str, renormalize: bool) -> vl.AnalysisResult:
    """Attention distance and the attention on prefix tokens, from one pass over the images (a hierarchical
    model has no prefix tokens: its distance alone, per block and stage)."""
    views = ("distance",) if m.spec.kind in ("hierarchical", "class-attention") else ("distance", "prefix")
    return remembered("distance_memo", (mkey, ikey, len(images), renormalize), lambda progress: vl.analyze(
        m, images, batch_size=16, renormalize=renormalize, progress=progress, views=views),
        f"Attention distance over {len(images)} images", len(images))


def head_result(m: vl.LoadedModel, mkey: str, images: list, ikey: str, labels: np.ndarray | None) -> Any:
    k = len(images)
    return remembered("heads_memo", (mkey, ikey, k), lambda progress: vl.head_importance(
        m, images, labels=None if labels is None else labels[:k], batch_size=64, progress=progress),
        f"Head importance ({head_cost(m, k)} image forwards)", head_cost(m, k))


@st.cache_data(max_entries=4, show_spinner=False)
def held_out_scenes(n: int) -> tuple[list, list[str], np.ndarray, np.ndarray]:
    """The first ``n`` held-out reference scenes as PIL images, with names, object masks and labels."""
    from PIL import Image

    data = generate(n, seed=HELD_OUT_SEED)
    return [Image.fromarray(a) for a in data.images], scene_names(data.labels), data.masks, data.labels


# ---------------------------------------------------------------- what every view is given
@dataclass
class Context:
    """What a view renders from: the model, the image set and the current image."""

    m: vl.LoadedModel
    mkey: str
    images: list
    names: list[str]
    ikey: str
    masks: np.ndarray | None
    labels: np.ndarray | None
    index: int
    shown: np.ndarray  # the current image as the model sees it, uint8 [H, W, 3]

    @property
    def current(self) -> Any:
        return self.images[self.index]

    @property
    def cur_key(self) -> str:
        return f"{self.ikey}-{self.index}"


def show_error(e: Exception) -> None:
    """A message a person can act on; never a traceback."""
    if isinstance(e, vl.VitlensError):
        st.error(e.message_for("app"))
    else:
        st.error(f"Something went wrong ({type(e).__name__}: {e}). Try other settings; the app keeps working.")


def figure_download(where: Any, fig: Any, stem: str, label: str = "Figure") -> None:
    """A figure's download through the command line's export path (``vitlens.report.export``): PNG when
    Chromium is there for kaleido, self-contained HTML otherwise; made only when clicked."""
    if PNG_EXPORT:
        where.download_button(f"{label} (PNG)", lambda: figure_png(fig), f"{stem}.png", "image/png",
                              key=f"png-{stem}", on_click="ignore")
    else:
        where.download_button(f"{label} (HTML)", lambda: figure_html(fig), f"{stem}.html", "text/html",
                              key=f"html-{stem}", on_click="ignore")


def downloads(result: vl.Result, fig: Any, stem: str) -> None:
    cols = st.columns(3)
    cols[0].download_button("Numbers (CSV)", result.to_csv(), f"{stem}.csv", "text/csv", key=f"csv-{stem}",
                            on_click="ignore")
    cols[1].download_button("Numbers (JSON)", result.to_json().encode(), f"{stem}.json", "application/json",
                            key=f"json-{stem}", on_click="ignore")
    figure_download(cols[2], fig, stem)


def whole_table(frame: Any, name_column: str = "method") -> None:
    """A table shown whole: every row (no scroll box of ten) and its name column wide enough for the
    longest name ("integrated_gradients" was cut to "integrated_gradi…")."""
    longest = max((len(str(v)) for v in frame[name_column]), default=0) if name_column in frame else 0
    config = {name_column: st.column_config.TextColumn(name_column, width=max(80, 8 * longest + 24))} if longest else None
    st.dataframe(frame, hide_index=True, height="content", column_config=config)


def image_count(where: Any, available: int, key: str) -> int:
    """How many images to average over (a slider needs at least two choices)."""
    if available == 1:
        where.caption("1 image")
        return 1
    return int(where.slider("Images", 1, available, min(available, 32), key=key))


# ---------------------------------------------------------------- the views
def render_filters(ctx: Context) -> None:
    limit = max_filter_components(ctx.m)
    k = st.slider("Principal components", 1, min(64, limit), min(28, limit), key="k")
    res = filters_result(ctx.m, ctx.mkey, k)
    if ctx.m.spec.kind == "hybrid":
        st.info("Hybrid model: its patch embedding acts on CNN channels, so this view shows the CNN's first "
                f"convolution ({res.module}).")
    fig = figures.filters_figure(res)
    st.plotly_chart(fig, key="filters-fig")
    st.caption(f"Explained variance of the top {k}: {100 * res.explained_variance_ratio.sum():.1f}%. "
               "The sign of each component is arbitrary.")
    downloads(res, fig, "filters")


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


def render_relpos(ctx: Context, res: vl.RelativePositionBiasResult) -> None:
    """Each head's learned bias by query-to-key offset, for a chosen block, and the class token's biases apart."""
    import pandas as pd

    st.subheader(REGISTRY["relpos"].heading)
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


def render_distance(ctx: Context) -> None:
    c = st.columns(2)
    n = image_count(c[0], len(ctx.images), "n-dist")
    renorm = c[1].checkbox("Renormalise over patch keys (raw weights when off)", True, key="renorm")
    res = distance_result(ctx.m, ctx.mkey, ctx.images[:n], f"{ctx.ikey}-{n}", renorm)
    if ctx.m.spec.kind == "hierarchical":
        render_windowed_distance(ctx, res.distance)
        return
    fig = figures.distance_figure(res.distance)
    left, right = st.columns([3, 2])
    left.plotly_chart(fig, key="dist-fig")
    left.markdown(distance_reading(res.distance, ctx.m.spec.name, ctx.m.weights))
    if ctx.m.spec.kind == "class-attention":  # CaiT: the self-attention blocks; no prefix token among their keys
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


def render_windowed_distance(ctx: Context, d: vl.WindowedDistanceResult) -> None:
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
    whole_table(frame.round(3), "attention")  # every block and head of the stages picked, no scroll box
    downloads(d, fig, "attention_distance")


def render_window_maps(ctx: Context, opacity: float) -> None:
    """One query's attention in a hierarchical model: the window it attends in the block picked, per head."""
    st.subheader("One query's attention")
    windows = windowed.model_windows(ctx.m)
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
    head_maps = windowed.query_window_attention(maps[layer], g, min(row, g.grid[0] - 1), min(col, g.grid[1] - 1))
    # the query outlined where the map is on its own grid (a pooling block's map is on its keys' finer grid)
    st.plotly_chart(figures.heads_figure(ctx.shown, head_maps, layer, query_label(row, col), opacity,
                                         patch=None if pooled else (row, col)), key="heads-fig")


def render_maps(ctx: Context) -> None:
    spec = ctx.m.spec
    c = st.columns(3)
    fusion = c[0].selectbox("Head fusion", ["mean", "max", "min"], key="fusion")
    discard = c[1].slider("Discard ratio", 0.0, 0.95, 0.0, 0.05, key="discard")
    opacity = c[2].slider("Opacity", 0.0, 1.0, 0.5, 0.05, key="opacity")
    pool = has_pool_attention(ctx.m)
    # small models: every query's maps at once (one computation for every query picked); high resolution:
    # the picked query's rows only, computed a block of rows at a time (vitlens.views.attention_maps)
    whole = maps_view.whole_maps_mb(spec) <= maps_view.WHOLE_MAPS_MB
    source = None
    if pool:  # a MAP head: its probe's row may stand in for a class token's
        default_row = "class token" if spec.has_class_token else "mean over patch tokens"
        row_choice = st.radio("Rollout row", [default_row, "attention pool"], horizontal=True, key="roll-source",
                              index=0 if spec.has_class_token else 1)
        source = "pool" if row_choice == "attention pool" else None
    if spec.kind in ("hierarchical", "class-attention") and discard:
        st.info("The discard ratio is defined for a ViT's maps over one sequence of tokens; this model's rollout "
                "uses 0.")
        discard = 0.0
    roll = rollout_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, fusion, discard, source)
    fig = figures.rollout_figure(roll, ctx.shown, 0, opacity)
    st.plotly_chart(fig, key="rollout-fig")
    downloads(roll, fig, "rollout")
    if spec.kind == "hierarchical":
        st.caption("Rolled out through the windows and the patch mergings (or poolings), from the mean of the last "
                   "stage's tokens to the first stage's grid (docs/definitions.md).")
        render_window_maps(ctx, opacity)
        return
    if spec.kind == "class-attention":
        st.caption("Rolled out from the class token at the last class-attention layer back through the "
                   "class-attention layers, then through the self-attention blocks over the patches "
                   "(docs/definitions.md, CaiT).")
        st.info("One query's per-head maps are not offered for a CaiT: its self-attention blocks attend over the "
                "patches alone and its class-attention layers hold one query, the class token; every block's maps "
                "are in vl.capture_attention.")
        return
    st.subheader("One query's attention")
    maps = maps_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key) if whole else None
    parked = maps.parked_heads(prefix_labels(spec)) if maps is not None else \
        parked_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key)
    if not whole:
        st.caption(f"Every query's maps of this image would take {maps_view.whole_maps_mb(spec):,.0f} MB, so the "
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


def render_attributions(ctx: Context) -> None:
    m = ctx.m
    text = has_text_tower(m)
    what = "the image's similarity to the prompt" if text else "the class probability"
    st.caption("Rollout shows where information was mixed; the other methods ask what supports "
               f"{'the prompt (the cosine similarity of image and text embeddings)' if text else 'one class'}. "
               "Deletion/insertion curves test each map: removing the patches it ranks first should make "
               f"{what} fall fast (low deletion AUC), inserting them should make it rise fast.")
    c = st.columns([3, 2, 1])
    offered = methods_for(m)  # the methods defined for the model's kind (Method.kinds), as vl.attribute accepts
    methods = c[0].multiselect("Methods", list(offered), default=list(preselected_methods(m)), key="methods")
    if m.spec.kind == "hierarchical":  # what the registry leaves out, and where the CAMs' maps sit
        left = [k for k in METHOD_TABLE if k not in offered]
        st.caption(f"{m.spec.name} is hierarchical (windowed attention on stages of coarser grids): "
                   f"{', '.join(left)} read a ViT's attention over one grid and are not defined for it. The CAMs map "
                   "the last stage's grid, coarser than the patch grid of the other methods.")
    names = m.label_names() or [f"class {i}" for i in range(m.spec.num_classes)]
    target: int | str | None = None
    if text:  # CLIP / SigLIP: explain the similarity to a prompt (vitlens.attribution.text)
        target = c[1].text_input("Prompt", "a photo of a dog", key="prompt").strip() or None
        if target is None:
            st.info("Type a prompt: the maps explain the image's similarity to it.")
            return
    elif m.spec.num_classes > 0:
        choice = c[1].selectbox("Target class", ["predicted"] + names, key="target")
        target = None if choice == "predicted" else names.index(choice)
    steps = int(c[2].number_input("IG steps", 2, 64, 16, key="ig-steps"))
    metrics = st.multiselect("Faithfulness metrics", list(METRIC_TABLE), default=list(default_metrics()),
                             key="metrics", help="; ".join(f"{k}: {mt.about}" for k, mt in METRIC_TABLE.items()))
    if not methods:
        st.info("Choose at least one method.")
        return
    mask = None if ctx.masks is None else ctx.masks[ctx.index: ctx.index + 1]
    table = attributed_table(ctx, methods, target, steps, mask, tuple(metrics))
    figs = attribution_figures(table, ctx.shown)  # the report's figures of the same table and image
    st.plotly_chart(figs["attributions"], key="attr-fig")
    shown = [k for k in metrics if k in figs]  # each chosen metric's curves, drawn from its METRIC_TABLE entry
    for k in shown:
        st.plotly_chart(figs[k], key=f"metric-fig-{k}")
    import pandas as pd

    whole_table(round_significant(pd.DataFrame(table.readable_rows())))  # labels; the CSV keeps the identifiers
    st.caption(timing_note()[:1].upper() + timing_note()[1:] + ".")  # what the two time columns time
    if table.protocols:  # no metric chosen: no protocol to name
        st.caption("Protocols (protocol, ordering): " + "; ".join(f"{metric_label(k)}: {v}"
                                                                   for k, v in table.protocols.items()))
    if not text:
        from vitlens.attribution.lrp_ledger import lrp_methods

        for method in (mt for mt in lrp_methods() if mt in methods):  # AttnLRP and its variants
            render_ledger(ctx, target, method)
    cols = st.columns(3 + len(shown))
    cols[0].download_button("Scores (CSV)", table.to_csv(), "attributions.csv", "text/csv", on_click="ignore")
    cols[1].download_button("Maps and scores (JSON)", table.to_json().encode(), "attributions.json",
                            "application/json", on_click="ignore")
    figure_download(cols[2], figs["attributions"], "attributions", "Maps")
    for col, k in zip(cols[3:], shown):
        figure_download(col, figs[k], k, metric_label(k))  # the short name: the title was cut in a narrow column
    if text:
        st.caption(NO_TEXT_SANITY)
    elif st.toggle("Sanity check: randomise the weights from the top block down", key="sanity"):
        render_sanity(ctx, methods, target)


#: why the Attributions view of a CLIP / SigLIP model offers no sanity check
NO_TEXT_SANITY = ("No sanity check for a model with a text tower: the cascade (Adebayo et al. 2018) re-initialises "
                  "a classifier's head and then its blocks, and a prompt's model has no classifier head to start "
                  "from (its text tower would be randomised as the \"head\"), so `vl.sanity_table` explains "
                  "classes only.")


def attributed_table(ctx: Context, methods: list[str], target: int | str | None, steps: int,
                     mask: np.ndarray | None, metrics: tuple[str, ...] | None = None) -> ComparisonTable:
    """The chosen methods' table, one method at a time (each cached), under a bar that names the method being
    computed and the time left at the rate of the methods computed so far in this run (a cached one is free)."""
    bar = st.progress(0.0, text="Attributing and scoring ...")
    tables, spent, computed = [], 0.0, 0
    for i, method in enumerate(methods):
        left = time_left(spent, computed, computed + len(methods) - i)
        bar.progress(i / len(methods), text=f"Attributing and scoring: {method} ({i + 1} of {len(methods)})"
                     + (f", {left}" if left else ""))
        t0 = time.perf_counter()
        tables.append(method_table(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, method, target,
                                   (("n_steps", steps),) if method == "integrated_gradients" else (), mask, metrics))
        took = time.perf_counter() - t0
        if took > 0.05:  # computed here, not read from the cache
            spent, computed = spent + took, computed + 1
    bar.empty()
    return ComparisonTable.concat(tables)


@st.cache_data(max_entries=16, show_spinner="Drawing up AttnLRP's ledger ...")
def ledger_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, target: int | None,
                  method: str = "attnlrp") -> Any:
    """The conservation ledger of an AttnLRP method on the current image (``vitlens.attribution.lrp_ledger``)."""
    from vitlens.attribution.lrp_ledger import attnlrp_ledger

    with heavy_lock():
        return attnlrp_ledger(_m, [_image], target=target, method=method)


def render_ledger(ctx: Context, target: int | None, method: str = "attnlrp") -> None:
    """Where an AttnLRP method's relevance of the target logit goes: input pixels, position table, prefix tokens,
    biases, softmax; the entries add up to the logit (float64)."""
    try:
        ledger = ledger_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, target, method)
    except vl.ViewNotAvailableError as e:
        st.info(f"No {method} ledger for this model: {e}")
        return
    import pandas as pd

    st.caption(f"{method}'s ledger: where the target logit's relevance goes (the map shows the input pixels' "
               "share).")
    st.dataframe(pd.DataFrame(ledger.shown_rows()), hide_index=True)  # 1e-16, not 0.0000000000000001


def render_sanity(ctx: Context, methods: list[str], target: int | None) -> None:
    """Adebayo et al. (2018): does each map depend on the weights? The cascade re-initialises the head, then
    the blocks from the top, then the embedding, on a copy of the model (``vl.sanity_table``)."""
    table = remembered("sanity_memo", (ctx.mkey, ctx.cur_key, tuple(methods), target), lambda progress: sanity_table(
        ctx.m, [ctx.current], methods=methods, target=target, progress=progress),
        f"Sanity checks of {counted(len(methods), 'method')} (maps computed)", len(methods) * (ctx.m.spec.num_layers + 3))
    st.caption("Each map recomputed after every step of the cascade, for the same target; similarity to the "
               "original map (Spearman on |maps| and on signed maps, SSIM). A map that barely changes when the "
               "weights are random cannot be explaining the model.")
    st.plotly_chart(figures.sanity_figure(table.results), key="sanity-fig")
    st.caption(verdict_rule(table.results[0].threshold))  # the report's words for the same rule
    import pandas as pd

    whole_table(round_significant(pd.DataFrame(table.readable_rows())))


def render_compare(ctx: Context) -> None:
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


def render_survey(ctx: Context) -> None:
    from vitlens.report.survey import summary_rows, survey_figures

    st.caption("A survey folder written by `vitlens survey` (a model zoo x an image set on Ray): attention distance "
               "against depth across the zoo (Fig. 11), the layer-1 heads of every model, and a table.")
    folder = st.text_input("Survey folder", key="survey-folder", placeholder="runs/zoo").strip()
    if not folder:
        st.info("Give the folder of a survey (`vitlens survey --models ... --out runs/zoo`).")
        return
    result = vl.load_survey(folder)
    if result.table.empty:
        st.info("This survey has no finished model yet.")
        for name, reason in result.failed.items():
            st.warning(f"{name} failed: {reason}")
        return
    figs = survey_figures(result)
    for name, fig in figs.items():
        st.plotly_chart(fig, key=f"survey-{name}")
    st.dataframe(summary_rows(result), hide_index=True)
    for name, reason in result.failed.items():
        st.warning(f"{name} failed: {reason}")
    cols = st.columns(1 + len(figs))
    cols[0].download_button("Table (CSV)", result.table.to_csv(index=False).encode(), "survey.csv", "text/csv",
                            on_click="ignore")
    for where, (name, fig) in zip(cols[1:], figs.items()):
        figure_download(where, fig, f"survey-{name}", SURVEY_FIGURES.get(name, name))


SURVEY_FIGURES = {"depth": "Depth", "layer1": "Layer 1", "per-class": "Per class"}  # download labels

def render_registered(name: str) -> Callable[[Context], None]:
    """The page of a registered view that has no page written for it: its figure over the image set
    and its numbers (``vitlens.views.registry``), from one ``analyze`` pass."""
    view = REGISTRY[name]

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


PAGES: dict[str, Callable[[Context], None]] = {
    # the library's views by their registry labels (vitlens.views.registry), then the app's own pages
    REGISTRY["filters"].label: render_filters,
    REGISTRY["position"].label: render_position,
    REGISTRY["distance"].label: render_distance,  # with the prefix view beside it
    "Attention maps": render_maps,  # one image's maps per head, and its rollout
    "Attributions": render_attributions,
    "Compare": render_compare,
    "Survey": render_survey,
}
PAGES.update({v.label or v.name: render_registered(name) for name, v in REGISTRY.items()
              if not v.shown_in and (v.label or v.name) not in PAGES})


# ---------------------------------------------------------------- sidebar: model and images
def model_picker(prefix: str, default_ref: str) -> tuple[str, bool, str | None, str] | None:
    """Widgets for choosing a model; returns (name, pretrained, arch, device) or None."""
    source = st.radio("Model source", MODEL_SOURCES, key=f"{prefix}-source", horizontal=True)
    device = st.session_state.get("device", "auto")
    if source == "Embedded":
        refs = ["ref-vit", "ref-hybrid"]
        return st.selectbox("Embedded model", refs, key=f"{prefix}-ref", index=refs.index(default_ref)), True, None, \
            device
    if source == "Preset":
        hub = [p for p in PRESETS if p.needs_download]
        choice = st.selectbox("Hub checkpoint (needs network or a cached download)", [p.name for p in hub],
                              key=f"{prefix}-preset")
        st.caption(next(p.description for p in hub if p.name == choice))
        return choice, True, None, device
    if source == "Name":
        # code spans: the label is Markdown, where the names' * and _ would turn into emphasis
        name = st.text_input("Model name: timm (`vit_*`, `deit_*`, `beit*`, `eva02_*`), `hf:ORG/NAME` or "
                             "`hf:FOLDER`, `torchvision:vit_b_16`, `open_clip:ViT-B-32`", "vit_tiny_patch16_224",
                             key=f"{prefix}-timm").strip()
        pretrained = st.checkbox("Pretrained weights (download or cache)", value=False, key=f"{prefix}-pre")
        if not name:  # a box left empty says what it wants, as the checkpoint's does
            st.info("Type a model name, e.g. `vit_tiny_patch16_224`, or pick another model source.")
            return None
        return name, pretrained, None, device
    path = st.text_input("Checkpoint path (.safetensors, .pth/.bin, .npz)", key=f"{prefix}-path").strip()
    upload = st.file_uploader("... or upload one", type=["safetensors", "pth", "pt", "bin", "npz"],
                              key=f"{prefix}-ckpt")
    arch = st.text_input("Architecture (timm name or ref-vit/ref-hybrid)", key=f"{prefix}-arch").strip()
    if upload is not None:
        # a private folder of this session's (0700, inside this server's own), removed when the session ends;
        # the file's bytes are checked against the upload each time, so nothing planted there is read
        folder = st.session_state.get("upload-folder")
        if folder is None:
            folder = st.session_state["upload-folder"] = UploadFolder()
        path = str(folder.save(upload.name, upload.getvalue()))
    if not path:
        st.info("Give a checkpoint path or upload a file, and its architecture.")
        return None
    return path, False, arch or None, device


def image_set() -> tuple[list, list[str], str, np.ndarray | None, np.ndarray | None, str]:
    """(images, names, key, masks, labels, source) from the sidebar's image source."""
    # the app opens on the embedded models, which know the shapes scenes: start there
    source = st.radio("Images", ["Sample photos", "Shapes (with masks)", "Upload"], index=1, key="img-source")
    if source == "Sample photos":
        return vl.sample_images(), list(SAMPLE_NAMES), "samples", None, None, "samples"
    if source == "Shapes (with masks)":
        n = st.slider("Held-out scenes", 8, 256, 32, step=8, key="n-shapes")
        images, names, masks, labels = held_out_scenes(n)
        return images, names, f"shapes-{n}", masks, labels, "shapes"
    files = st.file_uploader(f"Images: {', '.join(t.upper() for t in UPLOAD_TYPES)}; up to {MAX_UPLOAD_MB} MB each",
                             type=list(UPLOAD_TYPES), accept_multiple_files=True, key="uploads",
                             max_upload_size=MAX_UPLOAD_MB)
    # decoded and resized once per file, kept in the session (not the files): a rerun never decodes them again
    uploads = read_uploads(((f.name, f.getvalue()) for f in files or []), max_side_px=APP_MAX_SIDE_PX,
                           memo=st.session_state.setdefault("upload-images", {}))
    for message in uploads.skipped:
        st.warning(f"Skipped: {message}")
    for message in uploads.tiny:
        st.warning(f"Analysed, but {message}.")
    if uploads.duplicates:
        st.caption(f"Already uploaded (same file), shown once: {', '.join(uploads.duplicates)}")
    return uploads.images, uploads.names, uploads.key, None, None, "upload"


#: the sidebar's facts wrap inside it: a long value (a Swin's name, "hierarchical (windowed stages)") breaks over
#: lines instead of widening the table past the sidebar's edge, where it was clipped ("hierarchical (windowed sta")
FACTS_STYLE = ("<style>[data-testid='stSidebar'] [data-testid='stTable'] :is(td, th, td *, th *) "
               "{white-space: normal; overflow-wrap: anywhere;}</style>")  # the cells' Markdown sets its own


def facts(m: vl.LoadedModel) -> tuple[list[dict], str]:
    """The sidebar's facts table, and the weights' full location when the table shows only its last part
    (a path or hub id is one long word: in a narrow sidebar the table would clip it)."""
    described = m.describe()
    weights = described.get("weights", "")
    short = weights.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    if short and short != weights:
        described["weights"] = short
    return [{"fact": k, "value": v} for k, v in described.items()], weights if short != weights else ""


#: a secret the page asks for in its address (``?token=...``) when set: on a shared machine, where every local
#: user can reach 127.0.0.1, the app is then its user's alone (docs/security.md)
TOKEN_ENV = "VITLENS_APP_TOKEN"


def access_granted() -> bool:
    """Whether this session may use the app: no token set, or the address's ``token`` equals ``$VITLENS_APP_TOKEN``
    (compared in constant time; remembered for the session)."""
    import hmac
    import os

    want = os.environ.get(TOKEN_ENV, "")
    if not want or st.session_state.get("access-granted"):
        return True
    given = st.query_params.get("token", "")
    if hmac.compare_digest(str(given).encode(), want.encode()):
        st.session_state["access-granted"] = True
        return True
    return False


def main() -> None:
    st.set_page_config(page_title="vitlens", layout="wide")
    if not access_granted():  # nothing else runs: no path box, no upload, no model
        st.error(f"This vitlens app asks for its access token: open it as http://127.0.0.1:8501/?token=TOKEN, with "
                 f"the token it was started with ({TOKEN_ENV}).")
        return
    st.title("vitlens")
    st.caption("The interpretability views of *An Image is Worth 16x16 Words* (ICLR 2021, section 4.5) for "
               "Vision Transformers.")
    with st.sidebar:
        st.header("Model")
        st.selectbox("Device", DEVICES, key="device")
        picked = model_picker("m1", "ref-vit")
        st.header("Images")
        images, names, ikey, masks, labels, image_source = image_set()
    # The view selector is drawn on every run, before anything below can stop the run: a widget left out
    # of a run loses its state, and the browser would then show its first option over the old view.
    # Its own key is the one record of the current view.
    head = st.container()
    view = st.radio("View", list(PAGES), horizontal=True, key="view")
    with head:
        ctx = model_and_image(picked, images, names, ikey, masks, labels, image_source)
    try:
        PAGES[view](ctx)
    except Exception as e:  # noqa: BLE001 - the app shows the message and keeps working
        show_error(e)


def image_box_key(ikey: str) -> str:
    """The "Current image" box's widget key for one image set."""
    return f"img-idx-{ikey}"


def model_and_image(picked: tuple | None, images: list, names: list[str], ikey: str, masks: np.ndarray | None,
                    labels: np.ndarray | None, image_source: str) -> Context:
    """The model's facts, the current image and its predictions; stops the run with a message when
    there is no model or no image to show."""
    if picked is None:  # the sidebar's box says what it wants; the page says where to look
        st.info("No model to show yet: give one in the sidebar (under Model, the box says what it needs).")
        st.stop()
    try:
        m = load_model(*picked)
    except Exception as e:  # noqa: BLE001 - every failure becomes a message
        show_error(e)
        st.stop()
    with st.sidebar:
        st.header("Facts")
        rows, weights = facts(m)
        st.html(FACTS_STYLE)
        st.table(rows, hide_index=True)
        if weights:
            st.caption(f"Weights: {weights}")
        import torch

        st.caption(f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else
                   "GPU: none (running on CPU)")
    if not images:
        st.info("Upload at least one image, or pick sample photos or shapes in the sidebar.")
        st.stop()
    # keyed by the image set: a new set is a new box, so the name shown is always the image shown (one key
    # across sets kept the old set's label in the browser over the new set's image)
    idx = st.selectbox("Current image", range(len(images)), format_func=lambda i: names[i],
                       key=image_box_key(ikey))
    idx = min(idx, len(images) - 1)
    try:
        x = m.preprocess([images[idx]])
        ctx = Context(m=m, mkey=f"{picked}", images=images, names=names, ikey=ikey, masks=masks, labels=labels,
                      index=idx, shown=m.display(x)[0])
        preds = predictions_result(m, ctx.mkey, x, ctx.cur_key)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        st.stop()
    caveat = m.prediction_caveat(image_source)
    if caveat:
        st.caption(caveat)
    top = st.columns([1, 2])
    top[0].image(ctx.shown, caption=f"{names[idx]} as the model sees it ({ctx.shown.shape[1]}x{ctx.shown.shape[0]})",
                 width=220)
    if preds:
        top[1].markdown("**Top-5 predictions**")
        top[1].table([{"class": label, "probability": format_probability(p)} for label, p in preds])
    else:
        top[1].info("This model has no classifier head (a feature model): no predictions to show.")
    return ctx


main()
