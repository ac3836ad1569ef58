"""The figures of a sparse autoencoder's features (docs/definitions.md, "SAE feature views"): a feature's top images
with its activation over the token grid (drawn as the rollout's overlays, Fig. 6), its statistics (histogram, where in
the image it fires, per class, its logit effect), the heads that write it against their mean attention distance
(Fig. 7 right and the feature in one figure), the features' frequencies, and an ablation's or clamp's change of the
logits and of the rollout."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..sae.features import SAEFeaturesResult
from ..sae.interventions import SAEInterventionResult
from .maps import TOKEN_COLORSCALE, colour_range, grid_columns, overlay_grid_figure, token_heatmap
from .registry import draws


def sae_top_images_figure(result: SAEFeaturesResult, feature: int,
                          images: Sequence[np.ndarray] | Mapping[int, np.ndarray], opacity: float = 0.5) -> go.Figure:
    """A feature's top-activating images, its activation over each one's token grid drawn on it (one colour scale).

    Args:
        result: ``vl.sae_features``'s result (the feature among its shown ones).
        feature: the feature.
        images: uint8 [H, W, 3] images as the model sees them, by their index in the stream (``m.display`` of the
            images streamed, or a mapping holding at least the feature's top images).
        opacity: the maps' opacity over the images.

    Returns:
        A plotly ``Figure``.
    """
    row = result.row(feature)
    kept = [(int(i), j) for j, i in enumerate(result.top_images[row]) if i >= 0]
    if not kept:
        return _empty(f"Feature {feature} is never active on these {result.n_images} images")
    panels = [(images[i], result.top_maps[row, j], f"image {i + 1}: max {result.top_values[row, j]:.3g}")
              for i, j in kept]
    fig = overlay_grid_figure(panels, f"Feature {feature} at {result.site}: its top {len(panels)} images",
                              opacity, columns=grid_columns(len(panels), 4), scale_title="activation")
    return fig


def sae_feature_figure(result: SAEFeaturesResult, feature: int) -> go.Figure:
    """A feature's numbers in one figure: its activation histogram, its mean activation per grid cell (where in the
    image it fires, to read beside the position-embedding view), its mean per class, and the outputs it raises and
    lowers most (its logit effect).

    Args:
        result: ``vl.sae_features``'s result.
        feature: the feature (any of the SAE's: these are kept for every feature).

    Returns:
        A plotly ``Figure``.
    """
    f = int(feature)
    has_class, has_logit = result.class_mean.shape[1] > 0, result.logit_effect.shape[1] > 0
    titles = ["Activation histogram", "Mean activation per grid cell",
              "Mean activation per class" if has_class else "(no labels)",
              "Logit effect per unit" if has_logit else "(no logit effect)"]
    fig = make_subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.08)
    edges = result.hist_edges
    centres = np.sqrt(edges[:-1] * edges[1:])
    fig.add_trace(go.Bar(x=centres, y=result.hist_counts[f], width=np.diff(edges), name="tokens",
                         marker_color="#4c78a8", showlegend=False,
                         hovertemplate="activation ~%{x:.3g}<br>%{y} tokens<extra></extra>"), row=1, col=1)
    fig.update_xaxes(type="log", title_text="activation", row=1, col=1)
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    grid = result.grid_mean[f]
    low, high = colour_range([grid])
    fig.add_trace(go.Heatmap(z=grid, colorscale=TOKEN_COLORSCALE, zmin=low, zmax=high, showscale=False,
                             hovertemplate="cell (%{y}, %{x})<br>mean %{z:.3g}<extra></extra>"), row=1, col=2)
    fig.update_yaxes(autorange="reversed", scaleanchor="x2", row=1, col=2)
    if has_class:
        fig.add_trace(go.Bar(x=result.class_names, y=result.class_mean[f], marker_color="#59a14f", showlegend=False,
                             hovertemplate="%{x}: %{y:.3g}<extra></extra>"), row=1, col=3)
    if has_logit:
        effect = result.logit_effect[f]
        order = np.argsort(-np.abs(effect))[:10]
        names = [result.logit_names[i] if i < len(result.logit_names) else f"class {i}" for i in order]
        fig.add_trace(go.Bar(x=effect[order], y=names, orientation="h", showlegend=False,
                             marker_color=["#e15759" if v < 0 else "#4e79a7" for v in effect[order]],
                             hovertemplate="%{y}: %{x:+.3g}<extra></extra>"), row=1, col=4)
        fig.update_yaxes(autorange="reversed", row=1, col=4)
    fig.update_layout(title=f"Feature {f} at {result.site}: active on {result.frequency[f]:.2%} of tokens, mean "
                            f"{result.mean_activation[f]:.3g} when active", height=360,
                      margin=dict(l=10, r=10, t=80, b=10))
    return fig


def sae_writers_figure(result: SAEFeaturesResult, feature: int) -> go.Figure:
    """The heads that write a feature against how far they look: each head's output projected on the feature's
    encoder direction (averaged over the tokens where the feature is active) against its mean attention distance
    (Fig. 7 right), coloured by block, so a reader sees whether local or global heads write it.

    Args:
        result: ``vl.sae_features``'s result (the feature among its shown ones).
        feature: the feature.

    Returns:
        A plotly ``Figure``.
    """
    row = result.row(feature)
    if not len(result.writer_heads):
        return _empty("No writer heads read: " + ("; ".join(result.notes) or "none before the site"))
    active = not np.all(np.isnan(result.writers[row]))
    values = result.writers[row] if active else result.writers_all[row]
    layers, heads = result.writer_heads[:, 0], result.writer_heads[:, 1]
    distance = result.head_distance_px[layers, heads]
    fig = go.Figure()
    for layer in np.unique(layers):
        pick = layers == layer
        fig.add_trace(go.Scatter(
            x=distance[pick], y=values[pick], mode="markers", name=f"layer {layer + 1}",
            marker=dict(size=9), customdata=np.stack([layers[pick] + 1, heads[pick] + 1], -1),
            hovertemplate="layer %{customdata[0]}, head %{customdata[1]}<br>distance %{x:.1f} px<br>"
                          "write along the feature %{y:+.3g}<extra></extra>"))
    fig.add_hline(y=0, line=dict(color="#999", width=1))
    where = "where it is active" if active else "over every token (it is never active)"
    fig.update_layout(title=f"Who writes feature {feature}: each head's output along its encoder direction, "
                            f"{where}<br><sup>against the head's mean attention distance (Fig. 7 right)</sup>",
                      xaxis_title="mean attention distance (px)", yaxis_title="write along the feature",
                      height=420, margin=dict(l=10, r=10, t=80, b=10))
    return fig


@draws(SAEFeaturesResult)
def sae_frequency_figure(result: SAEFeaturesResult) -> go.Figure:
    """How often the features fire: the histogram of log10 activation frequency over the SAE's features (dead
    features counted apart), the SAE's health at a glance.

    Args:
        result: ``vl.sae_features``'s result.

    Returns:
        A plotly ``Figure``.
    """
    freq = result.frequency
    alive = freq[freq > 0]
    fig = go.Figure(go.Histogram(x=np.log10(alive), nbinsx=40, marker_color="#4c78a8",
                                 hovertemplate="log10 frequency %{x}<br>%{y} features<extra></extra>"))
    dead = int((freq == 0).sum())
    fig.update_layout(title=f"{result.model_name} {result.site}: activation frequency of {len(freq)} features "
                            f"({dead} never active on {result.n_images} images)",
                      xaxis_title="log10 share of tokens where the feature is active", yaxis_title="features",
                      height=360, margin=dict(l=10, r=10, t=60, b=10))
    return fig


@draws(SAEInterventionResult, images=True)
def sae_intervention_figure(result: SAEInterventionResult, images: Sequence[np.ndarray], most: int = 4
                            ) -> go.Figure:
    """A feature ablated or clamped: per image, the rollout before and after (one colour scale) and the change of
    the logits of its top classes.

    Args:
        result: ``vl.sae_intervene``'s result.
        images: uint8 [H, W, 3] images as the model sees them.
        most: images drawn (the first ones).

    Returns:
        A plotly ``Figure``.
    """
    n = min(most, len(images), len(result.activation))
    before, after = result.predicted()
    what = "ablated" if result.mode == "ablate" else f"clamped to {result.value:g}"
    fig = make_subplots(rows=n, cols=3, horizontal_spacing=0.04, vertical_spacing=0.06, subplot_titles=[
        t for b in range(n) for t in (f"image {b + 1}: rollout before ({result.name(before[b])})",
                                      f"after ({result.name(after[b])})", "logit change")])
    low, high = colour_range([result.rollout_before[:n], result.rollout_after[:n]])
    for b in range(n):
        for c, maps in ((1, result.rollout_before), (2, result.rollout_after)):
            fig.add_trace(go.Image(z=images[b], hoverinfo="skip"), row=b + 1, col=c)
            fig.add_trace(token_heatmap(maps[b], images[b].shape[:2], opacity=0.5, coloraxis="coloraxis"),
                          row=b + 1, col=c)
        change = result.logits_after[b] - result.logits_before[b]
        order = np.argsort(-result.logits_before[b])[:6]
        fig.add_trace(go.Bar(x=change[order], y=[result.name(c) for c in order], orientation="h", showlegend=False,
                             marker_color=["#e15759" if v < 0 else "#4e79a7" for v in change[order]],
                             hovertemplate="%{y}: %{x:+.3g}<extra></extra>"), row=b + 1, col=3)
        fig.update_yaxes(autorange="reversed", row=b + 1, col=3)
    for b in range(n):
        for c in (1, 2):
            fig.update_xaxes(visible=False, row=b + 1, col=c)
            fig.update_yaxes(visible=False, autorange="reversed", row=b + 1, col=c)
    fig.update_layout(title=f"Feature {result.feature} {what} at {result.site}: rollout and logits",
                      coloraxis=dict(colorscale=TOKEN_COLORSCALE, cmin=low, cmax=high,
                                     colorbar=dict(title=dict(text="rollout (÷ max)", side="right"))),
                      height=80 + 260 * n, margin=dict(l=10, r=10, t=80, b=10))
    fig.update_annotations(font_size=11)
    return fig


def _empty(text: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig.update_layout(height=200)


__all__ = ["sae_feature_figure", "sae_frequency_figure", "sae_intervention_figure", "sae_top_images_figure",
           "sae_writers_figure"]
