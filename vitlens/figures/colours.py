"""The colours every figure shares: one per model of an analysis (``model_colours``), one per attribution method
(``method_colour``, by its place in the methods registry), and a filter component as RGB pixels."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from ..attribution.methods import METHOD_TABLE, method_label as label
from ..loading.presets import PRESETS

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def model_colours(names: Sequence[str], weights: Sequence[str] | None = None) -> list[str]:
    """The colour of each model of one analysis, the same in every figure of it whatever order the models come in
    (the app's Compare with the hybrid picked first, the survey's sorted table, compare.html): the models are put in
    a stable order, the named presets first in the registry's order (``vitlens.loading.presets.PRESETS``: ref-vit,
    then ref-hybrid), then the others by name (then weights, then their place when the same name comes twice), and
    take ``PALETTE`` in that order: the embedded ViT blue and its hybrid red, wherever they are drawn together.

    Args:
        names: the models' names (a ``ModelSpec.name`` or the name they were loaded by).
        weights: each model's weights ("pretrained", "random init", ...), to tell one model's two runs apart.

    Returns:
        [len(names)] CSS colours, in the order of ``names``.
    """
    rank = {p.name: i for i, p in enumerate(PRESETS)}
    extra = list(weights) if weights is not None else [""] * len(names)
    order = sorted(range(len(names)), key=lambda i: (rank.get(names[i], len(rank)), names[i], extra[i], i))
    colours = [""] * len(names)
    for place, i in enumerate(order):
        colours[i] = PALETTE[place % len(PALETTE)]
    return colours


#: one colour per attribution method, indexed by the method's place in the registry
#: (``vitlens.attribution.methods.METHODS``): every method of the registry has its own colour, the same one in
#: every figure. A qualitative palette of distinct hues (Tableau 10, then darker Tableau 20b/c hues), placed so the
#: methods the app preselects and AttnLRP sit at least 60 degrees of hue apart: rollout blue, gradient rollout
#: orange, saliency purple, AttnLRP (place 14) green (gradient rollout pink beside saliency red read alike); none
#: is a placeholder Streamlit's chart theme swaps (#0000xx)
METHOD_PALETTE = ("#1F77B4", "#FF7F0E", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#BCBD22", "#17BECF",
                  "#7F7F7F", "#393B79", "#637939", "#8C6D31", "#843C39", "#7B4173", "#2CA02C", "#6B6ECF",
                  "#E7BA52", "#9C9EDE", "#CEDB9C", "#E7969C", "#DE9ED6", "#AD494A", "#31A354", "#3182BD")


def method_colour(method: str, position: int = 0) -> str:
    """The colour of one attribution method in every figure (``METHOD_PALETTE``, by its place in the registry;
    a name the registry does not hold takes its ``position`` in the figure).

    Args:
        method: a name in ``vitlens.attribution.METHOD_TABLE`` (or any other name).
        position: the method's place in the figure, used only for a name the registry does not hold.

    Returns:
        A CSS colour string from ``METHOD_PALETTE``.
    """
    names = list(METHOD_TABLE)  # read at call time: a method registered later has its own place
    index = names.index(method) if method in names else position
    return METHOD_PALETTE[index % len(METHOD_PALETTE)]


def method_label(method: str) -> str:
    """A method's name as legends and panel titles show it (``vitlens.attribution.methods.method_label``).

    Args:
        method: the method's identifier in ``METHOD_TABLE`` (e.g. ``grad_rollout``).

    Returns:
        Its entry's label, e.g. "gradient rollout".
    """
    return label(method)


def component_rgb(component: np.ndarray) -> np.ndarray:
    """[C, kh, kw] component -> uint8 [kh, kw, 3], min-max scaled per component (gray if C != 3).

    Args:
        component: [C, kh, kw] one principal component of the filters.

    Returns:
        uint8 [kh, kw, 3] pixels.
    """
    c = component.astype(np.float64)
    span = c.max() - c.min()
    c = (c - c.min()) / span if span > 0 else np.zeros_like(c)
    img = np.moveaxis(c, 0, -1)
    if img.shape[-1] != 3:
        img = np.repeat(img.mean(-1, keepdims=True), 3, axis=-1)
    return np.round(img * 255).astype(np.uint8)
