"""Figures of the component analyses (issue 51; docs/definitions.md, "Direct contributions", "Logit lens",
"Token norms", "Activation patching", "TextSpan"): the layer x head table of contributions with its ledger in the
title, one head's contribution over the image's patch tokens, the logit lens by depth, token norms by depth, patching by
head, TextSpan's explained variance by head and its evaluation (with the replaced heads' accuracy), mean-ablation's
scores before and after."""
from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from ..components import (DecompositionResult, LogitLensResult, MeanAblationResult, PatchingResult, TextSpanResult,
                          TextSpanEvaluation, TokenNormsResult)
from ..errors import InvalidParameterError
from .registry import draws


def _symmetric(values: np.ndarray) -> float:
    top = float(np.abs(values).max()) if values.size else 0.0
    return top if top > 0 else 1.0


@draws(DecompositionResult)
def contributions_figure(result: DecompositionResult, image: int = 0, title: str | None = None) -> go.Figure:
    """The layer x head table of one image's head contributions (summed over source tokens), on a diverging scale
    centred at 0, layer 1 at the top; the ledger is in the title.

    Args:
        result: a ``decompose`` result.
        image: which image.
        title: the title (default: the model, the output and the ledger).

    Returns:
        The heatmap figure.
    """
    table = result.head_table(image)
    top = _symmetric(table)
    fig = go.Figure(go.Heatmap(
        z=table, x=[f"head {h + 1}" for h in range(table.shape[1])],
        y=[f"layer {l + 1}" for l in range(table.shape[0])],
        colorscale="RdBu_r", zmin=-top, zmax=top, colorbar=dict(title="part")))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title or (f"{result.model_name}: heads' parts of output {result.output[image]:.4g} "
                                      f"(ledger {result.ledger()[image]:.1e})"), height=360)
    return fig


def head_contribution_figure(result: DecompositionResult, layer: int, head: int, image: int = 0,
                             title: str | None = None) -> go.Figure:
    """One head's part per source patch token on the patch grid (0-based layer and head), diverging at 0, patch row
    0 at the top.

    Args:
        result: a ``decompose`` result.
        layer: the block, 0-based.
        head: the head, 0-based.
        image: which image.
        title: the title (default: the head and its sum).

    Returns:
        The heatmap figure.
    """
    grid = result.head_map(layer, head, image)
    top = _symmetric(grid)
    fig = go.Figure(go.Heatmap(z=grid, colorscale="RdBu_r", zmin=-top, zmax=top, colorbar=dict(title="part")))
    fig.update_yaxes(autorange="reversed", scaleanchor="x")
    fig.update_xaxes(constrain="domain")  # square tokens that fill the figure's height, no empty axis beside them
    fig.update_layout(title=title or f"layer {layer + 1} head {head + 1}: part per source token "
                                     f"(sum {grid.sum():.3g})", height=360)
    return fig


@draws(LogitLensResult)
def logit_lens_figure(result: LogitLensResult, title: str | None = None) -> go.Figure:
    """The target's pooled logit by depth, one line per image (depth 0: the embeddings; the last: the output).

    Args:
        result: a ``logit_lens`` result.
        title: the title (default: the model).

    Returns:
        The line figure.
    """
    fig = go.Figure([go.Scatter(x=np.arange(result.pooled.shape[1]), y=result.pooled[b], mode="lines+markers",
                                name=f"image {b} ({_name(result, b)})") for b in range(result.pooled.shape[0])])
    fig.update_layout(title=title or f"{result.model_name}: logit lens", xaxis_title="depth",
                      yaxis_title="target logit", height=360)
    return fig


def _name(result: Any, *index: int) -> str:
    """The result's target class in words (its ``target_name``; "class k" for a file of an older vitlens, read by
    its fields, whatever its result type)."""
    named = getattr(result, "target_name", None)
    if callable(named):
        return named(*index)
    target = result.target
    return f"class {int(target[index[0]] if index else target)}"


@draws(TokenNormsResult)
def token_norms_figure(result: TokenNormsResult, image: int = 0, title: str | None = None) -> go.Figure:
    """Token norms by depth for one image (a heatmap: depth x token), outliers by the stated rule counted in the
    title.

    Args:
        result: a ``token_norms`` result.
        image: which image.
        title: the title (default: the model and the outliers counted).

    Returns:
        The heatmap figure.
    """
    fig = go.Figure(go.Heatmap(z=result.norms[image], colorscale="Viridis", colorbar=dict(title="norm")))
    fig.update_layout(title=title or (f"{result.model_name}: token norms ({int(result.outliers[image, -1].sum())} "
                                      f"outliers, {result.rule_words()}, at the last depth)"),
                      xaxis_title="token", yaxis_title="depth", height=360)
    return fig


