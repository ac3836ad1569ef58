"""The Features page (issue 66; docs/definitions.md, "SAE feature views"): a sparse autoencoder on a block's residual
stream, trained here with a progress bar or read from a file, and its features browsed by frequency or logit effect:
each one's top images with its activation over the token grid, its statistics (where in the image it fires, beside
the position-embedding view), the heads that write it against their mean attention distance, and an ablation or clamp
of it with the logits' and the rollout's change.

Every number comes from the library (``vl.sae_features``, ``vl.sae_intervene``, ``vl.train_sae``, ``vl.load_sae``); each
section fails on its own, with the library's message.
"""
from __future__ import annotations

from typing import Any, Callable

import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app.caches import position_result, remembered
from vitlens_app.context import Context, downloads, show_error
from vitlens_app.library import counted, generate

#: the train scenes the page offers for the embedded pair: a stream the pair was not trained on, not the held-out one
TRAIN_SEED = 7
TRAIN, LOAD = "Train an SAE here", "Load an SAE file"
#: the dictionary sizes offered
SIZES = (64, 128, 256, 512, 1024, 2048)


def render_sae(ctx: Context) -> None:
    """The SAE (trained or loaded), then its features over the sidebar's images, each section under its guard."""
    st.caption("A sparse autoencoder writes each token of a block's residual stream as a few features (directions); "
               "a feature is read by the patches that light it up (docs/definitions.md, \"Sparse autoencoder\", "
               "\"SAE feature views\").")
    try:
        got = sae_source(ctx)
    except Exception as e:  # noqa: BLE001 - the page shows the message and keeps working
        show_error(e)
        return
    if got is None:
        return
    sae, skey = got
    try:
        r = remembered("sae_features_memo", (ctx.mkey, ctx.ikey, skey), lambda progress: vl.sae_features(
            ctx.m, sae, ctx.images, labels=ctx.labels, top=8, progress=progress),
            f"Features over {counted(len(ctx.images), 'image')}", len(ctx.images))
    except Exception as e:  # noqa: BLE001 - the page shows the message and keeps working
        show_error(e)
        return
    st.caption(r.summary())
    fig = figures.sae_frequency_figure(r)
    st.plotly_chart(fig, key="sae-freq-fig")
    downloads(r, fig, "sae-features")
    feature = feature_choice(r)
    shown = ctx.m.display(ctx.images)
    for title, section in (("Top images", top_section), ("Statistics", stats_section),
                           ("Writers", writers_section), ("Ablation", ablation_section)):
        st.subheader(title)
        guarded(section, ctx, r, feature, shown, sae, skey)


def guarded(section: Callable[..., None], *args: Any) -> None:
    """One section; its failure is its own message, never the page's end."""
    try:
        section(*args)
    except Exception as e:  # noqa: BLE001 - the page shows the message and keeps working
        show_error(e)


