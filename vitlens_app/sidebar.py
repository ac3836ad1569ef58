"""The sidebar: the model picker (also the Compare page's second model), the image set and the model's facts."""
from __future__ import annotations

import numpy as np
import streamlit as st

import vitlens as vl
from vitlens_app.caches import held_out_scenes
from vitlens_app.library import MAX_UPLOAD_MB, SAMPLE_NAMES, UPLOAD_TYPES, read_uploads
from vitlens_app.uploads import APP_MAX_SIDE_PX, CHECKPOINT_TYPES, UploadFolder
from vitlens_app.library import PRESETS

MODEL_SOURCES = ["Embedded", "Preset", "Name", "Checkpoint"]
DEVICES = ["auto", "cpu", "cuda"]


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
    path = st.text_input(f"Checkpoint path ({', '.join(f'.{t}' for t in CHECKPOINT_TYPES)})",
                         key=f"{prefix}-path").strip()
    upload = st.file_uploader("... or upload one", type=list(CHECKPOINT_TYPES),
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


def show_facts(m: vl.LoadedModel) -> None:
    """The model's facts in the sidebar, its weights' full location, and the GPU the app runs on."""
    import torch

    with st.sidebar:
        st.header("Facts")
        rows, weights = facts(m)
        st.html(FACTS_STYLE)
        st.table(rows, hide_index=True)
        if weights:
            st.caption(f"Weights: {weights}")
        st.caption(f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else
                   "GPU: none (running on CPU)")
