"""Offline HTML reports: every view of each model (paper Fig. 6, 7) and the ViT-vs-hybrid
attention-distance comparison (Fig. 11), as one self-contained file plus the numbers as data.

Pure composition: the numbers come from the library's result objects and the pictures from
``vitlens.figures``; this module only lays them out. plotly.js is inlined once per file.
"""
from __future__ import annotations

import datetime as _dt
import html
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go

from . import figures
from .analyze import AnalysisResult
from .results import Result
from .views.distance import AttentionDistanceResult


@dataclass(eq=False)
class ReportData(Result):
    """The numbers behind a report: one AnalysisResult per model and how they were made."""

    kind = "report"
    models: list[str]
    analyses: list[AnalysisResult]
    image_set: dict
    environment: dict
    timings: dict = field(default_factory=dict)
    command: str = ""
    attributions: list = field(default_factory=list)  # one ComparisonTable per model with --attributions


@dataclass(eq=False)
class ComparisonData(Result):
    """The numbers behind a comparison (Fig. 11): distance per head for each model, per-layer
    min/median/max and the share of local heads in the first layers.

    ``units`` is "px" when all models share an input width, else "width" (fractions of it).
    """

    kind = "comparison"
    models: list[str]
    distances: list[AttentionDistanceResult]
    units: str
    local_threshold: float
    first_layers: int
    table: list[dict]
    local_share: list[float]
    image_set: dict
    environment: dict
    timings: dict = field(default_factory=dict)
    command: str = ""


def comparison_units(distances: Sequence[AttentionDistanceResult]) -> str:
    """Pixels when every model sees the same input width, else fractions of the image width."""
    return "px" if len({d.image_size[1] for d in distances}) == 1 else "width"


def layer_table(distances: Sequence[AttentionDistanceResult], names: Sequence[str], units: str) -> list[dict]:
    """Rows of (model, layer, min, median, max) of the heads' mean distance."""
    rows = []
    for d, name in zip(distances, names):
        values = d.mean_px if units == "px" else d.mean_fraction_of_width
        for layer, heads in enumerate(values):
            rows.append({"model": name, "layer": layer + 1, "min": float(heads.min()),
                         "median": float(np.median(heads)), "max": float(heads.max())})
    return rows


