"""A video model in the app (issue 50): the sidebar's clip (an uploaded video or animated GIF, or a moving shape the
library makes), the frames the model's processor samples from it, a frame slider over them, the clip's predictions,
and the space-time views' pages (``views.spacetime``) under their own view selector.

A model reads clips when its kind says so (``kind_choices.reads_clips``); the sidebar then offers a clip in place of
images, and every page below is drawn from that clip.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

import vitlens as vl
from vitlens_app import kind_choices
from vitlens_app.caches import load_model, predictions_result
from vitlens_app.context import ClipContext, show_error
from vitlens_app.header import show_predictions
from vitlens_app.library import (CLIP_SUFFIXES, MAX_UPLOAD_MB, SHAPES, clip_frames,
                                 sampled_clip, sampled_fps)
from vitlens_app.sidebar import show_facts
from vitlens_app.uploads import UploadFolder
from vitlens_app.views.spacetime import video_pages

CLIP_SOURCES = ["Moving shape", "Upload"]
#: what the uploader takes: the video files ``vl.read_clip`` reads (PyAV), then animated GIFs (``CLIP_SUFFIXES``)
CLIP_TYPES = [s.lstrip(".") for s in CLIP_SUFFIXES]
#: the synthetic clip's motions, in pixels a frame (dy, dx) of a 64 px frame (scaled with the frame)
MOTIONS = {"right": (0.0, 2.0), "down": (2.0, 0.0), "diagonal": (1.5, 1.5), "still": (0.0, 0.0)}
#: the synthetic clip's frames (at least; more for a model that samples more) and frame rate (the model samples its
#: own number of frames from them)
SHAPE_FRAMES, SHAPE_FPS = 16, 8.0


def video_model(picked: tuple | None) -> vl.LoadedModel | None:
    """The picked model when it reads clips (loaded through the cache), else None; a model that fails to load is
    None here, and the page below says why (``header.model_and_image``)."""
    if picked is None:
        return None
    try:
        m = load_model(*picked)
    except Exception:  # noqa: BLE001 - the image path shows the message
        return None
    return m if kind_choices.reads_clips(m.spec) else None


def clip_source(m: vl.LoadedModel) -> tuple[Any, str, str]:
    """The sidebar's clip: (a clip source for ``vl.read_clip``, its key, its name), or (None, "", "") before an
    upload."""
    source = st.radio("Clip source", CLIP_SOURCES, key="clip-source", horizontal=True)
    if source == "Moving shape":
        shape = st.selectbox("Shape", list(SHAPES), index=list(SHAPES).index("square"), key="clip-shape")
        motion = st.selectbox("Motion", list(MOTIONS), key="clip-motion")
        size, frames = max(64, *m.spec.image_size), max(SHAPE_FRAMES, clip_frames(m))
        dy, dx = (v * size / 64 for v in MOTIONS[motion])
        st.caption(f"{frames} frames of {size}x{size} px at {SHAPE_FPS:g} fps, made by vl.moving_shape_clip: "
                   f"the shape moves ({dy:g}, {dx:g}) px a frame.")
        clip = vl.moving_shape_clip(num_frames=frames, size=size, shape=shape, velocity=(dy, dx),
                                    fps=SHAPE_FPS).clip
        return clip, f"shape-{shape}-{motion}-{size}-{frames}", clip.name
    upload = st.file_uploader(f"A video ({', '.join(CLIP_TYPES[:-1])}) or an animated GIF; up to {MAX_UPLOAD_MB} MB",
                              type=CLIP_TYPES, key="clip-upload", max_upload_size=MAX_UPLOAD_MB)
    if upload is None:
        return None, "", ""
    # the session's private folder (0700), removed when the session ends; read by its suffix (vl.read_clip)
    folder = st.session_state.get("upload-folder")
    if folder is None:
        folder = st.session_state["upload-folder"] = UploadFolder()
    path = folder.save(upload.name, upload.getvalue())
    return path, f"upload-{Path(path).name}", upload.name


def sampled(m: vl.LoadedModel, mkey: str, source: Any, ckey: str) -> vl.Clip:
    """The frames the model's processor takes from the clip, read once per clip and model in the session."""
    memo = st.session_state.setdefault("clip-memo", {})
    key = (mkey, ckey)
    if key not in memo:
        memo[key] = sampled_clip(source, m)
        while len(memo) > 4:
            memo.pop(next(iter(memo)))
    return memo[key]


def clip_fps(clip: vl.Clip) -> float | None:
    """The sampled frames' mean rate, by the reports' rule (``sampled_fps``: the source's fps times sampled /
    source frames); None without a rate."""
    return sampled_fps(clip.fps, clip.num_frames, clip.source_frames or clip.num_frames)


def clip_header(m: vl.LoadedModel, mkey: str, source: Any, ckey: str, name: str) -> ClipContext:
    """The clip's frame picked on the slider as the model sees it, and the clip's predictions; stops the run with
    one message when there is no clip or it cannot be read (the app keeps working: pick another clip). An upload
    is named by its own name in the message, never by the private folder it is kept in."""
    if source is None:
        st.info("Upload a video or an animated GIF in the sidebar, or pick a moving shape.")
        st.stop()
    try:
        clip = sampled(m, mkey, source, ckey)
        x = vl.clip_pixel_values(clip, m)
        shown = m.display(x[0])
        preds = predictions_result(m, mkey, x, ckey)
    except vl.VitlensError as e:  # a bad file is one message, naming the upload
        where = (str(source), Path(source).name) if isinstance(source, Path) else ()
        text = e.message_for("app")
        for part in where:
            text = text.replace(part, name)
        st.error(text)
        st.stop()
    except Exception as e:  # noqa: BLE001
        show_error(e)
        st.stop()
    n = len(shown)
    # 0-based, as the figures' step labels and the source's frames are counted
    frame = int(st.slider(f"Frame (of the {n} the model samples)", 0, n - 1, 0, key=f"clip-frame-{n}"))
    ctx = ClipContext(m=m, mkey=mkey, clip=clip, ckey=ckey, x=x, shown=shown, frame=frame, fps=clip_fps(clip))
    at = clip.indices[frame] if clip.indices is not None else frame
    when = f", t = {at / clip.fps:.2f} s" if clip.fps else ""
    top = st.columns([1, 2])
    top[0].image(shown[frame], width=220)
    top[0].caption(f"{name or 'clip'}: frame {frame} of 0-{n - 1} as the model sees it "
                   f"({shown[frame].shape[1]}x{shown[frame].shape[0]}; source frame {at}{when})")
    show_predictions(top[1], preds, "Top-5 predictions (the clip)")
    return ctx


def render_video(m: vl.LoadedModel, mkey: str, source: Any, ckey: str, name: str) -> None:
    """The page of a video model: its facts, the view selector of the space-time views, the clip and the view."""
    show_facts(m)
    shown = video_pages()
    head = st.container()
    view = st.radio("View", list(shown), horizontal=True, key="video-view")
    with head:
        ctx = clip_header(m, mkey, source, ckey, name)
    try:
        shown[view](ctx)
    except Exception as e:  # noqa: BLE001 - the app shows the message and keeps working
        show_error(e)
