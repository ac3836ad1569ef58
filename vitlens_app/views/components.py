"""The Components page (issue 51; docs/definitions.md, "Direct contributions", "Logit lens", "Token norms",
"Activation patching"): what each head adds to the output, with the ledger that closes the sum beside it; what
each depth already predicts; token norms by depth (artifact tokens); and the activation-patching heatmap of the
current image against a corruption of it picked here.

Each section is computed and shown on its own: a model the components refuse (a hierarchical one, a CLIP tower
without a class) or a bad choice shows the library's message in that section, and the rest of the page and the
app keep working.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd
import streamlit as st

from vitlens import figures
from vitlens_app.caches import decomposition_result, lens_result, norms_result, patching_result
from vitlens_app.context import Context, downloads, show_error
from vitlens_app.library import LEDGER_RTOL
from vitlens_app.library import DecompositionResult

#: the corruptions the patching section offers (object masked only where the image set has masks)
NOISE, MASKED, OTHER = "Gaussian noise", "Object masked", "Another image"


def render_components(ctx: Context) -> None:
    """The four sections, each under its own guard."""
    st.caption("The output as an exact sum of parts: embeddings, each head per source token, each MLP and the "
               "biases, the final norm's scale held at the forward's value (docs/definitions.md, \"Direct "
               "contributions\"). The ledger says how closely the parts add up to the output.")
    target = target_choice(ctx)
    for title, section in (("Direct contributions", contributions_section), ("Logit lens", lens_section),
                           ("Token norms by depth", norms_section), ("Activation patching", patching_section)):
        st.subheader(title)
        guarded(section, ctx, target)


def guarded(section: Callable[[Context, int | None], None], ctx: Context, target: int | None) -> None:
    """One section; its failure is its own message, never the page's end."""
    try:
        section(ctx, target)
    except Exception as e:  # noqa: BLE001 - the page shows the message and keeps working
        show_error(e)


def target_choice(ctx: Context) -> int | None:
    """The class read: the prediction (None) or one picked by name."""
    n = ctx.m.spec.num_classes
    if n <= 0:  # a tower: one coordinate of its output is what the page can read (a direction is the API's)
        return int(st.number_input("Output coordinate read (the model has no classes)", 0,
                                   max(ctx.m.spec.embed_dim - 1, 0), 0, key="comp-coordinate"))
    names = ctx.m.label_names() or [f"class {i}" for i in range(n)]
    options = ["predicted class", *names[:n]]
    picked = st.selectbox("Class read", options, key="comp-target")
    return None if picked == "predicted class" else options.index(picked) - 1


def class_name(ctx: Context, k: int) -> str:
    if ctx.m.spec.num_classes <= 0:  # a tower: what is read is a coordinate of its output, not a class
        return f"output coordinate {k}"
    names = ctx.m.label_names()
    return names[k] if names and 0 <= k < len(names) else f"class {k}"


def ledger_rows(d: DecompositionResult) -> pd.DataFrame:
    """The ledger of the current image: each part summed, their total, the output and the relative gap."""
    rows = [{"entry": name, "value": float(np.asarray(v)[0].sum())} for name, v in d.parts().items()]
    rows += [{"entry": "sum of parts", "value": float(d.total()[0])},
             {"entry": "output (forward)", "value": float(d.output[0])},
             {"entry": "ledger (relative gap)", "value": float(d.ledger()[0])}]
    return pd.DataFrame(rows)


def head_frame(d: DecompositionResult) -> pd.DataFrame:
    """The layer x head table of the current image, 1-based labels."""
    table = d.head_table(0)
    return pd.DataFrame(table, index=[f"layer {l + 1}" for l in range(table.shape[0])],
                        columns=[f"head {h + 1}" for h in range(table.shape[1])])


