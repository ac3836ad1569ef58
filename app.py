"""vitlens app: explore the views of the ViT paper (ICLR 2021, section 4.5) for a timm ViT.

Run: streamlit run app.py   (opens on the embedded reference ViT; works offline)

Layout and widgets only: computation and figures come from the ``vitlens`` library.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st

import vitlens as vl
from vitlens import app_support as sup
from vitlens import figures
from vitlens.images import SAMPLE_NAMES, display_image
from vitlens.presets import PRESETS
from vitlens.shapes import CLASSES, HELD_OUT_SEED, generate

MAX_UPLOAD_MB = 20
VIEWS = ["Filters", "Position embeddings", "Attention distance", "Attention maps", "Attributions", "Compare"]
MODEL_SOURCES = ["Embedded", "Preset", "timm name", "Checkpoint"]
PNG_EXPORT = shutil.which("chromium") is not None


# ---------------------------------------------------------------- cached resources and results
@st.cache_resource
def heavy_lock() -> threading.Lock:
    """One heavy computation at a time across sessions: two tabs must not thrash 2 cores."""
    return threading.Lock()


@st.cache_resource(max_entries=2, show_spinner="Loading model ...")
def load_model(name: str, pretrained: bool, arch: str | None) -> vl.LoadedModel:
    with heavy_lock():
        return vl.load_model(name, pretrained=pretrained, arch=arch or None)


@st.cache_data(max_entries=16, show_spinner=False)
def filters_result(_m: vl.LoadedModel, mkey: str, k: int) -> vl.FilterPCAResult:
    return vl.embedding_filter_pca(_m, n_components=k)


@st.cache_data(max_entries=16, show_spinner=False)
def position_result(_m: vl.LoadedModel, mkey: str, grid: tuple[int, int]) -> vl.PositionSimilarityResult:
    return vl.position_similarity(_m, grid=grid)


@st.cache_data(max_entries=32, show_spinner="Rolling out attention ...")
def rollout_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, fusion: str,
                   discard: float) -> vl.RolloutResult:
    with heavy_lock():
        return vl.attention_rollout(_m, [_image], head_fusion=fusion, discard_ratio=discard)


@st.cache_data(max_entries=8, show_spinner="Capturing attention ...")
def attention_maps(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str) -> np.ndarray:
    """Every block's attention for one image: [layers, heads, T, T] float32."""
    import torch

    x = _m.preprocess([_image])
    with heavy_lock(), torch.no_grad(), vl.capture_attention(_m) as cap:
        _m.logits(x)
    return np.stack([a[0].cpu().numpy() for a in cap.maps])


@st.cache_data(max_entries=32, show_spinner="Attributing ...")
def attribution_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, method: str, target: int | None,
                       params: tuple) -> Any:
    from vitlens.attribution import attribute

    with heavy_lock():
        return attribute(_m, [_image], method=method, target=target, **dict(params))


@st.cache_data(max_entries=32, show_spinner="Deletion and insertion curves ...")
def faithfulness_result(_m: vl.LoadedModel, mkey: str, _image: Any, ikey: str, _attr: Any, akey: tuple) -> Any:
    from vitlens.faithfulness import deletion_insertion

    with heavy_lock():
        return deletion_insertion(_m, [_image], _attr, steps=16)


def distance_result(m: vl.LoadedModel, mkey: str, images: list, ikey: str, renormalize: bool) -> Any:
    """Attention distance with a progress bar; remembered per session (a few entries)."""
    memo = st.session_state.setdefault("distance_memo", {})
    key = (mkey, ikey, len(images), renormalize)
    if key not in memo:
        bar = st.progress(0.0, text=f"Attention distance over {len(images)} images ...")

        def progress(done: int, total: int | None) -> None:
            bar.progress(min(done / max(total or len(images), 1), 1.0), text=f"{done}/{total} images")

        with heavy_lock():
            memo[key] = vl.attention_distance(m, images, batch_size=16, renormalize=renormalize, progress=progress)
        bar.empty()
        while len(memo) > 6:
            memo.pop(next(iter(memo)))
    return memo[key]


