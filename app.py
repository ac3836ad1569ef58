"""vitlens app (first cut): load a model, pick sample images, see the four views of the ViT paper.

Run: streamlit run app.py
"""
from __future__ import annotations

import threading

import streamlit as st

import vitlens as vl  # noqa: E402
from vitlens import figures  # noqa: E402
from vitlens.images import SAMPLE_NAMES, display_image  # noqa: E402
from vitlens.reference import weights_path  # noqa: E402

_LOCK = threading.Lock()  # one heavy computation at a time: two tabs must not thrash 2 cores


@st.cache_resource(max_entries=2)
def get_model(name: str, pretrained: bool) -> vl.LoadedModel:
    return vl.load_model(name, pretrained=pretrained)


@st.cache_data(max_entries=8)
def get_analysis(_m: vl.LoadedModel, name: str, pretrained: bool, images: tuple[str, ...]) -> vl.AnalysisResult:
    with _LOCK:
        return vl.analyze(_m, vl.sample_images(images), batch_size=4)


st.set_page_config(page_title="vitlens", layout="wide")
st.title("vitlens")
st.caption("The interpretability views of *An Image is Worth 16x16 Words* (ICLR 2021, section 4.5) for timm ViTs.")

default = "ref-vit" if weights_path("ref-vit").is_file() else "vit_tiny_patch16_224"
with st.sidebar:
    name = st.text_input("Model (reference name, preset or timm name)", value=default)
    pretrained = st.checkbox("Pretrained hub weights", value=not name.startswith("ref-") and name != default)
    images = st.multiselect("Sample images", list(SAMPLE_NAMES), default=list(SAMPLE_NAMES)[:2])

try:
    m = get_model(name, pretrained)
except vl.VitlensError as e:
    st.error(str(e))
    st.stop()

s = m.spec
st.sidebar.markdown(f"**{s.name}** — {s.kind}, grid {s.grid[0]}x{s.grid[1]}, stride {s.stride_px[0]} px, "
                    f"{s.num_prefix_tokens} prefix tokens, {s.num_layers} layers x {s.num_heads} heads, "
                    f"device {m.device}")
if not images:
    st.info("Pick at least one sample image.")
    st.stop()

result = get_analysis(m, name, pretrained, tuple(images))
tabs = st.tabs(["Filters", "Position embeddings", "Attention distance", "Rollout"])
with tabs[0]:
    st.plotly_chart(figures.filters_figure(result.filters), width="stretch")
with tabs[1]:
    if result.position is None:
        st.info(result.position_note)
    else:
        st.plotly_chart(figures.position_figure(result.position), width="stretch")
with tabs[2]:
    st.plotly_chart(figures.distance_figure(result.distance), width="stretch")
with tabs[3]:
    x = m.preprocess(vl.sample_images(images))
    for i in range(len(images)):
        st.plotly_chart(figures.rollout_figure(result.rollout, display_image(x[i], m.data_config), index=i),
                        width="stretch")
