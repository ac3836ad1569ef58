"""The app's caches: models and results shared by every session (``st.cache_resource`` / ``st.cache_data``, each
bounded but the lock), and the heavy results remembered per session (``remembered``).

Every forward of a shared model runs under ``heavy_lock``: a forward in one session while another session's
capture hooks the same model would feed its maps into that capture. A cached function's key is its arguments
less those named with a leading underscore (the model and images, keyed by ``mkey`` / ``ikey`` instead).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

import vitlens as vl
from vitlens_app import kind_choices
from vitlens_app.fair_lock import FairLock
from vitlens_app.library import (HELD_OUT_SEED, attnlrp_ledger, counted, generate, head_cost, load_model_seeded,
                                 scene_names, time_left, window_maps)
from vitlens_app.library import (AnalysisResult, AttentionMapsResult, ComparisonTable, DecompositionResult,
                                 FilterPCAResult, LogitLensResult, PatchingResult, PositionSimilarityResult,
                                 RelativePositionBiasResult, RolloutResult, SpaceTimeDistanceResult,
                                 SpaceTimeRolloutResult, TokenNormsResult, TubeletFilterPCAResult,
                                 VideoPositionSimilarityResult)

#: how many results of one kind ``remembered`` keeps per session (analyses/app_load.py reads it)
MEMO_ENTRIES = 6


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
def filters_result(_m: vl.LoadedModel, mkey: str, k: int) -> FilterPCAResult:
    return vl.embedding_filter_pca(_m, n_components=k)


# 4, not 16: one entry is (gh * gw)^2 float64 similarities, 128 MB at the 64 x 64 grid the boxes allow
@st.cache_data(max_entries=4, show_spinner=False)
def position_result(_m: vl.LoadedModel, mkey: str, grid: tuple[int, int]) -> PositionSimilarityResult:
    return vl.position_similarity(_m, grid=grid)


@st.cache_data(max_entries=4, show_spinner=False)
def relpos_result(_m: vl.LoadedModel, mkey: str) -> tuple[RelativePositionBiasResult | None, str]:
    """The learned relative-position bias by offset, or None and why the model has none (weights only: no lock)."""
    try:
        return vl.relative_position_bias(_m), ""
    except vl.ViewNotAvailableError as e:
        return None, e.message_for("app")


@st.cache_data(max_entries=32, show_spinner="Rolling out attention ...")
def rollout_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, fusion: str,
                   discard: float, source: str | None = None) -> RolloutResult:
    with heavy_lock():
        return vl.attention_rollout(_m, [_image], head_fusion=fusion, discard_ratio=discard, source=source)


@st.cache_data(max_entries=8, show_spinner="Capturing attention ...")
def maps_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str,
                queries: tuple[int, ...] | None = None) -> AttentionMapsResult:
    """Every query's maps of the image, or (``queries``) those queries' rows only (high resolution)."""
    with heavy_lock():
        return vl.attention_maps(_m, _image, queries=queries)


@st.cache_data(max_entries=8, show_spinner="Capturing the windows' attention ...")
def window_maps_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> list:
    """Every block's window maps of the image, for a hierarchical model (Swin)."""
    with heavy_lock():
        return window_maps(_m, _image)


@st.cache_data(max_entries=8, show_spinner="Measuring attention on prefix tokens ...")
def parked_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> list[dict]:
    """Heads parked on a prefix token, from the streaming prefix statistics (no whole map is kept)."""
    with heavy_lock():
        return vl.prefix_diagnostics(_m, [_image]).parked()


def has_pool_attention(m: vl.LoadedModel) -> bool:
    """Whether the model pools through an attention pool (a MAP head) whose attention can be shown
    (``vl.rollout_sources``: it opens a pool capture session, so under the heavy lock like every other hook session
    on a shared model)."""
    with heavy_lock():
        return "pool" in vl.rollout_sources(m)


@st.cache_data(max_entries=32, show_spinner=False)  # attributed_table's bar says which method and the time left
def method_table(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, method: str, target: int | str | None,
                 params: tuple, _mask: np.ndarray | None, metrics: tuple[str, ...] | None = None
                 ) -> ComparisonTable:
    """One method's maps and its scores by ``metrics`` (names in ``METRIC_TABLE``) on the current image (cached per
    method and metrics)."""
    with heavy_lock():
        return vl.compare_methods(_m, [_image], methods=[method], masks=_mask, target=target,
                                  method_params={method: dict(params)}, metrics=metrics)


@st.cache_data(max_entries=64, show_spinner=False)
def predictions_result(_m: vl.LoadedModel, mkey: str, _x: Any, ikey: str) -> list[tuple[str, float]]:
    """The current image's top-5, under the heavy lock like every forward of a shared model: a forward in one
    session while another session's capture hooks the same model feeds its maps into that capture."""
    with heavy_lock():
        return _m.top_predictions(_x)


@st.cache_data(max_entries=16, show_spinner="Drawing up AttnLRP's ledger ...")
def ledger_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, target: int | None,
                  method: str = "attnlrp") -> Any:
    """The conservation ledger of an AttnLRP method on the current image (``vitlens.attribution.lrp_ledger``)."""
    with heavy_lock():
        return attnlrp_ledger(_m, [_image], target=target, method=method)


