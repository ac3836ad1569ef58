"""Every choice the app makes by a model's kind (``ModelSpec.kind``), one function per choice.

The pages never branch on ``spec.kind`` themselves: they ask one of these, so that what the app does for each kind
of model is in this module alone, each answer read from the kind's record in the kind registry
(``vl.kind_of(spec)``, ``vitlens/kinds.py``): a new kind registered there is served by the app with no edit here.
"""
from __future__ import annotations

import vitlens as vl

def distance_pass_views(spec: vl.ModelSpec) -> tuple[str, ...]:
    """The views of the Attention distance page's one pass over the images: the distance, and the attention on
    prefix tokens for a model whose attention has prefix tokens among its keys."""
    return vl.available_views(spec, ("distance", "prefix"))


def filters_read_the_cnn(spec: vl.ModelSpec) -> bool:
    """Whether the Filters page says it shows the CNN's first convolution (a hybrid's patch embedding acts on CNN
    channels, not pixels)."""
    return vl.kind_of(spec).cnn_stem


def distance_by_stage(spec: vl.ModelSpec) -> bool:
    """Whether the Attention distance page shows the windowed distance: blocks coloured by stage, a stage picker."""
    return vl.kind_of(spec).stages


def distance_without_prefix(spec: vl.ModelSpec) -> bool:
    """Whether the Attention distance page says that the blocks attend over the patches alone (CaiT), in place of
    the prefix tokens' figure and the head importance."""
    return vl.kind_of(spec).class_layers


def rollout_discards(spec: vl.ModelSpec) -> bool:
    """Whether the rollout's discard ratio applies (defined for a ViT's maps over one sequence of tokens; the
    other kinds' rollout uses 0 and the page says so)."""
    return vl.kind_of(spec).token_attention


def maps_by_window(spec: vl.ModelSpec) -> bool:
    """Whether the Attention maps page shows one query's attention in its window, per block (hierarchical)."""
    return vl.kind_of(spec).stages


def maps_of_class_attention(spec: vl.ModelSpec) -> bool:
    """Whether the Attention maps page shows the rollout alone and says why no query's maps are offered (CaiT)."""
    return vl.kind_of(spec).class_layers


def attributions_by_stage(spec: vl.ModelSpec) -> bool:
    """Whether the Attributions page names the methods left out for the model and says that the CAMs map the
    last stage's grid (hierarchical)."""
    return vl.kind_of(spec).stages


def reads_clips(spec: vl.ModelSpec) -> bool:
    """Whether the model reads clips, not images (a video model): the sidebar offers a clip, and the page its
    space-time views (``vitlens_app.video``)."""
    return vl.kind_of(spec).clips


__all__ = ["attributions_by_stage", "distance_by_stage", "distance_pass_views",
           "distance_without_prefix", "filters_read_the_cnn", "maps_by_window", "maps_of_class_attention",
           "reads_clips", "rollout_discards"]
