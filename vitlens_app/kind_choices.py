"""Every choice the app makes by a model's kind (``ModelSpec.kind``), one function per choice.

The pages never branch on ``spec.kind`` themselves: they ask one of these, so that what the app does for each kind
of model is in this module alone (and, once the library has a kind registry, derived from it). The kinds:
"vit" (one sequence of tokens), "hybrid" (a CNN stem before the blocks), "hierarchical" (windowed or pooling
attention on stages of coarser grids: Swin, MViT v2, Hiera, ...), "class-attention" (CaiT: self-attention over
the patches, then class-attention layers).
"""
from __future__ import annotations

import vitlens as vl

#: the kinds whose attention is not one sequence of tokens with its prefix: the windowed and pooling stages, and
#: CaiT's self-attention over the patches alone (no prefix token among the keys)
NO_PREFIX_KEYS = ("hierarchical", "class-attention")


def distance_pass_views(spec: vl.ModelSpec) -> tuple[str, ...]:
    """The views of the Attention distance page's one pass over the images: the distance, and the attention on
    prefix tokens for a model whose attention has prefix tokens among its keys."""
    return ("distance",) if spec.kind in NO_PREFIX_KEYS else ("distance", "prefix")


def filters_read_the_cnn(spec: vl.ModelSpec) -> bool:
    """Whether the Filters page says it shows the CNN's first convolution (a hybrid's patch embedding acts on CNN
    channels, not pixels)."""
    return spec.kind == "hybrid"


def distance_by_stage(spec: vl.ModelSpec) -> bool:
    """Whether the Attention distance page shows the windowed distance: blocks coloured by stage, a stage picker."""
    return spec.kind == "hierarchical"


def distance_without_prefix(spec: vl.ModelSpec) -> bool:
    """Whether the Attention distance page says that the blocks attend over the patches alone (CaiT), in place of
    the prefix tokens' figure and the head importance."""
    return spec.kind == "class-attention"


def rollout_discards(spec: vl.ModelSpec) -> bool:
    """Whether the rollout's discard ratio applies (defined for a ViT's maps over one sequence of tokens; the
    other kinds' rollout uses 0 and the page says so)."""
    return spec.kind not in NO_PREFIX_KEYS


def maps_by_window(spec: vl.ModelSpec) -> bool:
    """Whether the Attention maps page shows one query's attention in its window, per block (hierarchical)."""
    return spec.kind == "hierarchical"


def maps_of_class_attention(spec: vl.ModelSpec) -> bool:
    """Whether the Attention maps page shows the rollout alone and says why no query's maps are offered (CaiT)."""
    return spec.kind == "class-attention"


def attributions_by_stage(spec: vl.ModelSpec) -> bool:
    """Whether the Attributions page names the methods left out for the model and says that the CAMs map the
    last stage's grid (hierarchical)."""
    return spec.kind == "hierarchical"


__all__ = ["NO_PREFIX_KEYS", "attributions_by_stage", "distance_by_stage", "distance_pass_views",
           "distance_without_prefix", "filters_read_the_cnn", "maps_by_window", "maps_of_class_attention",
           "rollout_discards"]
