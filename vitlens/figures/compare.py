"""Figures across models and heads: layer-by-layer CKA of two models, and each head's importance against its mean
attention distance."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..compare.cka import CKAResult
from ..compare.heads import HeadImportanceResult
from ..views.distance import AttentionDistanceResult
from ..words import counted
from .registry import draws


@draws(CKAResult)
def cka_figure(result: "CKAResult", title: str | None = None) -> go.Figure:
    """Layer-by-layer CKA of two models: model A's layers down (first at the top), model B's across.

    Args:
        result: the CKA (``cka``).
        title: the figure's title (default: the two models).

    Returns:
        A plotly ``Figure``.
    """
    la, lb = result.matrix.shape
    fig = go.Figure(go.Heatmap(
        # sequential over CKA's [0, 1]; not Magma or Inferno, whose first colour #000004 is one of the
        # placeholders Streamlit's chart theme swaps for its palette (a pink band at 0 in the app)
        z=result.matrix, x=list(range(1, lb + 1)), y=list(range(1, la + 1)), zmin=0, zmax=1, colorscale="Plasma",
        customdata=np.stack([result.ci_low, result.ci_high], -1), colorbar=dict(title="CKA"),
        hovertemplate=f"{result.model_a} layer %{{y}} vs {result.model_b} layer %{{x}}<br>CKA %{{z:.3f}} "
                      "(90% CI %{customdata[0]:.3f}-%{customdata[1]:.3f})<extra></extra>"))
    fig.update_xaxes(title=f"{result.model_b} layer", range=[0.5, lb + 0.5], dtick=1 if lb <= 24 else None,
                     constrain="domain")
    fig.update_yaxes(title=f"{result.model_a} layer", range=[la + 0.5, 0.5], dtick=1 if la <= 24 else None,
                     scaleanchor="x", constrain="domain")
    fig.update_layout(title=title or f"Representation similarity (linear CKA)<br><sup>{result.estimator} HSIC, "
                                     f"{result.token_policy} tokens, {counted(result.n_images, 'image')}</sup>",
                      height=480, margin=dict(l=10, r=10, t=70, b=10))
    return fig


def head_importance_figure(importance: "HeadImportanceResult", distance: AttentionDistanceResult,
                           title: str | None = None) -> go.Figure:
    """Do local heads matter? Each head's importance (logit drop when removed) against its mean
    attention distance (paper Fig. 7 right), coloured by layer.

    Args:
        importance: head importance (``head_importance``).
        distance: the same model's attention distance (``attention_distance``).
        title: the figure's title.

    Returns:
        A plotly ``Figure``.
    """
    layers, heads = importance.logit_drop.shape
    ll, hh = np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij")
    fig = go.Figure(go.Scatter(
        x=distance.mean_px.ravel(), y=importance.logit_drop.ravel(), mode="markers",
        marker=dict(size=9, color=ll.ravel() + 1, colorscale="Viridis", colorbar=dict(title="layer"), opacity=0.85),
        customdata=np.stack([ll.ravel() + 1, hh.ravel() + 1], -1),
        hovertemplate="layer %{customdata[0]}, head %{customdata[1]}<br>distance %{x:.1f} px<br>"
                      "logit drop %{y:.3f}<extra></extra>"))
    fig.add_vline(x=distance.uniform_px, line=dict(dash="dot", width=1, color="#888"),
                  annotation_text="uniform attention", annotation_position="top right")
    fig.update_layout(title=title or f"Do local heads matter?<br><sup>{importance.ablation}-ablation of one head at "
                                     f"a time, {counted(importance.n_images, 'image')}</sup>",
                      xaxis_title="Mean attention distance (pixels)",
                      yaxis_title="Drop of the predicted class's logit", height=440,
                      margin=dict(l=10, r=10, t=70, b=10))
    return fig
