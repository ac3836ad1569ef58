"""Figures of the residual stream's read-outs: the linear probes' held-out accuracy by block (Raghu et al. 2021, Fig.
11: the class token against the mean patch token) and an SAE's training curves (FVU, L0 and dead features by step)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..sae.probes import LinearProbeResult
from ..sae.result import SAETrainingResult
from ..words import counted
from .registry import draws


@draws(LinearProbeResult)
def probes_figure(result: LinearProbeResult) -> go.Figure:
    """Held-out accuracy of the linear probes by block (1-based), the class token's and the mean patch token's, with
    chance as a dotted line.

    Args:
        result: the probes (``vl.linear_probes``).

    Returns:
        A plotly ``Figure``.
    """
    x = [int(b) + 1 for b in result.blocks]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=result.mean_patch_accuracy, name="mean patch token", mode="lines+markers",
                             hovertemplate="block %{x}: %{y:.1%}<extra>mean patch token</extra>"))
    if np.isfinite(result.class_token_accuracy).any():
        fig.add_trace(go.Scatter(x=x, y=result.class_token_accuracy, name="class token", mode="lines+markers",
                                 hovertemplate="block %{x}: %{y:.1%}<extra>class token</extra>"))
    fig.add_hline(y=result.chance, line_dash="dot", line_color="grey", annotation_text="chance")
    fig.update_xaxes(title="block (its output)", dtick=1 if len(x) <= 24 else None)
    fig.update_yaxes(title="held-out accuracy", range=[0, 1.02], tickformat=".0%")
    fig.update_layout(title=f"Linear probes by block<br><sup>{result.model_name}: logistic regression, "
                            f"{counted(result.n_train, 'image')} to fit, {result.n_test} held out, "
                            f"{counted(result.n_classes, 'class', 'classes')}</sup>",
                      height=420, margin=dict(l=10, r=10, t=70, b=10))
    return fig


@draws(SAETrainingResult)
def sae_training_figure(result: SAETrainingResult) -> go.Figure:
    """An SAE's training by tokens seen: the batch's fraction of variance unexplained, its L0 and the share of dead
    features.

    Args:
        result: the training (``vl.train_sae``).

    Returns:
        A plotly ``Figure``.
    """
    fig = make_subplots(rows=1, cols=3, subplot_titles=("fraction of variance unexplained", "L0 (active features a "
                                                        "token)", "dead features"))
    for col, (values, fmt) in enumerate(((result.fvu, ".3f"), (result.l0, ".1f"), (result.dead_fraction, ".1%")), 1):
        fig.add_trace(go.Scatter(x=result.tokens, y=values, mode="lines", showlegend=False,
                                 hovertemplate=f"%{{x}} tokens: %{{y:{fmt}}}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title="tokens seen", row=1, col=col)
    # a share: drawn from 0 to 100% (plotly centres a flat line at 0 on -1..1, a negative share of features)
    fig.update_yaxes(range=[0, 1], tickformat=".0%", row=1, col=3)
    c = result.config
    fig.update_layout(title=f"SAE training<br><sup>{c['kind']} SAE of {c['n_features']} features at {c['site']} of "
                            f"{result.model_name}</sup>", height=360, margin=dict(l=10, r=10, t=80, b=10))
    return fig
