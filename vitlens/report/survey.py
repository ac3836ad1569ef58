"""The survey report: one offline HTML page over a whole model zoo (paper Fig. 11 across the zoo).

Figures from the survey's tidy table: attention distance against depth for every model on one
figure (hybrids dashed, plain ViTs solid), the spread of layer-1 heads per model, a sortable
summary table, and the per-class breakdown when the images have classes. Distances are in units
of the image width throughout, so models of different input sizes compare. The app's Survey view
shows the same figures and table (``survey_figures``, ``summary_rows``).
"""
from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..figures import model_colours
from ..kinds import VIT, find_kind
from ..survey.store import SurveyResult, source_count, weights_of
from .html import figure_html, html_table, page_html
from ..reference import CLASSES

def kind_word(kind: str) -> str:
    """A kind's word in the survey's tables (``Kind.short``: "ViT", "hybrid"), or its name when no registered kind
    has it."""
    found = find_kind(kind)
    return found.short if found is not None else kind


def _cnn_stem(kind: str) -> bool:
    """Whether a CNN makes the kind's tokens (a hybrid's line is dashed)."""
    found = find_kind(kind)
    return found is not None and found.cnn_stem


def _entry(manifest: dict, model: str, weights: str) -> dict:
    for entry in manifest["models"].values():
        if entry["name"] == model and weights_of(entry) == weights:
            return entry
    return {}


def _kind(manifest: dict, model: str, weights: str = "pretrained") -> str:
    return (_entry(manifest, model, weights).get("spec") or {}).get("kind", VIT.name)


def model_label(model: str, weights: str, kind: str = VIT.name) -> str:
    """How the page names a surveyed model: 'vit_tiny_patch16_224 (ViT, random init)'."""
    return f"{model} ({kind_word(kind)}, {weights})"


