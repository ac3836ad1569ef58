"""Offline HTML reports: every view of each model (paper Fig. 6, 7) and the ViT-vs-hybrid
attention-distance comparison (Fig. 11), as one self-contained file plus the numbers as data.

Pure composition: the numbers come from the library's result objects and the pictures from
``vitlens.figures``; this module only lays them out. plotly.js is inlined once per file, and so
is everything else: images go in as PNG, large float arrays as float32, and an image, array or
plotly template that several figures carry is written once and referred to (``_hoist_repeats``).
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import re
from typing import Any, Sequence, cast

import numpy as np
import plotly.graph_objects as go

from .. import figures
from ..figures import attribution_figures  # noqa: F401  (importable here, where the app took it)
from ..attribution.faithfulness import timing_note
from ..attribution.metrics import METRIC_TABLE, metric_label
from ..results import significant
from ..views.analyze import AnalysisResult
from ..views.registry import VIEWS as REGISTRY
from ..views.distance import AttentionDistanceResult, local_rule
from .components import components_figures, components_html
from .sae import sae_figures, sae_html
from .data import ComparisonData, ReportData, distance_reading
from ..words import counted, listed_some
from vitlens.attribution.sanity import verdict_rule


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;
padding:16px;color:#222}
h1{margin-bottom:4px}h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}
th{background:#f3f3f3}td{overflow-wrap:break-word}
.table-wrap{max-width:100%;overflow-x:auto;margin:8px 0}.table-wrap table{margin:0}
.muted{color:#666;font-size:13px}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px}
"""


def html_table(rows: Sequence[dict], floatfmt: str = "{:.2f}", sortable: bool = False, empty: str = "") -> str:
    """The one HTML table builder of the reports: a column per key (in first-seen order over the rows),
    floats through ``floatfmt`` (NaN as an empty cell), text escaped. ``sortable``: the survey's
    click-to-sort table (class ``sortable``; each cell carries its raw value in ``data-v``).
    ``empty``: what to show for no rows. The table sits in a ``table-wrap`` box that scrolls sideways, so
    a wide table (fifteen methods' scores, the survey's models) never runs past the page's right margin."""
    if not rows:
        return empty
    keys = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)

    def cell(v: Any) -> str:
        if v is None:
            v = ""
        if isinstance(v, float):
            shown, raw = ("", "") if np.isnan(v) else (floatfmt.format(v), repr(v))
        else:
            shown = raw = html.escape(str(v))
        return f"<td data-v='{raw}'>{shown}</td>" if sortable else f"<td>{shown}</td>"

    body = "".join("<tr>" + "".join(cell(r.get(k, "")) for k in keys) + "</tr>" for r in rows)
    if sortable:
        table = f"<table class='sortable'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    else:
        table = f"<table><tr>{head}</tr>{body}</table>"
    return f"<div class='table-wrap'>{table}</div>"


