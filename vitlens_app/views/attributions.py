"""The Attributions page: the registry's methods offered for the model's kind, their maps of the current image,
their faithfulness scores and curves, AttnLRP's ledger, and the sanity check on demand."""
from __future__ import annotations

import time

import numpy as np
import streamlit as st

import vitlens as vl
from vitlens import figures
from vitlens_app import kind_choices
from vitlens_app.caches import ledger_result, method_table, remembered
from vitlens_app.context import Context, figure_download, whole_table
from vitlens_app.library import (METHOD_TABLE, METRIC_TABLE, counted, default_metrics,
                                 has_text_tower, lrp_methods, methods_for, metric_label, preselected_methods,
                                 round_significant, time_left, timing_note, verdict_rule)
from vitlens_app.library import ComparisonTable

#: why the Attributions view of a CLIP / SigLIP model offers no sanity check
NO_TEXT_SANITY = ("No sanity check for a model with a text tower: the cascade (Adebayo et al. 2018) re-initialises "
                  "a classifier's head and then its blocks, and a prompt's model has no classifier head to start "
                  "from (its text tower would be randomised as the \"head\"), so `vl.sanity_table` explains "
                  "classes only.")


def render_attributions(ctx: Context) -> None:
    """The methods and metrics picked, scored on the current image (its object mask when the images have masks)."""
    m = ctx.m
    text = has_text_tower(m)
    tower = not text and m.spec.num_classes <= 0  # no class and no prompt: the output itself (tower_targets)
    what = ("the image's similarity to the prompt" if text else "the class probability" if not tower else
            "the output's cosine similarity to the unperturbed image's output")
    asks = ("the prompt (the cosine similarity of image and text embeddings)" if text else "one class" if not tower
            else "the output's norm (the tower has no classifier head, so there is no class or class probability)")
    st.caption(f"Rollout shows where information was mixed; the other methods ask what supports {asks}. "
               "Deletion/insertion curves test each map: removing the patches it ranks first should make "
               f"{what} fall fast (low deletion AUC), inserting them should make it rise fast.")
    c = st.columns([3, 2, 1])
    offered = methods_for(m)  # the methods defined for the model's kind (Method.kinds), as vl.attribute accepts
    methods = c[0].multiselect("Methods", list(offered), default=list(preselected_methods(m)), key="methods")
    if kind_choices.attributions_by_stage(m.spec):  # what the registry leaves out, and where the CAMs' maps sit
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
    figs = figures.attribution_figures(table, ctx.shown)  # the report's figures of the same table and image
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
    if not text and not tower:  # the ledger splits a logit; a tower's norm is no logit
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


def attributed_table(ctx: Context, methods: list[str], target: int | str | None, steps: int,
                     mask: np.ndarray | None, metrics: tuple[str, ...] | None = None) -> ComparisonTable:
    """The chosen methods' table, one method at a time (each cached), under a bar that names the method being
    computed and the time left at the rate of the methods computed so far in this run (a cached one is free)."""
    bar = st.progress(0.0, text="Attributing and scoring ...")
    tables, spent, computed = [], 0.0, 0
    try:  # a method that fails takes its bar with it: no "1 of 3" left standing under the message
        for i, method in enumerate(methods):
            left = time_left(spent, computed, computed + len(methods) - i)
            bar.progress(i / len(methods), text=f"Attributing and scoring: {method} ({i + 1} of {len(methods)})"
                         + (f", {left}" if left else ""))
            t0 = time.perf_counter()
            tables.append(method_table(ctx.m, ctx.mkey, ctx.current, ctx.cur_key, method, target,
                                       (("n_steps", steps),) if method == "integrated_gradients" else (), mask,
                                       metrics))
            took = time.perf_counter() - t0
            if took > 0.05:  # computed here, not read from the cache
                spent, computed = spent + took, computed + 1
    finally:
        bar.empty()
    return ComparisonTable.concat(tables)


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
    table = remembered("sanity_memo", (ctx.mkey, ctx.cur_key, tuple(methods), target), lambda progress: vl.sanity_table(
        ctx.m, [ctx.current], methods=methods, target=target, progress=progress),
        f"Sanity checks of {counted(len(methods), 'method')} (maps computed)", len(methods) * (ctx.m.spec.num_layers + 3))
    st.caption("Each map recomputed after every step of the cascade, for the same target; similarity to the "
               "original map (Spearman on |maps| and on signed maps, SSIM). A map that barely changes when the "
               "weights are random cannot be explaining the model.")
    st.plotly_chart(figures.sanity_figure(table.results), key="sanity-fig")
    st.caption(verdict_rule(table.results[0].threshold))  # the report's words for the same rule
    import pandas as pd

    whole_table(round_significant(pd.DataFrame(table.readable_rows())))