def local_head_share(d: AttentionDistanceResult, threshold_fraction: float, first_layers: int) -> float:
    """Share of heads in the first ``first_layers`` layers whose mean distance is below
    ``threshold_fraction`` of the image width (the paper's "local" heads, Fig. 7 right)."""
    heads = d.mean_fraction_of_width[:first_layers]
    return float((heads < threshold_fraction).mean())


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;padding:16px;color:#222}
h1{margin-bottom:4px}h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}
th{background:#f3f3f3}.muted{color:#666;font-size:13px}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px}
"""


def _table(rows: Sequence[dict], floatfmt: str = "{:.2f}") -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{floatfmt.format(r[k]) if isinstance(r[k], float) else html.escape(str(r[k]))}</td>"
                         for k in keys) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fig(fig: go.Figure) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})


def _page(title: str, body: str) -> str:
    from plotly.offline import get_plotlyjs

    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{body}</body></html>")


def _header(title: str, image_set: dict, environment: dict, timings: dict) -> str:
    env = ", ".join(f"{k} {html.escape(str(v))}" for k, v in environment.items())
    imgs = html.escape(str(image_set.get("description", "")))
    skipped = image_set.get("skipped") or []
    skip = (f"<p class='note'>{len(skipped)} unreadable image(s) skipped: "
            f"{html.escape(', '.join(skipped[:10]))}{' ...' if len(skipped) > 10 else ''}</p>") if skipped else ""
    times = ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    return (f"<h1>{html.escape(title)}</h1><p class='muted'>Generated {_dt.datetime.now().isoformat(timespec='seconds')}"
            f" · {env}</p><p>Images: {imgs} ({image_set.get('count', '?')} used)</p>{skip}"
            f"<p class='muted'>Timings: {html.escape(times)}</p>")


def _facts(spec: dict) -> str:
    keys = ["name", "kind", "image_size", "grid", "stride_px", "num_prefix_tokens", "has_class_token", "num_layers",
            "num_heads", "embed_dim", "num_params", "num_classes"]
    return _table([{k: spec.get(k) for k in keys}])


def model_section(a: AnalysisResult, display_images: Sequence[np.ndarray], timing: dict[str, float]) -> str:
    """Every view of one model: facts, filters, position tiles, distance, rollout on a few images."""
    spec = a.spec
    parts = [f"<h2>{html.escape(spec['name'])}</h2>", _facts(spec),
             "<p class='muted'>" + html.escape(", ".join(f"{k} {v:.2f} s" for k, v in timing.items())) + "</p>",
             "<h3>Embedding filters (Fig. 7 left)</h3>", _fig(figures.filters_figure(a.filters)),
             "<h3>Position embedding similarity (Fig. 7 centre)</h3>"]
    if a.position is None:
        parts.append(f"<p class='note'>{html.escape(a.position_note)}</p>")
    else:
        parts.append(_fig(figures.position_figure(a.position)))
    parts += ["<h3>Mean attention distance (Fig. 7 right)</h3>", _fig(figures.distance_figure(a.distance)),
              "<h3>Attention rollout (Fig. 6)</h3>",
              "<p class='muted'>Rollout shows where information was mixed across layers, not what caused the "
              "prediction.</p>", _fig(figures.rollout_grid_figure(a.rollout, display_images))]
    return "".join(parts)


def attribution_section(table: Any, image: np.ndarray) -> str:
    """Methods x metrics, the maps of every method on the first image, and the mean curves."""
    fmt_rows = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()} for row in table.rows]
    return ("<h3>Attributions and faithfulness</h3>"
            f"<p class='muted'>Over {table.n_images} images; deletion AUC: lower is more faithful, insertion AUC: "
            "higher is more faithful; pointing game and mass in mask where object masks exist.</p>"
            + _table(fmt_rows, "{:.3f}")
            + _fig(figures.attribution_figure(table.attributions, image, 0))
            + _fig(figures.faithfulness_figure(table.faithfulness)))


def report_html(data: ReportData, display_images: Sequence[Sequence[np.ndarray]]) -> str:
    """The whole report page; ``display_images[i]`` are model i's preprocessed images for overlays."""
    body = [_header("vitlens report", data.image_set, data.environment, data.timings.get("total", {}))]
    for i, (a, imgs) in enumerate(zip(data.analyses, display_images)):
        body.append(model_section(a, imgs, data.timings.get(a.spec["name"], {})))
        if i < len(data.attributions) and data.attributions[i] is not None:
            body.append(attribution_section(data.attributions[i], imgs[0]))
    return _page("vitlens report", "".join(body))


def comparison_html(data: ComparisonData, rollouts: Sequence[tuple[str, Any, np.ndarray]] = ()) -> str:
    """Fig. 11 page: overlaid distances, per-layer table, local-head shares, rollout side by side."""
    unit_note = ("" if data.units == "px" else
                 "<p class='note'>The models see inputs of different widths, so distances are compared in units "
                 "of the image width.</p>")
    shares = [{"model": n, f"local heads in layers 1-{data.first_layers}": f"{100 * s:.0f}%"}
              for n, s in zip(data.models, data.local_share)]
    fmt = "{:.1f}" if data.units == "px" else "{:.3f}"
    body = [_header("vitlens comparison (Fig. 11)", data.image_set, data.environment, data.timings),
            unit_note,
            _fig(figures.distance_figure(data.distances, names=data.models, units=data.units)),
            f"<h2>Share of local heads</h2><p>Heads whose mean distance is below {100 * data.local_threshold:.0f}% "
            f"of the image width, in the first {data.first_layers} layers.</p>", _table(shares),
            f"<h2>Per layer ({'pixels' if data.units == 'px' else 'fraction of image width'})</h2>",
            _table(data.table, fmt)]
    if rollouts:
        panels = [(img, result.maps[0], name) for name, result, img in rollouts]
        body += ["<h2>Rollout on the same image</h2>",
                 _fig(figures.overlay_grid_figure(panels, "Attention rollout (mean fusion) of each model"))]
    return _page("vitlens comparison", "".join(body))