def _png_uri(rgb: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def page_figure(fig: go.Figure) -> go.Figure:
    """A copy of ``fig`` that is lighter to inline, drawn the same: RGB(A) uint8 images as PNG
    data URIs instead of pixel arrays (drawn unsmoothed, as plotly draws ``z``), float64 arrays
    of 1024 values or more (overlay heatmaps, position tiles) as float32 (the figures show at
    most four digits)."""
    light = go.Figure(fig)
    for trace in light.data:
        if trace.type == "image" and trace.source is None and trace.z is not None:
            z = np.asarray(trace.z)
            if z.dtype == np.uint8 and z.ndim == 3 and z.shape[2] in (3, 4) and trace.colormodel in (None, "rgb",
                                                                                                      "rgba"):
                trace.update(source=_png_uri(z), z=None, zsmooth=trace.zsmooth or False)  # pixels, unsmoothed
        for attr in ("z", "customdata"):
            value = getattr(trace, attr, None)
            if isinstance(value, np.ndarray) and value.dtype == np.float64 and value.size >= 1024:
                trace[attr] = value.astype(np.float32)
    return light


def figure_html(fig: go.Figure) -> str:
    """One figure as an HTML fragment for a report page (plotly.js is inlined once, by ``page_html``)."""
    return page_figure(fig).to_html(full_html=False, include_plotlyjs=False,
                                    config={"displaylogo": False, "responsive": True})


_HOIST_MIN_CHARS = 512
_LITERAL = re.compile(r'"(bdata|source)":("(?:[^"\\]|\\.)*")')


def _hoist_repeats(body: str) -> tuple[str, str]:
    """(body, script): every plotly template, array (``bdata``) or image (``source``) that the
    figures of ``body`` carry more than once, written once in ``script`` and referred to where it
    was. The report repeats the same image in every attribution panel and in the rollout grid, and
    plotly puts its whole template into every figure."""
    decoder = json.JSONDecoder()
    spans = []
    for m in re.finditer(r'"template":\{', body):
        start = m.end() - 1
        try:
            _, end = decoder.raw_decode(body, start)
        except ValueError:
            continue
        spans.append((start, end))
    counts: dict[str, int] = {}
    for a, b in spans:
        counts[body[a:b]] = counts.get(body[a:b], 0) + 1
    templates = [t for t, n in counts.items() if n > 1 and len(t) >= _HOIST_MIN_CHARS]
    index = {t: i for i, t in enumerate(templates)}
    for a, b in reversed(spans):  # a fresh object per figure, in case plotly.js changes the one it is given
        if body[a:b] in index:
            body = f"{body[:a]}VL_TEMPLATE[{index[body[a:b]]}]()" + body[b:]
    literal_counts: dict[str, int] = {}
    for m in _LITERAL.finditer(body):
        if len(m.group(2)) >= _HOIST_MIN_CHARS:
            literal_counts[m.group(2)] = literal_counts.get(m.group(2), 0) + 1
    literals = [v for v, n in literal_counts.items() if n > 1]
    where = {v: i for i, v in enumerate(literals)}
    if literals:
        body = _LITERAL.sub(lambda m: f'"{m.group(1)}":VL_DATA[{where[m.group(2)]}]' if m.group(2) in where
                            else m.group(0), body)
    if not templates and not literals:
        return body, ""
    script = ("var VL_TEMPLATE=[" + ",".join(f"function(){{return {t};}}" for t in templates) + "];"
              + "var VL_DATA=[" + ",".join(literals) + "];")
    return body, script


def page_html(title: str, body: str) -> str:
    """A whole offline report page: the CSS, plotly.js inlined once, repeated figure data hoisted."""
    from plotly.offline import get_plotlyjs

    body, shared = _hoist_repeats(body)
    shared_script = f"<script type='text/javascript'>{shared}</script>" if shared else ""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script>{shared_script}</head>"
            f"<body>{body}</body></html>")


def _header(title: str, image_set: dict, environment: dict, timings: dict) -> str:
    env = ", ".join(f"{k} {html.escape(str(v))}" for k, v in environment.items())
    imgs = html.escape(str(image_set.get("description", "")))
    skipped = image_set.get("skipped") or []
    skip = (f"<p class='note'>{len(skipped)} unreadable image(s) skipped: "
            f"{html.escape(', '.join(skipped[:10]))}{' ...' if len(skipped) > 10 else ''}</p>") if skipped else ""
    times = ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    return (f"<h1>{html.escape(title)}</h1><p class='muted'>Generated "
            f"{_dt.datetime.now().isoformat(timespec='seconds')}"
            f" · {env}</p><p>Images: {imgs} ({image_set.get('count', '?')} used)</p>{skip}"
            f"<p class='muted'>Timings: {html.escape(times)}</p>")


def _facts(a: AnalysisResult) -> str:
    return html_table([a.spec.describe()])


def _notes(notes: Sequence[str]) -> str:
    return "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes if n)


def model_figures(a: AnalysisResult, display_images: Sequence[np.ndarray]) -> dict[str, go.Figure]:
    """Every figure of one model's views, by name (filters, position, distance, rollout): the
    report page shows them and ``--png`` writes them, from this one list.

    Args:
        a: the model's analysis (``analyze``).
        display_images: uint8 [H, W, 3] images as the model sees them, for the rollout overlays.

    Returns:
        Figures by name.
    """
    figs: dict[str, go.Figure] = {}
    for name in a.views:  # each view's result drawn by the figure registered for its class (figures.draws)
        result = a.view(name)
        fig = None if result is None else figures.figure_for(result, display_images)
        if fig is not None:
            figs[name] = fig
    return figs


def comparison_figures(data: ComparisonData,
                       rollouts: Sequence[tuple[str, Any, np.ndarray]] = ()) -> dict[str, go.Figure]:
    """Every figure of a comparison: distances overlaid (Fig. 11) and, given, rollout side by side.

    Args:
        data: the comparison (``vitlens.report.comparison``).
        rollouts: (model name, ``RolloutResult``, uint8 display images) per model, for the rollout panels.

    Returns:
        Figures by name.
    """
    figs = {"distance": figures.distance_figure(data.distances, names=data.models, units=data.units)}
    for i, c in enumerate(data.cka):
        figs[f"cka-{i + 1}"] = figures.cka_figure(c)
    if rollouts:
        panels = [(img, result.maps[0], name) for name, result, img in rollouts]
        figs["rollout"] = figures.overlay_grid_figure(panels, "Attention rollout (mean fusion) of each model")
    return figs


