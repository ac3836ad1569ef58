"""The survey report: one offline HTML page over a whole model zoo (paper Fig. 11 across the zoo).

Figures from the survey's tidy table: attention distance against depth for every model on one
figure (hybrids dashed, plain ViTs solid; in units of the image width, so models of different
input sizes compare), the spread of layer-1 heads per model, a sortable summary table, and the
per-class breakdown when the images have classes.
"""
from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..figures import PALETTE
from .store import SurveyResult


def _kind(manifest: dict, model: str) -> str:
    for entry in manifest["models"].values():
        if entry["label"] == model:
            return (entry.get("spec") or {}).get("kind", "vit")
    return "vit"


def heads_frame(result: SurveyResult, metric: str = "mean_distance_width") -> pd.DataFrame:
    t = result.table
    return t[(t["metric"] == metric) & t["class"].isna()].astype({"layer": int, "head": int})


def depth_figure(result: SurveyResult) -> go.Figure:
    """Median head distance per layer for every model (layers as a fraction of depth), hybrids dashed."""
    frame = heads_frame(result)
    fig = go.Figure()
    for i, (model, rows) in enumerate(frame.groupby("model", sort=True)):
        med = rows.groupby("layer")["value"].median()
        depth = len(med)
        kind = _kind(result.manifest, model)
        fig.add_trace(go.Scatter(
            x=(med.index.to_numpy() / depth), y=med.to_numpy(), mode="lines+markers", name=f"{model} ({kind})",
            line=dict(color=PALETTE[i % len(PALETTE)], dash="dash" if kind == "hybrid" else "solid"),
            hovertemplate=f"{model}<br>layer %{{customdata}} of {depth}<br>median distance %{{y:.3f}} of the width"
                          "<extra></extra>", customdata=med.index.to_numpy()))
    fig.update_layout(title="Attention distance against depth across the zoo<br><sup>median over heads, in image "
                            "widths; hybrids dashed (paper Fig. 11)</sup>",
                      xaxis=dict(title="depth (layer / number of layers)", range=[0, 1.05]),
                      yaxis=dict(title="median mean attention distance (image widths)", rangemode="tozero"),
                      height=480, margin=dict(l=10, r=10, t=70, b=10), legend=dict(orientation="h", y=-0.2))
    return fig


def layer1_figure(result: SurveyResult) -> go.Figure:
    """Every layer-1 head of every model: the spread of local and global heads at the bottom of the network."""
    frame = heads_frame(result)
    first = frame[frame["layer"] == 1]
    fig = go.Figure()
    for i, (model, rows) in enumerate(first.groupby("model", sort=True)):
        fig.add_trace(go.Box(y=rows["value"], name=model, boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(color=PALETTE[i % len(PALETTE)]), line=dict(width=1)))
    fig.update_layout(title="Layer-1 heads per model<br><sup>mean attention distance of every head, in image widths"
                            "</sup>", yaxis=dict(title="image widths", rangemode="tozero"), showlegend=False,
                      height=420, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def class_figure(result: SurveyResult) -> go.Figure | None:
    """Mean attention distance over all heads, per model and class (when the images have classes)."""
    t = result.table
    per = t[(t["metric"] == "mean_distance_px") & t["class"].notna()]
    if per.empty:
        return None
    grid = per.groupby(["model", "class"])["value"].mean().unstack("class")
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=list(grid.columns), y=list(grid.index), colorscale="Viridis",
                               colorbar=dict(title="px"),
                               hovertemplate="%{y}<br>class %{x}<br>mean distance %{z:.1f} px<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title="Mean attention distance per class<br><sup>mean over all heads and layers, pixels</sup>",
                      height=max(300, 40 * len(grid) + 120), margin=dict(l=10, r=10, t=70, b=10))
    return fig