def _models(frame: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(model, weights, rows) for each surveyed model in the frame, sorted by name."""
    if frame.empty:
        return []
    return [(model, weights, rows) for (model, weights), rows in frame.groupby(["model", "weights"], sort=True)]


def heads_frame(result: SurveyResult, metric: str = "mean_distance_width") -> pd.DataFrame:
    t = result.table
    # per head (a hierarchical model's rows per block and per stage have no head)
    return t[(t["metric"] == metric) & t["class"].isna() & t["layer"].notna() & t["head"].notna()].astype(
        {"layer": int, "head": int})


def colours_of(result: SurveyResult) -> dict[tuple[str, str], str]:
    """Each surveyed (model, weights)'s colour, one for all the survey's figures: ``figures.model_colours`` over every
    model of the table (the app's Compare and compare.html give the same models the same colours)."""
    models = [(model, weights) for model, weights, _rows in _models(heads_frame(result))]
    return dict(zip(models, model_colours([m for m, _w in models], [w for _m, w in models])))


def depth_figure(result: SurveyResult) -> go.Figure:
    """Median head distance per layer for every model (layers as a fraction of depth), hybrids dashed."""
    fig = go.Figure()
    colours = colours_of(result)
    for model, weights, rows in _models(heads_frame(result)):
        med = rows.groupby("layer")["value"].median()
        depth = len(med)
        kind = _kind(result.manifest, model, weights)
        label = model_label(model, weights, kind)
        fig.add_trace(go.Scatter(
            x=(med.index.to_numpy() / depth), y=med.to_numpy(), mode="lines+markers", name=label,
            line=dict(color=colours[model, weights], dash="dash" if _cnn_stem(kind) else "solid"),
            hovertemplate=f"{label}<br>layer %{{customdata}} of {depth}<br>median distance %{{y:.3f}} of the width"
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
    fig = go.Figure()
    colours = colours_of(result)
    for model, weights, rows in _models(frame[frame["layer"] == 1]):
        label = model_label(model, weights, _kind(result.manifest, model, weights))
        fig.add_trace(go.Box(y=rows["value"], name=label, boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(color=colours[model, weights]), line=dict(width=1)))
    fig.update_layout(title="Layer-1 heads per model<br><sup>mean attention distance of every head, in image widths"
                            "</sup>", yaxis=dict(title="image widths", rangemode="tozero"), showlegend=False,
                      height=420, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def class_frame(result: SurveyResult) -> pd.DataFrame:
    """Per-class head distances in image widths (older tables hold them in pixels only: divided
    by each model's input width)."""
    t = result.table
    per = t[(t["metric"] == "mean_distance_width") & t["class"].notna()]
    if not per.empty:
        return per
    px = t[(t["metric"] == "mean_distance_px") & t["class"].notna()].copy()
    widths = {(m["name"], weights_of(m)): float((m.get("spec") or {}).get("image_size", (0, 0))[1] or np.nan)
              for m in result.manifest["models"].values()}
    px["value"] = [v / widths.get((m, w), np.nan) for v, m, w in zip(px["value"], px["model"], px["weights"])]
    return px


def class_figure(result: SurveyResult) -> go.Figure | None:
    """Mean attention distance over all heads, per model and class (when the images have classes),
    in image widths."""
    per = class_frame(result)
    if per.empty:
        return None
    per = per.assign(label=[model_label(m, w, _kind(result.manifest, m, w))
                            for m, w in zip(per["model"], per["weights"])])
    grid = per.groupby(["label", "class"])["value"].mean().unstack("class")
    z = grid.to_numpy(dtype=np.float64)
    # the scale anchored at 0 (no distance), up to the largest value: a spread of 0.45-0.50 widths stretched over the
    # whole scale made 0.05 look like yellow against purple
    top = float(np.nanmax(z)) if np.isfinite(z).any() else 1.0
    low = float(np.nanmin(z)) if np.isfinite(z).any() else 0.0
    fig = go.Figure(go.Heatmap(z=z, x=list(grid.columns), y=list(grid.index), colorscale="Viridis",
                               zmin=0.0, zmax=max(top, 1e-12), colorbar=dict(title="widths"),
                               hovertemplate="%{y}<br>class %{x}<br>mean distance %{z:.3f} of the width"
                                             "<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title="Mean attention distance per class<br><sup>mean over all heads and layers, in image "
                            f"widths; values {low:.3f}-{top:.3f}, colours from 0 to {top:.3f}</sup>",
                      height=max(300, 40 * len(grid) + 120), margin=dict(l=10, r=10, t=70, b=10))
    return fig


def accuracy_note(entry: dict, source: dict) -> str:
    """Why a model's accuracy on the survey's labels means nothing, or how far it can be read
    ("" when it is what it says: the embedded models on shape scenes, say)."""
    classes = list(source.get("classes") or [])
    n_model = int((entry.get("spec") or {}).get("num_classes") or 0)
    weights = weights_of(entry)
    if not classes or not n_model:
        return ""  # no accuracy was computed
    if weights == "random init":
        return "random weights: the accuracy means nothing"
    if source.get("kind") == "shapes":
        if weights == "embedded":
            return ""
        return (f"the labels are the {len(classes)} shape classes, not this model's {n_model} classes: the accuracy "
                "means nothing")
    if weights == "embedded" and classes != list(CLASSES):
        return "the embedded models know only six synthetic shapes: the accuracy means nothing on these images"
    if len(classes) != n_model:
        return (f"the labels number the {len(classes)} class folders in sorted order, not this model's {n_model} "
                "classes: the accuracy means nothing")
    return (f"the labels number the {len(classes)} class folders in sorted order: the accuracy holds only if that "
            "is the model's class order (as for ImageNet's val/<synset> folders)")


def summary_rows(result: SurveyResult) -> list[dict[str, Any]]:
    """One row per model: kind, depth, images, accuracy, layer-1 spread, depth ratio, rollout stats."""
    t = result.table
    frame = heads_frame(result)
    rows = []
    for entry in result.manifest["models"].values():
        model, spec, weights = entry["name"], entry.get("spec") or {}, weights_of(entry)
        row: dict[str, Any] = {"model": model, "weights": weights, "status": entry.get("status", "")}
        if entry.get("status") != "done":
            row["note"] = entry.get("reason", "")
            rows.append(row)
            continue
        mine = (frame["model"] == model) & (frame["weights"] == weights)
        heads = frame[mine]
        med = heads.groupby("layer")["value"].median()  # empty where no distance was surveyed: NaN cells below
        first = heads[heads["layer"] == 1]["value"]
        per_stage = t["stage"].notna() if "stage" in t.columns else False  # a hierarchical model's stage rows
        scalars = t[(t["model"] == model) & (t["weights"] == weights) & t["layer"].isna()
                    & t["class"].isna() & ~per_stage].set_index("metric")["value"]
        row.update({"kind": kind_word(spec.get("kind", "")),
                    "layers x heads": f"{spec.get('num_layers')} x {spec.get('num_heads')}",
                    "images": int(scalars.get("images_used", 0)), "skipped": len(entry.get("skipped", [])),
                    "accuracy": scalars.get("accuracy", np.nan),
                    "accuracy note": accuracy_note(entry, result.manifest.get("source", {})),
                    "layer-1 min": float(first.min()), "layer-1 median": float(first.median()),
                    "layer-1 max": float(first.max()),
                    "depth ratio": float(med.iloc[-1] / med.iloc[0]) if len(med) else np.nan,
                    "rollout on prefix": scalars.get("rollout_prefix_mass", np.nan),
                    "rollout entropy (nats)": scalars.get("rollout_entropy", np.nan),
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


def survey_figures(result: SurveyResult) -> dict[str, go.Figure]:
    figs = {"depth": depth_figure(result), "layer1": layer1_figure(result)}
    per_class = class_figure(result)
    if per_class is not None:
        figs["per-class"] = per_class
    return figs


def settings_text(manifest: dict) -> str:
    """The survey's settings in words: 'shards of 256 images · batches of 32 · views: distance, ...'."""
    st = manifest.get("settings", {})
    parts = []
    if "shard_size" in st:
        parts.append(f"shards of {st['shard_size']} images")
    if "batch_size" in st:
        parts.append(f"batches of {st['batch_size']}")
    if st.get("views"):
        parts.append("views: " + ", ".join(st["views"]))
    if "renormalize" in st:
        parts.append("distance over patch keys, renormalised" if st["renormalize"] else
                     "distance over raw attention weights")
    parts += [f"{k}: {v}" for k, v in st.items() if k not in ("shard_size", "batch_size", "views", "renormalize")]
    return " · ".join(parts)


def survey_html(result: SurveyResult) -> str:
    """The whole survey page (plotly.js inlined once; opens offline)."""
    m = result.manifest
    figs = survey_figures(result)
    failed = "".join(f"<li>{html.escape(name)}: {html.escape(reason)}</li>" for name, reason in result.failed.items())
    rows = summary_rows(result)
    notes = [f"<li>{html.escape(model_label(r['model'], r['weights'], _kind(m, r['model'], r['weights'])))}: "
             f"{html.escape(r['accuracy note'])}</li>" for r in rows if r.get("accuracy note")]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    body = [f"<h1>vitlens survey</h1><p class='muted'>{html.escape(str(result.path))}</p>"
            f"<p>Images: {html.escape(m['source']['description'])} ({source_count(m['source'])} images)</p>"
            f"<p class='muted'>Settings: {html.escape(settings_text(m))}<br>Versions: {html.escape(versions)}</p>",
            f"<p class='note'>Failed models:</p><ul>{failed}</ul>" if failed else "",
            figure_html(figs["depth"]), figure_html(figs["layer1"]),
            "<h2>Models</h2><p class='muted'>Click a column to sort. Distances in image widths; depth ratio = "
            "last layer's median / first layer's.</p>",
            html_table(rows, "{:.3f}", sortable=True, empty="<p>No models.</p>")]
    if notes:
        body.append(f"<p class='note'>What the accuracy means:</p><ul>{''.join(notes)}</ul>")
    if "per-class" in figs:
        body += ["<h2>Per class</h2>", figure_html(figs["per-class"])]
    body.append(f"<script>{_SORT_JS}</script>")
    return page_html("vitlens survey", "".join(body))