# ---------------------------------------------------------------- helpers for the page
def show_error(e: Exception) -> None:
    """A message a person can act on; never a traceback."""
    if isinstance(e, vl.VitlensError):
        st.error(str(e))
    else:
        st.error(f"Something went wrong ({type(e).__name__}: {e}). Try other settings; the app keeps working.")


def downloads(result: Any, fig: Any, stem: str) -> None:
    cols = st.columns(3)
    cols[0].download_button("Numbers (CSV)", sup.to_csv(result), f"{stem}.csv", "text/csv", key=f"csv-{stem}",
                            on_click="ignore")
    cols[1].download_button("Numbers (JSON)", sup.to_json(result), f"{stem}.json", "application/json",
                            key=f"json-{stem}", on_click="ignore")
    if PNG_EXPORT:
        cols[2].download_button("Figure (PNG)", lambda: fig.to_image(format="png"), f"{stem}.png", "image/png",
                                key=f"png-{stem}", on_click="ignore")
    else:
        cols[2].download_button("Figure (HTML)", lambda: fig.to_html(include_plotlyjs=True).encode(),
                                f"{stem}.html", "text/html", key=f"html-{stem}", on_click="ignore")


def image_count(where: Any, available: int, key: str) -> int:
    """How many images to average over (a slider needs at least two choices)."""
    if available == 1:
        where.caption("1 image")
        return 1
    return int(where.slider("Images", 1, available, min(available, 32), key=key))


def model_picker(prefix: str, default_ref: str) -> tuple[str, bool, str | None] | None:
    """Sidebar/inline widgets for choosing a model; returns (name, pretrained, arch) or None."""
    source = st.radio("Model source", MODEL_SOURCES, key=f"{prefix}-source", horizontal=True)
    if source == "Embedded":
        return st.selectbox("Embedded model", ["ref-vit", "ref-hybrid"], key=f"{prefix}-ref",
                            index=["ref-vit", "ref-hybrid"].index(default_ref)), True, None
    if source == "Preset":
        hub = [p for p in PRESETS if p.needs_download]
        choice = st.selectbox("Hub checkpoint (needs network or a cached download)", [p.name for p in hub],
                              key=f"{prefix}-preset", format_func=lambda n: f"{n}")
        st.caption(next(p.description for p in hub if p.name == choice))
        return choice, True, None
    if source == "timm name":
        name = st.text_input("timm model name", "vit_tiny_patch16_224", key=f"{prefix}-timm").strip()
        pretrained = st.checkbox("Pretrained weights (download or cache)", value=False, key=f"{prefix}-pre")
        return (name, pretrained, None) if name else None
    path = st.text_input("Checkpoint path (.safetensors, .pth/.bin, .npz)", key=f"{prefix}-path").strip()
    upload = st.file_uploader("... or upload one", type=["safetensors", "pth", "pt", "bin", "npz"],
                              key=f"{prefix}-ckpt")
    arch = st.text_input("Architecture (timm name or ref-vit/ref-hybrid)", key=f"{prefix}-arch").strip()
    if upload is not None:
        data = upload.getvalue()
        digest = hashlib.sha256(data).hexdigest()[:16]
        target = Path(tempfile.gettempdir()) / "vitlens-uploads" / f"{digest}{Path(upload.name).suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.write_bytes(data)
        path = str(target)
    if not path:
        st.info("Give a checkpoint path or upload a file, and its architecture.")
        return None
    return path, False, arch or None


@st.cache_data(max_entries=4, show_spinner=False)
def held_out_scenes(n: int) -> tuple[list, list[str], np.ndarray]:
    """The first ``n`` held-out reference scenes as PIL images, with names and object masks."""
    from PIL import Image

    data = generate(n, seed=HELD_OUT_SEED)
    names = [f"scene {i} ({CLASSES[label]})" for i, label in enumerate(data.labels)]
    return [Image.fromarray(a) for a in data.images], names, data.masks


