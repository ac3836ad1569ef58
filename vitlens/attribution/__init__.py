"""Class-specific attributions beside rollout, and how faithful each map is.

- ``methods``: one contract for every method (images in, [B, gh, gw] maps out): rollout,
  gradient-weighted rollout and captum's integrated gradients, saliency, input x gradient,
  occlusion, the Grad-CAM family (``cam``) and AttnLRP (``lrp``) with its ViT variants (the γ-rule, CP-LRP);
- ``metrics``: the perturbation metrics' one registry (``METRIC_TABLE``, ``register_metric``), what the
  comparison, the report, the CLI and the app read;
- ``deletion``: deletion/insertion curves; ``perturbation``: Chefer et al.'s positive/negative perturbation
  and ROAD (``imputation``: its noisy linear imputation);
- ``faithfulness``: the methods x metrics comparison table;
- ``sanity``: Adebayo et al.'s cascading model-parameter randomisation;
- ``masks``: does a map point at the object (mass in mask, pointing game);
- ``evaluation``: accuracy and rollout-in-mask on labelled, masked image sets.
"""
from __future__ import annotations

from .evaluation import accuracy, rollout_mask_scores
from .baselines import BASELINES
from .deletion import FaithfulnessResult, deletion_insertion
from .faithfulness import ComparisonTable, compare_methods
from .lrp import LRPRules
from .lrp_ledger import ConservationLedger, attnlrp_ledger, lrp_methods
from .masks import MaskScores, mask_scores, patch_coverage
from .methods import METHOD_TABLE, Method, attribute, method_names, register_method
from .result import AttributionResult
from .metrics import METRIC_TABLE, Metric, register_metric
from .protocols import ORDERINGS, PROTOCOLS
from .perturbation import PerturbationResult, RoadResult, perturbation_test, road
from .sanity import SanityResult, SanityTable, sanity_check, sanity_table

__all__ = ["BASELINES", "METHOD_TABLE", "method_names", "register_method", "AttributionResult", "ComparisonTable",
           "FaithfulnessResult", "MaskScores", "Method", "accuracy", "attribute", "compare_methods",
           "deletion_insertion", "mask_scores", "patch_coverage", "rollout_mask_scores",
           "PerturbationResult", "RoadResult", "SanityResult", "SanityTable", "perturbation_test", "road",
           "sanity_check", "sanity_table", "ConservationLedger", "attnlrp_ledger", "PROTOCOLS", "ORDERINGS",
           "LRPRules", "lrp_methods", "METRIC_TABLE", "Metric", "register_metric"]


def __getattr__(name: str):
    """``METHODS`` (``method_names()``: the registered methods, read when asked) and ``DEFAULTS`` (each method's
    default parameters) are read from ``METHOD_TABLE``: ``METHOD_TABLE[m].defaults``."""
    if name == "METHODS":
        return method_names()
    if name == "DEFAULTS":
        import warnings

        warnings.warn("vitlens.attribution.DEFAULTS is deprecated; read METHOD_TABLE[name].defaults.",
                      DeprecationWarning, stacklevel=2)
        return {k: dict(mt.defaults) for k, mt in METHOD_TABLE.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
