"""How a result is drawn: every figure function that draws a result type registers for it where it is written
(``draws``), and ``figure_for`` finds it by the result's class; a view registered outside ``vitlens.figures`` brings
its own (``View.draw``, ``vitlens.views.registry.register_view``). The report and the app draw every result through
``figure_for``, so no view, metric or page names a figure function to draw a result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from ..errors import InvalidParameterError
from ..views.registry import VIEWS


@dataclass(frozen=True)
class Drawer:
    """How a result is drawn (``draws``).

    Attributes:
        fn: the figure function, ``fn(result)`` or ``fn(result, images)``.
        images: whether it takes the images as the model sees them (the rollout's overlays, attribution maps).
        when: result -> whether there is anything to draw (None: always).
        many: whether it draws several results of its class side by side (one per attribution method): it is
            called with a list, one result becoming a list of one.
    """

    fn: Callable[..., go.Figure]
    images: bool = False
    when: Callable[[Any], bool] | None = None
    many: bool = False


#: the figure function of each result class, registered where the function is written (``draws``): the one place
#: the report and the app find how to draw a result (``figure_for``), so no view names a figure
DRAWERS: dict[type, Drawer] = {}


def draws(*result_types: type, images: bool = False, when: Callable[[Any], bool] | None = None,
          many: bool = False) -> Callable:
    """Register the decorated figure function as the one that draws results of ``result_types`` (``figure_for``).

    Args:
        *result_types: the result classes it draws.
        images: it takes the images as the model sees them as its second argument.
        when: result -> whether the result has anything to draw (None: always).
        many: it takes a list of results of the class (several methods side by side).

    Returns:
        The decorator (the function is returned unchanged).
    """
    def register(fn: Callable[..., go.Figure]) -> Callable[..., go.Figure]:
        for t in result_types:
            DRAWERS[t] = Drawer(fn, images, when, many)
        return fn
    return register


def drawer_for(result_type: type) -> Drawer | None:
    """The drawer of a result class: registered for it or a base class (``DRAWERS``), else the ``View.draw`` of a
    registered view that gives it.

    Args:
        result_type: the result's class.

    Returns:
        Its ``Drawer``, or None when no figure draws it.
    """
    for t in result_type.__mro__:
        if t in DRAWERS:
            return DRAWERS[t]
    for t in result_type.__mro__:
        view = next((v for v in VIEWS.values() if v.result_type is t and v.draw is not None), None)
        if view is not None:
            # the ignore below: a view's draw is a figure builder of its result (typed Callable[..., Any])
            return Drawer(view.draw)  # type: ignore[arg-type]
    return None


def figure_for(result: Any, images: Sequence[np.ndarray] | None = None) -> go.Figure | None:
    """The figure of a result, by its class (``DRAWERS``, or its view's ``View.draw``); None when it has nothing to
    draw (the prefix diagnostics of a model without prefix tokens).

    Args:
        result: a result (``AnalysisResult.view(name)``, a ``ComparisonTable``, a ``CKAResult``, ...), or a list of
            results of one class that are drawn side by side (one ``FaithfulnessResult`` per method).
        images: uint8 [H, W, 3] images as the model sees them, for a figure that overlays them (rollout, attribution
            maps: the first image).

    Returns:
        A plotly ``Figure``, or None.

    Raises:
        InvalidParameterError: no figure is registered for the result's class, a list of results its figure does not
            draw together, or a figure that needs images and got none.
    """
    several = isinstance(result, (list, tuple))
    if several and not result:
        raise InvalidParameterError("figure_for got an empty list of results; pass at least one.")
    first = result[0] if several else result
    drawer = drawer_for(type(first))
    if drawer is None:
        raise InvalidParameterError(f"No figure draws a {type(first).__name__}; register one with "
                                    "vitlens.figures.draws, or give its view a draw function (register_view).")
    if several and not drawer.many:
        raise InvalidParameterError(f"{drawer.fn.__name__} draws one {type(first).__name__}; pass one result.")
    if drawer.when is not None and not drawer.when(first):
        return None
    arg = (list(result) if several else [result]) if drawer.many else result
    if drawer.images:
        if images is None:
            raise InvalidParameterError(f"{drawer.fn.__name__} overlays the images: pass them as the model sees them, "
                                        "images=m.display(images) (m the model the result came from), e.g. "
                                        "figures.figure_for(result, images=m.display(images)).")
        return drawer.fn(arg, images)
    return drawer.fn(arg)


__all__ = ["DRAWERS", "Drawer", "draws", "drawer_for", "figure_for"]
