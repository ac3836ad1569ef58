"""The one public place vitlens is extended from: every registry, with the one way each is added to.

Each registry is the one source of what it names (the lists the app, the command line, the reports and the survey
show are read from them when they are shown, so an entry registered later is in every list):

- kinds of model (``Kind``, ``register_kind``; ``registered_kind`` for a test's temporary kind): how a kind's
  attention maps are read and which views and methods are defined for it;
- views (``View``, ``register_view``): what ``vitlens.analyze`` computes (the paper's four by default: Fig. 7 left,
  centre and right, Fig. 6), the report draws, the survey keeps and the app shows;
- attribution methods (``Method``, ``register_method``) and faithfulness metrics (``Metric``,
  ``register_metric``): what ``vitlens.attribute`` and ``vitlens.compare_methods`` run;
- model families (``register_family``) and token layouts (``register_layout``): how a model is read exactly.

Everything here is a name of its own module too; this module only gathers them (the sixth tutorial,
"extending vitlens", uses it).
"""
from __future__ import annotations

from .attribution.methods import METHOD_TABLE, Method, method_names, register_method
from .attribution.metrics import METRIC_TABLE, Metric, metric_names, register_metric
from .families import FAMILIES, Family, register as register_family, register_layout
from .kinds import Kind, all_kinds, kind_names, kind_of, register_kind, registered_kind, unregister_kind
from .views.registry import VIEWS, SurveyStat, View, ViewParams, available_views, default_views, register_view, \
    view_names


def attribution_methods() -> tuple[str, ...]:
    """The registered attribution methods' names (``METHOD_TABLE``), read when called.

    Returns:
        The names, the built-in methods first.
    """
    return method_names()


__all__ = ["FAMILIES", "METHOD_TABLE", "METRIC_TABLE", "VIEWS", "Family", "Kind", "Method", "Metric", "SurveyStat",
           "View", "ViewParams", "all_kinds", "attribution_methods", "available_views", "default_views", "kind_names",
           "kind_of", "method_names", "metric_names", "register_family", "register_kind", "register_layout",
           "register_method", "register_metric", "register_view", "registered_kind", "unregister_kind",
           "view_names"]