def model_section(a: AnalysisResult, figs: dict[str, go.Figure], timing: dict[str, float],
                  notes: Sequence[str] = (), reading: str = "") -> str:
    """Every view of one model that was computed: facts, filters, position tiles, distance (with its
    one-line ``reading``, ``distance_reading``), prefix tokens, head importance, rollout on a few
    images, then any further registered view under its heading."""
    parts = [f"<h2>{html.escape(a.spec.name)}</h2>", _facts(a), _notes(notes),
             "<p class='muted'>" + html.escape(", ".join(f"{k} {v:.2f} s" for k, v in timing.items())) + "</p>"]
    if "filters" in figs:
        parts += [f"<h3>{REGISTRY['filters'].heading}</h3>", figure_html(figs["filters"])]
    if "position" in a.views:
        parts.append(f"<h3>{REGISTRY['position'].heading}</h3>")
        parts.append(figure_html(figs["position"]) if "position" in figs else
                     f"<p class='note'>{html.escape(a.position_note)}</p>")
    # the relative-position bias beside the position view; why it is missing only where the position view is too
    if "relpos" in figs or ("relpos" in a.views and "position" not in figs):
        parts.append(f"<h3>{html.escape(REGISTRY['relpos'].heading)}</h3>")
        parts.append(figure_html(figs["relpos"]) + relpos_prefix_html(a.view("relpos")) if "relpos" in figs else
                     f"<p class='note'>{html.escape(getattr(a, 'notes', {}).get('relpos', ''))}</p>")
    parts += [f"<h3>{html.escape(REGISTRY[k].heading)}</h3><p class='note'>{html.escape(v)}</p>"
              for k, v in getattr(a, "notes", {}).items() if k not in ("position", "relpos") and k in REGISTRY]
    if "distance" in figs:
        parts += [f"<h3>{REGISTRY['distance'].heading}</h3>",
                  f"<p><b>{html.escape(reading)}</b></p>" if reading else "", figure_html(figs["distance"])]
    if a.prefix is not None:
        parts.append(prefix_section(a.prefix, figs.get("prefix")))
    if "heads" in figs:
        parts.append(heads_section(figs["heads"], a))
    if "rollout" in figs:
        parts += [f"<h3>{REGISTRY['rollout'].heading}</h3>",
                  "<p class='muted'>Rollout shows where information was mixed across layers, not what caused the "
                  "prediction.</p>", figure_html(figs["rollout"])]
    for name in a.others:  # a registered view of vitlens's own beyond the paper's: its heading and figure
        if name in figs and name != "relpos":
            parts += [f"<h3>{html.escape(REGISTRY[name].heading)}</h3>", figure_html(figs[name])]
    return "".join(parts)