@st.cache_data(max_entries=4, show_spinner=False)
def held_out_scenes(n: int) -> tuple[list, list[str], np.ndarray, np.ndarray]:
    """The first ``n`` held-out reference scenes as PIL images, with names, object masks and labels."""
    from PIL import Image

    data = generate(n, seed=HELD_OUT_SEED)
    return [Image.fromarray(a) for a in data.images], scene_names(data.labels), data.masks, data.labels


def remembered(name: str, key: tuple, compute: Callable[[Any], Any], what: str, total: int) -> Any:
    """A heavy result with a progress bar, remembered per session (``MEMO_ENTRIES`` per kind). The bar goes whatever
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
        while len(memo) > MEMO_ENTRIES:
            memo.pop(next(iter(memo)))
    return memo[key]


def distance_result(m: vl.LoadedModel, mkey: str, images: list, ikey: str, renormalize: bool) -> AnalysisResult:
    """Attention distance and the attention on prefix tokens, from one pass over the images (a model whose keys
    hold no prefix token: its distance alone; a hierarchical model's per block and stage)."""
    views = kind_choices.distance_pass_views(m.spec)
    return remembered("distance_memo", (mkey, ikey, len(images), renormalize), lambda progress: vl.analyze(
        m, images, batch_size=16, renormalize=renormalize, progress=progress, views=views),
        f"Attention distance over {counted(len(images), 'image')}", len(images))


def head_result(m: vl.LoadedModel, mkey: str, images: list, ikey: str, labels: np.ndarray | None) -> Any:
    """Head importance (mean-ablation of each head) over the images, remembered per session."""
    k = len(images)
    return remembered("heads_memo", (mkey, ikey, k), lambda progress: vl.head_importance(
        m, images, labels=None if labels is None else labels[:k], batch_size=64, progress=progress),
        f"Head importance ({head_cost(m, k)} image forwards)", head_cost(m, k))


@st.cache_data(max_entries=16, show_spinner="Decomposing the output ...")
def decomposition_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str,
                         target: int | None) -> DecompositionResult:
    """The current image's output as an exact sum of parts, with its ledger (``vl.decompose``)."""
    with heavy_lock():
        return vl.decompose(_m, [_image], target=target)


@st.cache_data(max_entries=16, show_spinner="Reading the logit lens ...")
def lens_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, target: int | None) -> LogitLensResult:
    """Each depth's residual of the current image read through the final norm and head (``vl.logit_lens``)."""
    with heavy_lock():
        return vl.logit_lens(_m, [_image], target=target)


@st.cache_data(max_entries=16, show_spinner="Measuring token norms ...")
def norms_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> TokenNormsResult:
    """Token norms of the current image by depth and its high-norm outliers (``vl.token_norms``)."""
    with heavy_lock():
        return vl.token_norms(_m, [_image])


@st.cache_data(max_entries=8, show_spinner="Patching every component ...")
def patching_result(_m: vl.LoadedModel, mkey: str, _clean: Any, _corrupted: Any, key: str,
                    target: int | None) -> PatchingResult:
    """Each component of the clean image's run patched into its corruption's (``vl.patch_activations``); ``key``
    names the image and the corruption."""
    with heavy_lock():
        return vl.patch_activations(_m, [_clean], [_corrupted], target=target)


# a video model's clip (issue 50): the space-time views of the clip shown, keyed by the model and the clip's key
@st.cache_data(max_entries=8, show_spinner="Measuring attention distance in space and time ...")
def spacetime_distance_result(_m: vl.LoadedModel, mkey: str, _x: Any, ckey: str, renormalize: bool,
                              fps: float | None) -> SpaceTimeDistanceResult:
    """The clip's space-time attention distance (``vl.attention_distance`` of a clip: spatial and temporal)."""
    with heavy_lock():
        return vl.attention_distance(_m, _x, renormalize=renormalize, fps=fps)


@st.cache_data(max_entries=8, show_spinner="Rolling out attention through space and time ...")
def spacetime_rollout_result(_m: vl.LoadedModel, mkey: str, _x: Any, ckey: str,
                             fusion: str) -> SpaceTimeRolloutResult:
    """The clip's rollout, a map per frame or tubelet (``vl.attention_rollout`` of a clip)."""
    with heavy_lock():
        return vl.attention_rollout(_m, _x, head_fusion=fusion)


@st.cache_data(max_entries=4, show_spinner=False)
def video_position_result(_m: vl.LoadedModel, mkey: str) -> VideoPositionSimilarityResult:
    """The position embeddings' similarity over space and time (weights only: no lock)."""
    return vl.video_position_similarity(_m)


@st.cache_data(max_entries=8, show_spinner=False)
def video_filters_result(_m: vl.LoadedModel, mkey: str, k: int) -> TubeletFilterPCAResult:
    """The tubelet embedding's filters' principal components, per time step (weights only: no lock)."""
    return vl.video_filter_pca(_m, n_components=k)
