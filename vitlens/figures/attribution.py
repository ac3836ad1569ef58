"""Attribution figures: several methods' maps over one image, every scored metric's curves (``metric_figure``, from
the metric's ``Metric.curves``), deletion / insertion, Chefer et al.'s and ROAD's perturbation curves, and the
cascading randomisation (Adebayo et al. 2018, Fig. 2)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..attribution.deletion import FaithfulnessResult
from ..attribution.faithfulness import ComparisonTable
from ..attribution.methods import AttributionResult
from ..attribution.metrics import METRIC_TABLE
from ..attribution.perturbation import PerturbationResult, RoadResult
from ..attribution.sanity import SanityResult
from ..results import significant
from .colours import method_colour, method_label
from .maps import overlay_grid_figure
from .registry import draws

if TYPE_CHECKING:
    from ..attribution.metrics import Metric

__all__ = ["attribution_figure", "attribution_figures", "attributions_figure", "faithfulness_figure", "metric_figure",
           "perturbation_figure", "road_figure", "sanity_figure", "table_figure"]


def attribution_figure(results: Sequence["AttributionResult"], image: np.ndarray, index: int = 0,
                       opacity: float = 0.5) -> go.Figure:
    """Maps of several attribution methods side by side over one image (negative evidence
    clipped, each map scaled to its maximum).

    Args:
        results: one ``AttributionResult`` per method, over the same images.
        image: uint8 [H, W, 3], image ``index`` as the model sees it.
        index: which image of the results.
        opacity: the maps' opacity, in [0, 1].

    Returns:
        A plotly ``Figure``.
    """
    panels = []
    for r in results:
        mp = np.clip(np.asarray(r.maps[index], dtype=np.float64), 0, None)
        panels.append((image, mp / max(float(mp.max()), 1e-12), method_label(r.method)))
    target = results[0].target_name(index) if results else "no class"
    if results and getattr(results[0], "target_kind", "class") == "text":
        target = f"the prompt \"{target}\""
    return overlay_grid_figure(panels, f"Attributions for {target} (positive evidence, scaled to max)",
                               opacity, columns=min(6, len(panels)), scale_title="evidence (÷ map's max)")


@draws(AttributionResult, images=True, many=True)
def attributions_figure(results: Sequence["AttributionResult"], images: Sequence[np.ndarray]) -> go.Figure:
    """``attribution_figure`` of the methods' maps over the first image (what ``figure_for`` draws for them).

    Args:
        results: one ``AttributionResult`` per method, over the same images.
        images: uint8 [H, W, 3] images as the model sees them.

    Returns:
        A plotly ``Figure``.
    """
    return attribution_figure(results, images[0], 0)


@draws(ComparisonTable, images=True)
def table_figure(table: "ComparisonTable", images: Sequence[np.ndarray]) -> go.Figure:
    """A comparison's maps of every method over the first image (``attribution_figure``; its metrics' curves are
    ``attribution_figures``').

    Args:
        table: a ``ComparisonTable`` (``compare_methods``).
        images: uint8 [H, W, 3] images as the model sees them.

    Returns:
        A plotly ``Figure``.
    """
    return attribution_figure(table.attributions, images[0], 0)


def attribution_figures(table: Any, image: np.ndarray) -> dict[str, go.Figure]:
    """The attribution maps of every method on one image, and each scored metric's mean curves: what the report
    page and the app's Attributions view draw of a comparison.

    Args:
        table: a ``ComparisonTable`` (``compare_methods``).
        image: uint8 [H, W, 3], its first image as the model sees it.

    Returns:
        Figures by name: "attributions", then one per metric the table scored, by the metric's name in
            ``METRIC_TABLE`` ("deletion_insertion", "perturbation", ...; ``metric_figure``).
    """
    figs = {"attributions": attribution_figure(table.attributions, image, 0)}
    for name, results in table.scores.items():  # every metric the table holds and this vitlens knows
        if results and name in METRIC_TABLE:
            figs[name] = metric_figure(METRIC_TABLE[name], results)
    return figs


@draws(FaithfulnessResult, many=True)
def faithfulness_figure(results: Sequence["FaithfulnessResult"]) -> go.Figure:
    """Mean deletion and insertion curves of each method, with their mean areas under the curve.

    Args:
        results: one ``FaithfulnessResult`` per method (``deletion_insertion``).

    Returns:
        A plotly ``Figure``.
    """
    # one y range for both panels: the same probability, read across
    fig = make_subplots(rows=1, cols=2, subplot_titles=["Deletion (lower is more faithful)",
                                                        "Insertion (higher is more faithful)"], shared_yaxes=True)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        # one legend entry per method, under both panels, with both areas (deletion / insertion)
        name = (f"{method_label(r.method)} (AUC deletion {significant(r.deletion_auc.mean())}, "
                f"insertion {significant(r.insertion_auc.mean())})")
        for col, curve, auc, what in ((1, r.deletion, r.deletion_auc, "deletion"),
                                      (2, r.insertion, r.insertion_auc, "insertion")):
            fig.add_trace(go.Scatter(x=r.fractions, y=curve.mean(0), mode="lines", line=dict(color=color),
                                     name=name, legendgroup=r.method, showlegend=col == 1,
                                     hovertemplate=f"{r.method} ({what} AUC {significant(auc.mean())})<br>"
                                                   "%{x:.0%}: %{y:.3f}<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title="share of patches removed / inserted", range=[0, 1])
    text = bool(results) and all(getattr(r, "score", "probability") != "probability" for r in results)
    fig.update_yaxes(rangemode="normal" if text else "tozero")
    fig.update_yaxes(title="cosine similarity to the prompt" if text else "target-class probability", col=1)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(height=420 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=60, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def metric_figure(metric: "Metric", results: Sequence[object]) -> go.Figure:
    """Any perturbation metric's mean curves of each method, one panel per ``Curve`` of its entry, with the method's
    columns (``Metric.columns``) in its legend entry: what the report and the app draw for every metric they score.

    Args:
        metric: the metric's entry (``METRIC_TABLE[name]``).
        results: the metric's result for each method (``ComparisonTable.scores[name]``).

    Returns:
        A plotly ``Figure``.
    """
    panels = [metric.curves(r) for r in results]
    titles = [c.title for c in panels[0]] if panels else [metric.title or metric.name]
    # one y range for every panel: the panels of a metric show one score (deletion beside insertion), read across
    fig = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, shared_yaxes=True)
    for i, (r, curves) in enumerate(zip(results, panels)):
        method = getattr(r, "method", f"method {i + 1}")
        color = method_colour(method, i)
        # one legend entry per method, under every panel, with the method's numbers in the table
        numbers = ", ".join(f"{metric.column_labels.get(k) or k.replace('_', ' ')} {significant(v)}"
                            for k, v in metric.columns(r).items())
        for col, c in enumerate(curves, start=1):
            fig.add_trace(go.Scatter(x=np.asarray(c.x), y=np.asarray(c.y).mean(0), mode="lines+markers",
                                     line=dict(color=color), name=f"{method_label(method)} ({numbers})",
                                     legendgroup=method, showlegend=col == 1,
                                     hovertemplate=f"{method}<br>%{{x:.0%}}: %{{y:.3f}}<extra></extra>"),
                          row=1, col=col)
    scores = {getattr(r, "score", "score") for r in results}
    score = scores.pop() if len(scores) == 1 else "score"
    fig.update_xaxes(title="share of the input changed", range=[0, 1])
    fig.update_yaxes(rangemode="tozero" if score == "probability" else "normal")  # as faithfulness_figure
    # the panels share the y axis: its title once, on the first
    fig.update_yaxes(title="target-class probability" if score == "probability" else score, col=1)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(title=metric.title or metric.name.replace("_", " "),
                      height=440 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=80, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig


@draws(SanityResult, many=True)
def sanity_figure(results: "SanityResult | Sequence[SanityResult]", title: str | None = None) -> go.Figure:
    """Cascading randomisation (Adebayo et al. 2018, Fig. 2): each similarity to the original maps against the
    step of the cascade (original first, then the head, the blocks from the top, the embedding; blocks counted
    from 1), one curve per method; mean over images, NaNs skipped. The verdict's cutoff is drawn, labelled, on the
    panel it is read from (Spearman of |maps|; ``sanity.verdict_rule``), and each legend entry ends with its
    method's verdict.

    Args:
        results: one ``SanityResult`` or several (one per method).
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    results = [results] if not isinstance(results, Sequence) else list(results)
    panels = (("spearman_abs", "Spearman, |maps| (the verdict's)"), ("spearman", "Spearman, signed maps"),
              ("ssim", "SSIM, |maps|"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels], shared_yaxes=True)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        x = ["original", *r.step_labels()]
        rows = r.to_rows()
        for col, (key, _) in enumerate(panels, start=1):
            y = [1.0, *[row[key] for row in rows]]
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", line=dict(color=color), legendgroup=r.method,
                                     name=f"{method_label(r.method)}: {r.verdict_word()}", showlegend=col == 1,
                                     hovertemplate=f"{method_label(r.method)}<br>%{{x}}: %{{y:.3f}}<extra></extra>"),
                          row=1, col=col)
    if results:
        cut = results[0].threshold
        fig.add_hline(y=cut, line=dict(dash="dot", width=1.5, color="#555"), row=1, col=1,
                      annotation_text=f"verdict cutoff {significant(cut)}", annotation_position="bottom left",
                      annotation_font_size=10)
    fig.update_xaxes(title="randomised down to", tickangle=-45)
    fig.update_yaxes(range=[-1.05, 1.05])
    cut_text = significant(results[0].threshold) if results else "0.5"
    fig.update_layout(title=title or "Cascading randomisation (Adebayo et al. 2018)<br><sup>similarity of each step's "
                                     f"maps to the original model's; a map decorrelates where its Spearman of |maps| "
                                     f"falls below the dotted cutoff ({cut_text})</sup>",
                      height=460, margin=dict(l=10, r=10, t=80, b=10), legend=dict(orientation="h", y=-0.45))
    return fig