def contributions_section(ctx: Context, target: int | None) -> None:
    """The layer x head table and one head's map over the image, the ledger beside them."""
    d = decomposition_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, target)
    ledger = float(d.ledger()[0])
    read = int(d.target[0]) if ctx.m.spec.num_classes > 0 else int(target or 0)  # a tower's: the coordinate picked
    st.markdown(f"**{class_name(ctx, read)}**: output {d.output[0]:.4g}; ledger {ledger:.1e} "
                f"({'closes' if d.closes() else 'does not close'} within {LEDGER_RTOL:g})")
    fig = figures.contributions_figure(d)
    left, right = st.columns([3, 2])
    left.plotly_chart(fig, key="comp-table-fig")
    with right:
        st.caption("Ledger")
        st.dataframe(ledger_rows(d), hide_index=True, height="content", key="comp-ledger",
                     column_config={"value": st.column_config.NumberColumn("value", format="%.6g")})
    st.caption("Each head's part of the output (summed over source tokens), layer x head")
    st.dataframe(head_frame(d), height="content", key="comp-heads")
    st.caption("Top heads: " + "; ".join(f"layer {l + 1} head {h + 1} ({v:.3g})" for l, h, v in d.top_heads(5)))
    n_layers, n_heads = d.heads.shape[1], d.heads.shape[2]
    best_l, best_h, _ = d.top_heads(1)[0]
    c = st.columns(2)
    layer = int(c[0].slider("Layer", 1, n_layers, best_l + 1, key="comp-layer")) - 1 if n_layers > 1 else 0
    head = int(c[1].selectbox("Head", range(1, n_heads + 1), index=best_h, key="comp-head")) - 1
    image, grid, side = st.columns([1, 2, 1])
    image.image(ctx.shown, caption="the image as the model sees it", width=200)
    grid.plotly_chart(figures.head_contribution_figure(d, layer, head), key="comp-head-fig")
    side.metric("This head's part", f"{d.head_table(0)[layer, head]:.4g}")
    side.metric("Ledger", f"{ledger:.1e}")
    downloads(d, fig, "decomposition")


def lens_section(ctx: Context, target: int | None) -> None:
    """The target's logit by depth, and the top class at each depth."""
    r = lens_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, target)
    fig = figures.logit_lens_figure(r)
    left, right = st.columns([3, 2])
    left.plotly_chart(fig, key="comp-lens-fig")
    frame = pd.DataFrame([{"depth": row["depth"], "target logit": row["logit"],
                           "top class": class_name(ctx, row["top_class"]), "top logit": row["top_logit"]}
                          for row in r.to_rows()])
    right.dataframe(frame, hide_index=True, key="comp-lens")
    st.caption(r.summary())


def norms_section(ctx: Context, target: int | None) -> None:
    """Token norms by depth (depth 0: the embeddings), the outliers and the attention they draw."""
    r = norms_result(ctx.m, ctx.mkey, ctx.current, ctx.cur_key)
    fig = figures.token_norms_figure(r)
    st.plotly_chart(fig, key="comp-norms-fig")
    st.caption(f"{r.summary()}. An outlier is a patch token whose norm exceeds {r.factor:g} x its image's median "
               "patch-token norm at that depth (Darcet et al., ICLR 2024).")
    st.dataframe(r.to_pandas(), hide_index=True, key="comp-norms")


def corrupted(ctx: Context, how: str, sigma: float, other: int) -> tuple[Any, str]:
    """The corruption of the current image picked, and its name (for the cache key)."""
    clean = np.asarray(ctx.current.convert("RGB")) if hasattr(ctx.current, "convert") else np.asarray(ctx.current)
    if how == MASKED and ctx.masks is not None:
        mask = np.asarray(ctx.masks[ctx.index], dtype=bool)
        out = clean.copy()
        out[mask] = clean[~mask].mean(0).astype(np.uint8) if (~mask).any() else 127
        return out, "masked"
    if how == OTHER:
        return ctx.images[other], f"image-{other}"
    noise = np.random.default_rng(0).normal(0.0, sigma * 255.0, clean.shape)
    return np.clip(clean.astype(np.float64) + noise, 0, 255).astype(np.uint8), f"noise-{sigma:g}"


def patching_section(ctx: Context, target: int | None) -> None:
    """Each component of the clean run put into the corrupted run: the share of the clean logit it restores."""
    options = [NOISE] + ([MASKED] if ctx.masks is not None else []) + ([OTHER] if len(ctx.images) > 1 else [])
    c = st.columns(3)
    how = c[0].radio("Corruption", options, horizontal=True, key="comp-corrupt")
    sigma = float(c[1].slider("Noise (x 255)", 0.05, 1.0, 0.5, 0.05, key="comp-sigma")) if how == NOISE else 0.0
    other = 0
    if how == OTHER:
        others = [i for i in range(len(ctx.images)) if i != ctx.index]
        other = int(c[1].selectbox("Corrupted image", others, format_func=lambda i: ctx.names[i], key="comp-other"))
    if not c[2].checkbox("Run the patching", key="comp-patch-on",
                         help="one forward per batch of patches: every block's branches, heads and tokens"):
        return
    bad, name = corrupted(ctx, how, sigma, other)
    r = patching_result(ctx.m, ctx.mkey, ctx.current, bad, f"{ctx.cur_key}-{name}", target)
    fig = figures.patching_figure(r)
    left, right = st.columns([1, 3])
    left.image(ctx.m.display([bad])[0], caption="corrupted", width=200)
    right.plotly_chart(fig, key="comp-patch-fig")
    st.plotly_chart(figures.patching_figure(r, site="resid"), key="comp-patch-tokens-fig")
    st.caption(r.summary() + ". Restored = (patched - corrupted) / (clean - corrupted).")
    downloads(r, fig, "patching")