def relpos_prefix_html(result: Any) -> str:
    """The biases between the prefix tokens and the patches of a relative-position bias (one number per head and
    pair kind), for the first block; "" without prefix tokens."""
    rows = result.prefix_rows(0)
    if not rows:
        return ""
    which = "every block" if result.shared_by_all_blocks() else f"block 1 of {result.bias.shape[0]} (the numbers " \
        "file has every block's)"
    return (f"<p class='muted'>Biases of the {html.escape(listed_some(list(result.prefix_labels), 4))} token, query "
            f"-&gt; key, the same for every patch; {html.escape(which)}:</p>"
            + html_table([{k: significant(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows]))


def prefix_section(prefix: Any, fig: go.Figure | None) -> str:
    """Attention parked on prefix tokens, and token norms (Darcet et al. 2024)."""
    if not prefix.labels:
        return ("<h3>Prefix tokens</h3><p class='muted'>This model has no prefix tokens: every token is a patch, "
                "so no attention is parked outside the image.</p>")
    parked = prefix.parked()
    listed = listed_some([f"layer {p['layer']} head {p['head']} ({100 * p['share']:.0f}% on {p['token']})"
                          for p in parked], 12) or "none"
    worst = int(np.argmax(prefix.outlier_share)) if prefix.outlier_share.size else 0
    rule = (f"norm above {prefix.outlier_threshold:g}" if prefix.outlier_rule == "absolute"
            else f"norm above {prefix.outlier_factor:g}x the image's median")
    norms = (f"Largest share of high-norm patch tokens ({rule}): "
             f"{100 * prefix.outlier_share.max():.1f}% in layer {worst + 1}." if prefix.outlier_share.size else "")
    return ("<h3>Attention on prefix tokens</h3><p class='muted'>Heads that park attention on the class, "
            "distillation or register tokens look local with raw weights (why attention distance renormalises over "
            "patch keys) and add rollout mass no patch earned.</p>" + (figure_html(fig) if fig is not None else "")
            + f"<p>Parked heads (more than half on one prefix token): {html.escape(listed)}. {html.escape(norms)}</p>")


def heads_section(fig: go.Figure, a: AnalysisResult) -> str:
    return ("<h3>Which heads matter</h3><p class='muted'>One head removed at a time; importance is the drop of the "
            "predicted class's logit, set against the head's mean attention distance.</p>" + figure_html(fig))


def attribution_section(table: Any, figs: dict[str, go.Figure]) -> str:
    """Methods x metrics, the maps of every method on the first image, and each metric's mean curves."""
    rows = table.readable_rows() if hasattr(table, "readable_rows") else table.rows  # labels, not identifiers
    fmt_rows = [{k: (significant(v) if isinstance(v, float) else v) for k, v in row.items()} for row in rows]
    scored = [METRIC_TABLE[k] for k in table.scores if k in METRIC_TABLE]
    about = "; ".join([mt.about for mt in scored] + ["pointing game and mass in mask where object masks exist",
                                                     timing_note()])
    return ("<h3>Attributions and faithfulness</h3>"
            f"<p class='muted'>Over {counted(table.n_images, 'image')}; {html.escape(about)}.</p>"
            + ("<p class='muted'>Protocols (protocol, ordering): "
               + html.escape("; ".join(f"{metric_label(k)}: {v}" for k, v in getattr(table, "protocols", {}).items()))
               + ".</p>"
               if getattr(table, "protocols", None) else "")
            + html_table(fmt_rows) + figure_html(figs["attributions"])
            + "".join(figure_html(figs[mt.name]) for mt in scored if mt.name in figs)
            + sanity_section(table) + ledger_section(table))


def ledger_section(table: Any) -> str:
    """AttnLRP's conservation ledger (``lrp_ledger``) attached to a comparison table, when there is one."""
    ledger = getattr(table, "ledger", None)
    if ledger is None:
        return ""
    rows = ledger.shown_rows()
    method = html.escape(getattr(ledger, "method", "attnlrp"))
    return (f"<h3>Where AttnLRP's relevance goes ({method})</h3>"
            f"<p class='muted'>The target logit of {len(ledger.score)} images, summed, split by where the rules "
            "leave it: the input pixels (what the map shows), the position table, the prefix tokens, the biases and "
            f"what each softmax absorbs; computed in {html.escape(ledger.dtype)}, the entries add up to the "
            "logit.</p>" + html_table(rows))


def sanity_section(table: Any) -> str:
    """The sanity-check table (Adebayo et al. 2018) attached to a comparison table, when there is one."""
    sanity = getattr(table, "sanity", None)
    if sanity is None or not sanity.results:
        return ""
    rows = [{k: (significant(v) if isinstance(v, float) else v) for k, v in row.items()}
            for row in sanity.readable_rows()]
    first = sanity.results[0]
    return ("<h3>Sanity checks: cascading randomisation</h3>"
            f"<p class='muted'>Adebayo et al. 2018: the head, then the blocks from the top (block {first.n_blocks()} "
            f"first), then the embedding re-initialised in turn (Gaussian with each tensor's mean and std, seed "
            f"{first.seed}) on a copy of the model, the maps of {counted(len(first.targets), 'image')} recomputed for "
            f"the same targets; the table's similarities are at full randomisation.</p>"
            f"<p class='muted'>{html.escape(verdict_rule(first.threshold))}</p>" + html_table(rows)
            + figure_html(figures.sanity_figure(sanity.results)))


def report_figures(data: ReportData, display_images: Sequence[Sequence[np.ndarray]]) -> list[dict[str, go.Figure]]:
    """Model i's figures (its views, and its attributions when there are any), by name.

    Args:
        data: the report's numbers.
        display_images: per model, its uint8 [H, W, 3] display images.

    Returns:
        One dict of figures by name per model.
    """
    out = []
    for i, (a, imgs) in enumerate(zip(data.analyses, display_images)):
        figs = model_figures(a, imgs)
        if i < len(data.heads) and data.heads[i] is not None:
            # a report analyses every model with its distance view (the CLI's available_views)
            figs["heads"] = figures.head_importance_figure(data.heads[i], cast(AttentionDistanceResult, a.distance))
        if i < len(data.attributions) and data.attributions[i] is not None:
            figs.update(figures.attribution_figures(data.attributions[i], imgs[0]))
        if i < len(data.components) and data.components[i] is not None:
            figs.update({f"components-{k}": f for k, f in components_figures(data.components[i]).items()})
        if i < len(data.sae) and data.sae[i] is not None:
            figs.update({f"sae-{k}": f for k, f in sae_figures(data.sae[i]).items()})
        out.append(figs)
    return out


def report_html(data: ReportData, display_images: Sequence[Sequence[np.ndarray]],
                figs: Sequence[dict[str, go.Figure]] | None = None) -> str:
    """The whole report page; ``display_images[i]`` are model i's preprocessed images for overlays.

    Args:
        data: the report's numbers.
        display_images: per model, its uint8 [H, W, 3] display images.
        figs: figures already made by ``report_figures`` (default: made here).

    Returns:
        One self-contained HTML page (plotly.js inlined once; opens without network).
    """
    figs = figs if figs is not None else report_figures(data, display_images)
    body = [_header("vitlens report", data.image_set, data.environment, data.timings.get("total", {}))]
    for i, (a, f) in enumerate(zip(data.analyses, figs)):
        reading = distance_reading(cast(AttentionDistanceResult, a.distance), a.spec.name,  # as above
                                   data.weights.get(a.spec.name))
        body.append(model_section(a, f, data.timings.get(a.spec.name, {}), [data.notes.get(a.spec.name, "")],
                                  reading))
        if i < len(data.attributions) and data.attributions[i] is not None:
            body.append(attribution_section(data.attributions[i], f))
        if i < len(data.components) and data.components[i] is not None:
            shown = {k.removeprefix("components-"): v for k, v in f.items() if k.startswith("components-")}
            body.append(components_html(data.components[i], shown, html_table, figure_html))
        if i < len(data.sae) and data.sae[i] is not None:
            shown = {k.removeprefix("sae-"): v for k, v in f.items() if k.startswith("sae-")}
            body.append(sae_html(data.sae[i], shown, html_table, figure_html))
    return page_html("vitlens report", "".join(body))


def comparison_html(data: ComparisonData, rollouts: Sequence[tuple[str, Any, np.ndarray]] = (),
                    figs: dict[str, go.Figure] | None = None, notes: Sequence[str] = ()) -> str:
    """Fig. 11 page: overlaid distances, per-layer table, local-head shares, rollout side by side.

    Args:
        data: the comparison.
        rollouts: as for ``comparison_figures``.
        figs: figures already made by ``comparison_figures`` (default: made here).
        notes: lines shown above the figures (e.g. that predictions mean nothing).

    Returns:
        One self-contained HTML page (plotly.js inlined once; opens without network).
    """
    figs = figs if figs is not None else comparison_figures(data, rollouts)
    unit_note = ("" if data.units == "px" else
                 "<p class='note'>The models see inputs of different widths, so distances are compared in units "
                 "of the image width.</p>")
    shares = [{"model": n, f"local heads in layers 1-{data.first_layers}": f"{100 * s:.0f}%"}
              for n, s in zip(data.models, data.local_share)]
    fmt = "{:.1f}" if data.units == "px" else "{:.3f}"
    body = [_header("vitlens comparison (Fig. 11)", data.image_set, data.environment, data.timings),
            unit_note, _notes(notes), f"<p><b>{html.escape(data.reading())}</b></p>", figure_html(figs["distance"]),
            f"<h2>Share of local heads</h2><p>Heads whose mean distance is {local_rule(data.local_threshold)} "
            f"on the model's grid, in the first {data.first_layers} layers.</p>", html_table(shares),
            f"<h2>Per layer ({'pixels' if data.units == 'px' else 'fraction of image width'})</h2>",
            html_table(data.table, fmt)]
    for i, c in enumerate(data.cka):
        body += [f"<h2>Representation similarity: {html.escape(c.model_a)} vs {html.escape(c.model_b)}</h2>",
                 "<p class='muted'>Linear CKA of every pair of layers (Raghu et al. 2021): 1 means the same "
                 "representation up to rotation and scale. Intervals: bootstrap over minibatches.</p>",
                 figure_html(figs[f"cka-{i + 1}"])]
    if "rollout" in figs:
        body += ["<h2>Rollout on the same image</h2>", figure_html(figs["rollout"])]
    return page_html("vitlens comparison", "".join(body))
