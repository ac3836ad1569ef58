"""The Survey page: a survey folder written by ``vitlens survey`` (a model zoo x an image set on Ray), its
figures, its table and the models that failed."""
from __future__ import annotations

import streamlit as st

import vitlens as vl
from vitlens_app.context import Context, figure_download
from vitlens_app.library import summary_rows, survey_figures

#: the survey figures' download labels, by figure name
SURVEY_FIGURES = {"depth": "Depth", "layer1": "Layer 1", "per-class": "Per class"}


def render_survey(ctx: Context) -> None:
    """The survey of the folder typed (the sidebar's model and images play no part)."""
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