def summary_rows(result: SurveyResult) -> list[dict[str, Any]]:
    """One row per model: kind, depth, images, accuracy, layer-1 spread, depth ratio, rollout stats."""
    t = result.table
    frame = heads_frame(result)
    rows = []
    for entry in result.manifest["models"].values():
        model, spec = entry["label"], entry.get("spec") or {}
        row: dict[str, Any] = {"model": model, "status": entry.get("status", "")}
        if entry.get("status") != "done":
            row["note"] = entry.get("reason", "")
            rows.append(row)
            continue
        heads = frame[frame["model"] == model]
        med = heads.groupby("layer")["value"].median()
        first = heads[heads["layer"] == 1]["value"]
        scalars = t[(t["model"] == model) & t["layer"].isna() & t["class"].isna()].set_index("metric")["value"]
        row.update({"kind": spec.get("kind", ""), "layers x heads": f"{spec.get('num_layers')} x {spec.get('num_heads')}",
                    "images": int(scalars.get("images_used", 0)), "skipped": len(entry.get("skipped", [])),
                    "accuracy": scalars.get("accuracy", np.nan),
                    "layer-1 min": float(first.min()), "layer-1 median": float(first.median()),
                    "layer-1 max": float(first.max()), "depth ratio": float(med.iloc[-1] / med.iloc[0]),
                    "rollout on prefix": scalars.get("rollout_prefix_mass", np.nan),
                    "rollout entropy": scalars.get("rollout_entropy", np.nan),
                    "rollout in mask": scalars.get("rollout_mass_in_mask", np.nan)})
        rows.append(row)
    return rows


_SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th, col) {
  th.style.cursor = 'pointer';
  th.addEventListener('click', function() {
    var table = th.closest('table'), body = table.tBodies[0], rows = Array.from(body.rows);
    var asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
    rows.sort(function(a, b) {
      var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? c : -c;
    });
    rows.forEach(function(r) { body.appendChild(r); });
  });
});
"""


def sortable_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>No models.</p>"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)

    def cell(v: Any) -> str:
        if isinstance(v, float):
            shown = "" if np.isnan(v) else f"{v:.3f}"
            return f"<td data-v='{'' if np.isnan(v) else v}'>{shown}</td>"
        return f"<td data-v='{html.escape(str(v if v is not None else ''))}'>{html.escape(str(v if v is not None else ''))}</td>"

    body = "".join("<tr>" + "".join(cell(r.get(k, "")) for k in keys) + "</tr>" for r in rows)
    return f"<table class='sortable'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def survey_figures(result: SurveyResult) -> dict[str, go.Figure]:
    figs = {"depth": depth_figure(result), "layer1": layer1_figure(result)}
    per_class = class_figure(result)
    if per_class is not None:
        figs["per-class"] = per_class
    return figs


def survey_html(result: SurveyResult) -> str:
    """The whole survey page (plotly.js inlined once; opens offline)."""
    from ..report.html import _fig, _page

    m = result.manifest
    figs = survey_figures(result)
    failed = "".join(f"<li>{html.escape(name)}: {html.escape(reason)}</li>" for name, reason in result.failed.items())
    body = [f"<h1>vitlens survey</h1><p class='muted'>{html.escape(str(result.path))} · images: "
            f"{html.escape(m['source']['description'])} · settings: {html.escape(str(m['settings']))} · "
            f"{html.escape(', '.join(f'{k} {v}' for k, v in m.get('versions', {}).items()))}</p>",
            f"<p class='note'>Failed models:</p><ul>{failed}</ul>" if failed else "",
            _fig(figs["depth"]), _fig(figs["layer1"]),
            "<h2>Models</h2><p class='muted'>Click a column to sort. Distances in image widths; depth ratio = "
            "last layer's median / first layer's.</p>", sortable_table(summary_rows(result))]
    if "per-class" in figs:
        body += ["<h2>Per class</h2>", _fig(figs["per-class"])]
    body.append(f"<script>{_SORT_JS}</script>")
    return _page("vitlens survey", "".join(body))