def sae_source(ctx: Context) -> tuple[Any, str] | None:
    """The SAE: trained here (site, size, k, epochs, tokens, images) once asked, or read from a path; and its key."""
    how = st.radio("SAE", [TRAIN, LOAD], horizontal=True, key="sae-source")
    if how == LOAD:
        path = st.text_input("SAE file or folder (vitlens, SAELens / ViT-Prisma, saev)", key="sae-path").strip()
        if not path:
            st.info("Give the path of an SAE saved by vitlens.sae.save_sae, a SAELens / ViT-Prisma folder or a saev "
                    "checkpoint.")
            return None
        sae = remembered("sae_file_memo", (path,), lambda progress: vl.load_sae(path), "Reading the SAE", 1)
        st.caption(f"Read {path}: {sae.extra_repr()}")
        return sae, f"file-{path}"
    spec = ctx.m.spec
    c = st.columns(5)
    sites = [f"blocks.{i}.hook_resid_post" for i in range(spec.num_layers)]
    # the middle block by default: an edit of the last block's patch tokens cannot reach a head that reads the class
    # token, so its ablation would show nothing
    site = c[0].selectbox("Site", sites, index=len(sites) // 2, key="sae-site")
    size = int(c[1].selectbox("Features", SIZES, index=2, key="sae-size"))
    k = int(c[2].number_input("k (active per token)", 1, size, min(8, size), key="sae-k"))
    epochs = int(c[3].number_input("Epochs", 1, 20, 3, key="sae-epochs"))
    tokens = c[4].radio("Tokens", ["patches", "all"], key="sae-tokens")
    scenes = 0
    if spec.name in ("ref-vit", "ref-hybrid"):  # the pair knows the shape scenes: a train split of its own
        scenes = int(st.slider("Train scenes (0: the sidebar's images)", 0, 2000, 500, 100, key="sae-scenes"))
    images = list(generate(scenes, seed=TRAIN_SEED).images) if scenes else ctx.images
    where = f"{scenes} train scenes (seed {TRAIN_SEED})" if scenes else "the sidebar's images"
    if not st.checkbox(f"Train the SAE on {where}", key="sae-train-on",
                       help="one forward per batch, one optimisation step on its tokens"):
        return None
    key = (ctx.mkey, site, size, k, epochs, tokens, scenes or ctx.ikey)
    trained = remembered("sae_train_memo", key, lambda progress: vl.train_sae(
        ctx.m, images, site=site, n_features=size, k=k, tokens=tokens, epochs=epochs, progress=progress),
        "Training the SAE", len(images) * epochs)
    st.caption(trained.summary())
    return trained.sae, "trained-" + "-".join(map(str, key))


def feature_choice(r: Any) -> int:
    """The feature browsed: the shown features ordered by frequency or by the size of their logit effect."""
    c = st.columns([1, 3])
    by = c[0].radio("Order by", ["frequency", "logit effect"], key="sae-order")
    ordered = [int(f) for f in r.order("frequency" if by == "frequency" else "logit_effect")]

    def label(f: int) -> str:
        best = r.top_logits(f, 1)
        tail = f"; raises {best[0][0]} ({best[0][1]:+.3g})" if best else ""
        return f"feature {f}: active on {r.frequency[f]:.2%} of tokens{tail}"
    return int(c[1].selectbox("Feature", ordered, format_func=label, key="sae-feature"))


def top_section(ctx: Context, r: Any, feature: int, shown: list, sae: Any, skey: str) -> None:
    st.plotly_chart(figures.sae_top_images_figure(r, feature, shown), key="sae-top-fig")


def stats_section(ctx: Context, r: Any, feature: int, shown: list, sae: Any, skey: str) -> None:
    """The feature's numbers, and the position embedding's similarity beside where it fires."""
    st.plotly_chart(figures.sae_feature_figure(r, feature), key="sae-stats-fig")
    if r.logit_note:
        st.caption(f"No logit effect: {r.logit_note}.")
    with st.expander("The position embedding's similarity (Fig. 7 centre), to read the grid cells against"):
        try:
            st.plotly_chart(figures.position_figure(position_result(ctx.m, ctx.mkey, tuple(r.grid))),
                            key="sae-position-fig")
        except vl.ViewNotAvailableError as e:
            st.caption(e.message_for("app"))


def writers_section(ctx: Context, r: Any, feature: int, shown: list, sae: Any, skey: str) -> None:
    st.plotly_chart(figures.sae_writers_figure(r, feature), key="sae-writers-fig")
    st.caption("Each head's output (its heads' site times its share of the output projection) read along the "
               "feature's encoder direction, against the head's mean attention distance over the same images: "
               "local heads sit left, global heads right.")


def ablation_section(ctx: Context, r: Any, feature: int, shown: list, sae: Any, skey: str) -> None:
    """The feature ablated or clamped on its top images: the logits and the rollout before and after."""
    c = st.columns(3)
    mode = c[0].radio("Edit", ["ablate", "clamp"], horizontal=True, key="sae-mode")
    row = r.row(feature)
    top = float(r.top_values[row, 0]) if r.top_values.size else 1.0
    value = float(c[1].number_input("Clamp to", value=round(2 * top, 3), key="sae-clamp")) if mode == "clamp" else None
    if not c[2].checkbox("Run the edit", key="sae-edit-on", help="two streams: untouched and edited"):
        return
    picked = [int(i) for i in r.top_images[row] if i >= 0][:4] or [ctx.index]
    images = [ctx.images[i] for i in picked]
    edit = remembered("sae_edit_memo", (ctx.mkey, ctx.ikey, skey, feature, mode, value, tuple(picked)),
                      lambda progress: vl.sae_intervene(ctx.m, sae, images, feature, mode=mode, value=value,
                                                        progress=progress), "Editing the feature", len(images))
    fig = figures.sae_intervention_figure(edit, [shown[i] for i in picked])
    st.plotly_chart(fig, key="sae-edit-fig")
    st.caption(edit.summary())
    st.dataframe(edit.to_pandas(), hide_index=True, key="sae-edit-table")
    downloads(edit, fig, "sae-intervention")


__all__ = ["render_sae"]
