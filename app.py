"""vitlens app: explore the views of the ViT paper (ICLR 2021, section 4.5) for a Vision Transformer.

Run: streamlit run serve.py   (this page behind its server's token gate, as scripts/app.sh starts it; opens on the
embedded reference ViT and held-out shape scenes; offline; ``streamlit run app.py`` serves it without the gate). A
video model (VideoMAE, ViViT, V-JEPA 2, TimeSformer: e.g. ``hf:FOLDER`` as the model name) gets a clip and its
space-time views.

Layout and widgets only: every number and figure comes from the ``vitlens`` library. This file lays out the
page; the pages, the sidebar and the caches are the package ``vitlens_app`` beside it (one module per view,
each a render function of a ``Context``: model, images, current image), dispatched from ``pages()``.
"""
from __future__ import annotations

import streamlit as st

from vitlens_app.context import show_error
from vitlens_app.header import access_granted, access_refusal, model_and_image
from vitlens_app.sidebar import DEVICES, image_set, model_picker
from vitlens_app.video import clip_source, render_video, video_model
from vitlens_app.views import pages


def main() -> None:
    """The page: the access check, the sidebar, the view selector, the model and image above the view picked."""
    st.set_page_config(page_title="vitlens", layout="wide")
    if not access_granted():  # nothing else runs: no path box, no upload, no model
        st.error(access_refusal())
        return
    st.title("vitlens")
    st.caption("The interpretability views of *An Image is Worth 16x16 Words* (ICLR 2021, section 4.5) for "
               "Vision Transformers.")
    with st.sidebar:
        st.header("Model")
        st.selectbox("Device", DEVICES, key="device")
        picked = model_picker("m1", "ref-vit")
        video = video_model(picked)  # a video model: the sidebar offers a clip, the page its space-time views
        if video is not None:
            st.header("Clip")
            clip, ckey, clip_name = clip_source(video)
        else:
            st.header("Images")
            images, names, ikey, masks, labels, image_source = image_set()
    if video is not None:
        render_video(video, f"{picked}", clip, ckey, clip_name)
        return
    # The view selector is drawn on every run, before anything below can stop the run: a widget left out
    # of a run loses its state, and the browser would then show its first option over the old view.
    # Its own key is the one record of the current view.
    shown = pages()
    head = st.container()
    view = st.radio("View", list(shown), horizontal=True, key="view")
    with head:
        ctx = model_and_image(picked, images, names, ikey, masks, labels, image_source)
    try:
        shown[view](ctx)
    except Exception as e:  # noqa: BLE001 - the app shows the message and keeps working
        show_error(e)


main()