@draws(PatchingResult)
def patching_figure(result: PatchingResult, title: str | None = None, site: str = "heads") -> go.Figure:
    """The share of the clean logit each patch restores: each head's (layer x head) or each token's of a block's
    output (layer x token, ``site="resid"``), diverging at 0, layer 1 at the top.

    Args:
        result: a ``patch_activations`` result.
        title: the title (default: the model, the class and the site).
        site: "heads" or "resid".

    Returns:
        The heatmap figure.
    """
    if site not in ("heads", "resid"):
        raise InvalidParameterError(f"site must be 'heads' or 'resid', not {site!r}.")
    share = result.restored(result.heads if site == "heads" else result.resid)
    x = [f"head {h + 1}" for h in range(share.shape[1])] if site == "heads" else list(range(share.shape[1]))
    fig = go.Figure(go.Heatmap(
        z=share, x=x, y=[f"layer {l + 1}" for l in range(share.shape[0])],
        colorscale="RdBu_r", zmin=-1, zmax=1, colorbar=dict(title="restored")))
    fig.update_yaxes(autorange="reversed")
    if site == "resid":
        fig.update_xaxes(title="token (0: the first prefix token)")
    fig.update_layout(title=title or f"{result.model_name}: patching {'heads' if site == 'heads' else 'tokens'} "
                                     f"({_name(result)})", height=360)
    return fig


@draws(TextSpanResult)
def text_span_figure(result: TextSpanResult, title: str | None = None) -> go.Figure:
    """The share of each head's variance its picked texts explain together (layer x head, layer first read at the
    top); hovering a cell lists the texts in the order picked.

    Args:
        result: a ``text_span`` result.
        title: the title (default: the model and the texts counted).

    Returns:
        The heatmap figure.
    """
    total = result.explained.sum(-1)
    words = [[" / ".join(t for t, _ in result.described(int(l), h)) for h in range(total.shape[1])]
             for l in result.layers]
    fig = go.Figure(go.Heatmap(
        z=total, x=[f"head {h + 1}" for h in range(total.shape[1])], y=[f"layer {int(l) + 1}" for l in result.layers],
        text=words, hovertemplate="%{y} %{x}: %{z:.0%}<br>%{text}<extra></extra>", colorscale="Viridis", zmin=0,
        zmax=1, colorbar=dict(title="explained")))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title or (f"{result.model_name}: TextSpan, {result.explained.shape[-1]} of "
                                      f"{len(result.texts)} texts per head"), height=360)
    return fig


@draws(TextSpanEvaluation)
def text_span_evaluation_figure(result: TextSpanEvaluation, title: str | None = None) -> go.Figure:
    """TextSpan's evaluation (the paper's Sec. 4.2): each replaced head's variance explained by its texts (layer x
    head, the first layer read at the top; hovering lists the texts), the zero-shot accuracies in the title.

    Args:
        result: an ``evaluate_text_span`` result.
        title: the title (default: the model, the rule and the three accuracies).

    Returns:
        The heatmap figure.
    """
    words = [[" / ".join(str(result.texts[k]) for k in result.chosen[i, h] if k >= 0)
              for h in range(result.chosen.shape[1])] for i in range(len(result.layers))]
    fig = go.Figure(go.Heatmap(
        z=result.explained, x=[f"head {h + 1}" for h in range(result.explained.shape[1])],
        y=[f"layer {int(l) + 1}" for l in result.layers], text=words,
        hovertemplate="%{y} %{x}: %{z:.0%}<br>%{text}<extra></extra>", colorscale="Viridis", zmin=0, zmax=1,
        colorbar=dict(title="explained")))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title or (f"{result.model_name}: TextSpan ({result.variant}), accuracy "
                                      f"{result.accuracy_model:.0%} as is, {result.accuracy_ablated:.0%} others "
                                      f"mean-ablated, {result.accuracy_replaced:.0%} heads replaced"), height=360)
    return fig


@draws(MeanAblationResult)
def mean_ablation_figure(result: MeanAblationResult, title: str | None = None) -> go.Figure:
    """Each image's target score unablated against mean-ablated (the diagonal: no change).

    Args:
        result: a ``mean_ablate`` result.
        title: the title (default: the components ablated).

    Returns:
        The scatter figure.
    """
    low = float(min(result.before.min(), result.after.min()))
    high = float(max(result.before.max(), result.after.max()))
    fig = go.Figure([go.Scatter(x=result.before, y=result.after, mode="markers", name="images",
                                text=[f"image {b}, target {t}" for b, t in enumerate(result.target)]),
                     go.Scatter(x=[low, high], y=[low, high], mode="lines", name="no change",
                                line=dict(dash="dot", color="grey"))])
    fig.update_layout(title=title or f"{result.model_name}: mean-ablating {', '.join(result.components)}",
                      xaxis_title=f"target {result.score}, unablated", yaxis_title="mean-ablated", height=360)
    return fig