def image_set() -> tuple[list, list[str], str, np.ndarray | None]:
    """(images, names, key, masks) from the sidebar's image source."""
    # the app opens on the embedded models, which know the shapes scenes: start there
    source = st.radio("Images", ["Sample photos", "Shapes (with masks)", "Upload"], index=1, key="img-source")
    if source == "Sample photos":
        return vl.sample_images(), list(SAMPLE_NAMES), "samples", None
    if source == "Shapes (with masks)":
        n = st.slider("Held-out scenes", 8, 256, 32, step=8, key="n-shapes")
        images, names, masks = held_out_scenes(n)
        return images, names, f"shapes-{n}", masks
    files = st.file_uploader(f"PNG, JPEG or WebP, any mode, up to {MAX_UPLOAD_MB} MB each",
                             type=["png", "jpg", "jpeg", "webp"], accept_multiple_files=True, key="uploads")
    images, names, digests = [], [], []
    for f in files or []:
        data = f.getvalue()
        try:
            images.append(sup.read_upload(f.name, data, MAX_UPLOAD_MB * 2**20))
        except vl.VitlensError as e:
            st.warning(f"Skipped: {e}")
            continue
        names.append(f.name)
        digests.append(hashlib.sha256(data).hexdigest()[:12])
    return images, names, "upload-" + "-".join(digests), None


# ---------------------------------------------------------------- page
st.set_page_config(page_title="vitlens", layout="wide")
st.title("vitlens")
st.caption("The interpretability views of *An Image is Worth 16x16 Words* (ICLR 2021, section 4.5) for timm "
           "Vision Transformers.")

with st.sidebar:
    st.header("Model")
    picked = model_picker("m1", "ref-vit")
    st.header("Images")
    images, image_names, ikey, masks = image_set()

if picked is None:
    st.stop()
try:
    m = load_model(*picked)
except Exception as e:  # noqa: BLE001 - every failure becomes a message
    show_error(e)
    st.stop()
mkey = f"{picked}"

with st.sidebar:
    st.header("Facts")
    st.table([{"fact": k, "value": v} for k, v in sup.model_facts(m).items()], hide_index=True)
    import torch

    st.caption(f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "GPU: none (running on CPU)")

if not images:
    st.info("Upload at least one image, or pick sample photos or shapes in the sidebar.")
    st.stop()

idx = st.selectbox("Current image", range(len(images)), format_func=lambda i: image_names[i], key="img-idx")
current = images[min(idx, len(images) - 1)]
cur_key = f"{ikey}-{idx}"
try:
    x_cur = m.preprocess([current])
    shown = display_image(x_cur[0], m.data_config)
    preds = sup.top_predictions(m, x_cur)
except Exception as e:  # noqa: BLE001
    show_error(e)
    st.stop()

if m.spec.name in ("ref-vit", "ref-hybrid") and masks is None:
    st.caption("The embedded models know only six synthetic shapes (see MODEL_CARD.md): on other images their "
               "predictions mean nothing, though every view still shows what the model computes.")
top = st.columns([1, 2])
top[0].image(shown, caption=f"{image_names[idx]} as the model sees it ({shown.shape[1]}x{shown.shape[0]})",
             width=220)
if preds:
    top[1].markdown("**Top-5 predictions**")
    top[1].table([{"class": label, "probability": f"{100 * p:.1f}%"} for label, p in preds])
else:
    top[1].info("This model has no classifier head (a feature model): no predictions to show.")

view = st.radio("View", VIEWS, horizontal=True, key="view")