@draws(PerturbationResult, many=True)
def perturbation_figure(results: Sequence["PerturbationResult"], roads: Sequence["RoadResult"] = ()) -> go.Figure:
    """Chefer et al.'s positive and negative perturbation curves (and, given, ROAD's MoRF and LeRF curves) of each
    method: mean over images, with the mean AUC (positive: lower is better; negative: higher).

    Args:
        results: one ``PerturbationResult`` per method (``perturbation_test``).
        roads: ``RoadResult`` curves to add (``road``), or none.

    Returns:
        A plotly ``Figure``.
    """
    cols = 2 + 2 * bool(roads)
    titles = ["Positive perturbation (lower is better)", "Negative perturbation (higher is better)"]
    if roads:
        titles += ["ROAD MoRF (lower is better)", "ROAD LeRF (higher is better)"]
    fig = make_subplots(rows=1, cols=cols, subplot_titles=titles)
    for i, r in enumerate(results):
        color = method_colour(r.method, i)
        for col, curve, auc in ((1, r.positive, r.positive_auc), (2, r.negative, r.negative_auc)):
            fig.add_trace(go.Scatter(x=r.fractions, y=curve.mean(0), mode="lines+markers", line=dict(color=color),
                                     name=method_label(r.method), legendgroup=r.method, showlegend=col == 1,
                                     hovertemplate=f"{r.method} (AUC {significant(auc.mean())})<br>%{{x:.0%}} removed: "
                                                   "%{y:.3f}<extra></extra>"), row=1, col=col)
    for i, road in enumerate(roads):
        color = method_colour(road.method, i)
        for col, curve in ((3, road.morf), (4, road.lerf)):
            fig.add_trace(go.Scatter(x=road.percentages, y=curve.mean(0), mode="lines+markers", line=dict(color=color),
                                     name=method_label(road.method), legendgroup=road.method,
                                     showlegend=not results and col == 3),
                          row=1, col=col)
    fig.update_xaxes(title="share removed", range=[0, 1])
    score = results[0].score if results else (roads[0].score if roads else "score")
    fig.update_yaxes(title=score)
    # right margin: the last x tick ("1") is centred on the axis end and was cut off at 10 px
    fig.update_layout(height=420 + 18 * max(0, len(results) - 3), margin=dict(l=10, r=30, t=60, b=10),
                      legend=dict(orientation="h", y=-0.25))
    return fig


@draws(RoadResult, many=True)
def road_figure(roads: Sequence["RoadResult"]) -> go.Figure:
    """ROAD's MoRF and LeRF curves of each method, with their AUCs (``metric_figure`` of the "road" metric).

    Args:
        roads: one ``RoadResult`` per method (``road``).

    Returns:
        A plotly ``Figure``.
    """
    return metric_figure(METRIC_TABLE["road"], roads)
