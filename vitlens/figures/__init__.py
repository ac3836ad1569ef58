"""Plotly figures: pure functions of the result objects, one module per family of figures, each figure function
registered for the result class it draws (``registry.draws``; ``figure_for`` draws any result by its class).

- ``weights``: ``filters_figure`` (paper Fig. 7 left, a grid of RGB filter components), ``position_figure``
  (Fig. 7 centre / Fig. 10, a grid of similarity tiles), ``relpos_figure`` (its analogue for relative-position
  models, each head's learned bias by query-to-key offset);
- ``distance``: ``distance_figure`` (Fig. 7 right / Fig. 11, mean distance of each head by layer), its windowed and
  by-depth forms, and ``prefix_figure``;
- ``maps``: token maps over the image, ``rollout_figure`` (Fig. 6 / Fig. 14), ``heads_figure`` (one query's attention
  in every head of a layer);
- ``attribution``: ``attribution_figure`` (maps of several methods), ``attribution_figures`` (with every scored
  metric's curves), ``metric_figure`` (any perturbation metric of ``METRIC_TABLE``, drawn from its entry's
  ``curves``), ``faithfulness_figure``, ``perturbation_figure`` / ``road_figure`` (Chefer et al.'s and ROAD's
  curves), ``sanity_figure`` (Adebayo et al.'s cascading randomisation, Fig. 2);
- ``compare``: ``cka_figure`` and ``head_importance_figure``;
- ``video_weights``: ``video_position_figure`` (position similarity over time and over space) and
  ``tubelet_filters_figure`` (the tubelet filters' components, one image per time step);
- ``spacetime``: ``spacetime_distance_figure`` (Fig. 7 right in space and time), ``spacetime_compare_figure``
  (Fig. 11 of several video models), ``spacetime_rollout_figure`` (rollout, a map per time step);
- ``components``: ``contributions_figure`` (layer x head parts, the ledger in the title), ``head_contribution_figure``
  (one head's part over the image), ``logit_lens_figure``, ``token_norms_figure``, ``patching_figure``,
  ``text_span_figure`` (TextSpan's explained variance by head), ``text_span_evaluation_figure`` (with the accuracy
  once the heads are replaced by their texts), ``mean_ablation_figure`` (scores before and after);
- ``probes``: ``probes_figure`` (linear probes' held-out accuracy by block, Raghu et al. 2021) and
  ``sae_training_figure`` (an SAE's FVU, L0 and dead features by tokens seen);
- ``sae``: a sparse autoencoder's features: ``sae_top_images_figure`` (a feature over its top images, drawn as the
  rollout's overlays), ``sae_feature_figure`` (histogram, grid cells, classes, logit effect), ``sae_writers_figure``
  (its writer heads against their mean attention distance), ``sae_frequency_figure``, ``sae_intervention_figure``;
- ``colours``: the colours every figure shares; ``registry``: ``draws``, ``DRAWERS``, ``figure_for``.

Every heatmap puts image row 0 (patch row 0) at the top, as the image itself is shown. A token map over an image
is drawn as tokens (one flat cell per token, ``token_heatmap``) on a perceptually uniform scale from 0 to the
data's maximum (``colour_range``).
"""
from __future__ import annotations

from ..core.resample import upsample_map  # noqa: F401  re-exported where it was; the figures draw tokens as tokens
from .registry import DRAWERS, Drawer, drawer_for, draws, figure_for
from .colours import METHOD_PALETTE, PALETTE, component_rgb, method_colour, method_label, model_colours
from .weights import filters_figure, position_figure, position_mosaic, relpos_figure, similarity_tile_figure
from .distance import depth_distance_figure, distance_figure, prefix_figure, windowed_distance_figure
from .maps import (TOKEN_COLORSCALE, colour_range, grid_columns, head_figure, heads_figure, heatmap_overlay_figure,
                   overlay_grid_figure, rollout_figure, rollout_grid_figure, token_heatmap)
from .attribution import (attribution_figure, attribution_figures, attributions_figure, faithfulness_figure,
                          metric_figure, perturbation_figure, road_figure, sanity_figure, table_figure)
from .compare import cka_figure, head_importance_figure
from .video_weights import tubelet_filters_figure, video_position_figure
from .spacetime import spacetime_compare_figure, spacetime_distance_figure, spacetime_rollout_figure
from .components import (contributions_figure, head_contribution_figure, logit_lens_figure, mean_ablation_figure,
                         patching_figure, text_span_evaluation_figure, text_span_figure, token_norms_figure)
from .probes import probes_figure, sae_training_figure
from .sae import (sae_feature_figure, sae_frequency_figure, sae_intervention_figure, sae_top_images_figure,
                  sae_writers_figure)

__all__ = [
    "DRAWERS", "Drawer", "METHOD_PALETTE", "PALETTE", "TOKEN_COLORSCALE", "attribution_figure", "attribution_figures",
    "attributions_figure", "cka_figure", "colour_range", "component_rgb", "depth_distance_figure", "distance_figure",
    "drawer_for", "draws", "faithfulness_figure", "figure_for", "filters_figure", "grid_columns", "head_figure",
    "head_importance_figure", "heads_figure", "heatmap_overlay_figure", "method_colour", "method_label",
    "metric_figure", "model_colours", "overlay_grid_figure", "perturbation_figure", "position_figure",
    "position_mosaic", "prefix_figure", "relpos_figure", "road_figure", "rollout_figure", "rollout_grid_figure",
    "sanity_figure", "similarity_tile_figure", "table_figure", "token_heatmap", "upsample_map",
    "windowed_distance_figure", "contributions_figure", "head_contribution_figure", "logit_lens_figure",
    "token_norms_figure", "patching_figure", "text_span_figure", "text_span_evaluation_figure", "mean_ablation_figure",
    "tubelet_filters_figure", "video_position_figure",
    "spacetime_compare_figure", "spacetime_distance_figure", "spacetime_rollout_figure",
    "probes_figure", "sae_training_figure",
    "sae_feature_figure", "sae_frequency_figure", "sae_intervention_figure", "sae_top_images_figure",
    "sae_writers_figure",
]