try:
    if view == "Filters":
        limit = vl.views.filters.max_filter_components(m)
        k = st.slider("Principal components", 1, min(64, limit), min(28, limit), key="k")
        res = filters_result(m, mkey, k)
        if m.spec.kind == "hybrid":
            st.info("Hybrid model: its patch embedding acts on CNN channels, so this view shows the CNN's first "
                    f"convolution ({res.module}).")
        fig = figures.filters_figure(res)
        st.plotly_chart(fig, key="filters-fig")
        st.caption(f"Explained variance of the top {k}: {100 * res.explained_variance_ratio.sum():.1f}%. "
                   "The sign of each component is arbitrary.")
        downloads(res, fig, "filters")

    elif view == "Position embeddings":
        if not m.spec.has_pos_embed:
            raise vl.ViewNotAvailableError(f"Position similarity is not available for {m.spec.name}: it has no "
                                           "learned absolute position embedding.")
        c = st.columns(4)
        gh = c[0].number_input("Grid rows", 1, 64, m.spec.grid[0], key="gh")
        gw = c[1].number_input("Grid columns", 1, 64, m.spec.grid[1], key="gw")
        res = position_result(m, mkey, (int(gh), int(gw)))
        r = c[2].number_input("Patch row", 0, int(gh) - 1, min(int(gh) // 2, int(gh) - 1), key="pr")
        col = c[3].number_input("Patch column", 0, int(gw) - 1, min(int(gw) // 2, int(gw) - 1), key="pc")
        fig = figures.position_figure(res)
        left, right = st.columns([3, 2])
        event = left.plotly_chart(fig, key="pos-fig", on_select="rerun", selection_mode="points")
        points = event.selection.points if event else []
        if points and "customdata" in points[0]:
            r, col = int(points[0]["customdata"][0]), int(points[0]["customdata"][1])
        right.plotly_chart(figures.similarity_tile_figure(res, int(r), int(col)), key="tile-fig")
        right.caption("Click a tile on the left, or set the patch row and column above.")
        downloads(res, fig, "position_similarity")

    elif view == "Attention distance":
        c = st.columns(2)
        n = image_count(c[0], len(images), "n-dist")
        renorm = c[1].checkbox("Renormalise over patch keys (raw weights when off)", True, key="renorm")
        res = distance_result(m, mkey, images[:n], f"{ikey}-{n}", renorm)
        fig = figures.distance_figure(res)
        st.plotly_chart(fig, key="dist-fig")
        downloads(res, fig, "attention_distance")

    elif view == "Attention maps":
        c = st.columns(3)
        fusion = c[0].selectbox("Head fusion", ["mean", "max", "min"], key="fusion")
        discard = c[1].slider("Discard ratio", 0.0, 0.95, 0.0, 0.05, key="discard")
        opacity = c[2].slider("Opacity", 0.0, 1.0, 0.5, 0.05, key="opacity")
        roll = rollout_result(m, mkey, current, cur_key, fusion, discard)
        fig = figures.rollout_figure(roll, shown, 0, opacity)
        st.plotly_chart(fig, key="rollout-fig")
        downloads(roll, fig, "rollout")
        st.subheader("One query's attention")
        maps = attention_maps(m, mkey, current, cur_key)
        c = st.columns(4)
        layer = c[0].slider("Layer", 1, m.spec.num_layers, 1, key="layer") - 1
        query_kind = c[1].radio("Query", ["class token", "patch"] if m.spec.has_class_token else ["patch"],
                                key="qkind")
        if query_kind == "patch":
            qr = c[2].number_input("Query row", 0, m.spec.grid[0] - 1, m.spec.grid[0] // 2, key="qr")
            qc = c[3].number_input("Query column", 0, m.spec.grid[1] - 1, m.spec.grid[1] // 2, key="qc")
            query = m.spec.num_prefix_tokens + int(qr) * m.spec.grid[1] + int(qc)
            label = f"patch ({int(qr)}, {int(qc)})"
        else:
            query, label = 0, "the class token"
        head_maps = sup.query_attention(maps[layer], m.spec.num_prefix_tokens, m.spec.grid, query)
        head = st.selectbox("Head", ["all heads"] + [f"head {h + 1}" for h in range(m.spec.num_heads)], key="head")
        if head == "all heads":
            st.plotly_chart(sup.heads_figure(shown, head_maps, layer, label, opacity), key="heads-fig")
        else:
            h = int(head.split()[1]) - 1
            st.plotly_chart(figures.heatmap_overlay_figure(
                shown, head_maps[h], f"Layer {layer + 1}, head {h + 1}: attention of {label}", opacity),
                key="head-fig")

    elif view == "Attributions":
        from vitlens.attribution import METHODS

        st.caption("Rollout shows where information was mixed; the other methods ask what supports one class. "
                   "Deletion/insertion curves test each map: removing the patches it ranks first should make the "
                   "class probability fall fast (low deletion AUC), inserting them should make it rise fast.")
        c = st.columns([3, 2, 1])
        methods = c[0].multiselect("Methods", list(METHODS), default=["rollout", "grad_rollout", "saliency"],
                                   key="methods")
        names = m.label_names() or [f"class {i}" for i in range(m.spec.num_classes)]
        target = None
        if m.spec.num_classes > 0:
            choice = c[1].selectbox("Target class", ["predicted"] + names, key="target")
            target = None if choice == "predicted" else names.index(choice)
        steps = c[2].number_input("IG steps", 2, 64, 16, key="ig-steps")
        if not methods:
            st.info("Choose at least one method.")
        else:
            results, curves, rows = [], [], []
            for method in methods:
                params = (("n_steps", int(steps)),) if method == "integrated_gradients" else ()
                a = attribution_result(m, mkey, current, cur_key, method, target, params)
                f = faithfulness_result(m, mkey, current, cur_key, a, (method, target, params))
                results.append(a)
                curves.append(f)
                row = {"method": method, "deletion AUC": round(float(f.deletion_auc[0]), 3),
                       "insertion AUC": round(float(f.insertion_auc[0]), 3),
                       "seconds": round(a.seconds_per_image, 2)}
                if masks is not None:
                    from vitlens.metrics import mask_scores

                    scores = mask_scores(a.maps, masks[idx:idx + 1]).summary()
                    row.update({"pointing": bool(scores["pointing_game"]), "mass in mask": round(scores["mass_in_mask"], 3)})
                rows.append(row)
            fig = figures.attribution_figure(results, shown, 0)
            st.plotly_chart(fig, key="attr-fig")
            st.plotly_chart(figures.faithfulness_figure(curves), key="faith-fig")
            st.dataframe(rows, hide_index=True)
            cols = st.columns(2)
            cols[0].download_button("Scores (CSV)", sup.rows_to_csv(rows), "attributions.csv", "text/csv",
                                    on_click="ignore")
            cols[1].download_button("Maps (JSON)", sup.json_dumps({r.method: r.maps.tolist() for r in results}),
                                    "attribution_maps.json", "application/json", on_click="ignore")

    elif view == "Compare":
        st.caption("A second model beside the first (Fig. 11): attention distance over the same images, "
                   "and rollout on the current image.")
        other = model_picker("m2", "ref-hybrid" if m.spec.name != "ref-hybrid" else "ref-vit")
        if other is not None:
            m2 = load_model(*other)
            n = image_count(st, len(images), "n-cmp")
            d1 = distance_result(m, mkey, images[:n], f"{ikey}-{n}", True)
            d2 = distance_result(m2, f"{other}", images[:n], f"{ikey}-{n}", True)
            from vitlens.report import comparison_units, layer_table

            units = comparison_units([d1, d2])
            if units == "width":
                st.info("The models see inputs of different widths: distances are in units of the image width.")
            fig = figures.distance_figure([d1, d2], names=[m.spec.name, m2.spec.name], units=units)
            st.plotly_chart(fig, key="cmp-fig")
            table = layer_table([d1, d2], [m.spec.name, m2.spec.name], units)
            st.dataframe(table, hide_index=True)
            r1 = rollout_result(m, mkey, current, cur_key, "mean", 0.0)
            r2 = rollout_result(m2, f"{other}", current, cur_key, "mean", 0.0)
            shown2 = display_image(m2.preprocess([current])[0], m2.data_config)
            st.plotly_chart(figures.overlay_grid_figure(
                [(shown, r1.maps[0], m.spec.name), (shown2, r2.maps[0], m2.spec.name)],
                "Attention rollout on the same image"), key="cmp-roll")
            cols = st.columns(2)
            cols[0].download_button("Distances (JSON)", sup.json_dumps({
                "models": [m.spec.name, m2.spec.name], "units": units,
                "mean_px": [d1.mean_px.tolist(), d2.mean_px.tolist()]}), "compare.json", "application/json",
                on_click="ignore")
            cols[1].download_button("Per-layer table (CSV)", sup.rows_to_csv(table), "compare_layers.csv",
                                    "text/csv", on_click="ignore")
except Exception as e:  # noqa: BLE001 - the app shows the message and keeps working
    show_error(e)
