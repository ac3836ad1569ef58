"""The app's one window onto the library's parts that are not its public API.

Every other module of the app imports ``vitlens`` (the names of its lazy list, ``vitlens/__init__.py``) and
``vitlens.figures`` only (``tests/test_app_layout.py`` checks it); what a page needs beyond them comes from
here, one import per part of the library, so that publishing a name (or replacing one) is an edit of this
file alone. One seam is a function, not a name:

- ``whole_maps_fit``: whether every query's maps of an image fit the page's budget (read when called, so
  the budget ``vitlens.views.attention_maps.WHOLE_MAPS_MB`` may be changed at run time).
"""
from __future__ import annotations


import vitlens as vl
# attribution: the method and metric registries, the words of their tables, text towers, AttnLRP's ledger
from vitlens.attribution import METHOD_TABLE
from vitlens.attribution.faithfulness import timing_note
from vitlens.attribution.lrp_ledger import attnlrp_ledger, lrp_methods
from vitlens.attribution.methods import methods_for, preselected_methods
from vitlens.attribution.metrics import METRIC_TABLE, default_metrics, metric_label
from vitlens.attribution.sanity import verdict_rule
from vitlens.attribution.text import has_text_tower
from vitlens.compare.heads import cost as head_cost
# the components' ledger bound (docs/definitions.md, "The ledger")
from vitlens.components import LEDGER_RTOL
# clips: the frames a video model's processor takes, the video files read
from vitlens.clips import CLIP_SUFFIXES, VideoProcessing, sampled_clip
# images, models and the embedded reference scenes
from vitlens.image_uploads import read_uploads
from vitlens.images import MAX_UPLOAD_MB, SAMPLE_NAMES, UPLOAD_TYPES
# checkpoints: the suffixes the loader reads as a checkpoint file
from vitlens.loading.checkpoint import CHECKPOINT_SUFFIXES
from vitlens.loading.seeded import load_model_seeded
from vitlens.progress import time_left
from vitlens.reference.shapes import CLASSES as SHAPES, HELD_OUT_SEED, generate, scene_names
# the command line's and the reports' pieces the app shows the same way
from vitlens.report.data import comparison, distance_reading
from vitlens.report.export import browser_path, figure_html, figure_png
from vitlens.report.video import sampled_fps
from vitlens.report.survey import summary_rows, survey_figures
from vitlens.results import round_significant
# the views: their registry and the helpers of their pages
from vitlens.views import attention_maps as maps_view
from vitlens.views.attention_maps import query_label, whole_maps_mb
from vitlens.views.filters import max_filter_components
from vitlens.views.prefix import prefix_labels
from vitlens.views.registry import CLIP_PAGES, VIEWS
from vitlens.views.rollout import format_probability
from vitlens.views.windowed import model_windows
from vitlens.views.windowed_rollout import query_window_attention, window_maps
from vitlens.words import counted, listed_some
# result classes and tables that left vitlens's top level (issue 61): the pages' annotations and the presets
from vitlens.attribution import ComparisonTable
from vitlens.components import DecompositionResult, LogitLensResult, PatchingResult, TokenNormsResult
from vitlens.loading import PRESETS
from vitlens.views.analyze import AnalysisResult
from vitlens.views.attention_maps import AttentionMapsResult
from vitlens.views.filters import FilterPCAResult
from vitlens.views.position import PositionSimilarityResult
from vitlens.views.relpos import RelativePositionBiasResult
from vitlens.views.rollout import RolloutResult
from vitlens.views.spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult
from vitlens.views.video_weights import TubeletFilterPCAResult, VideoPositionSimilarityResult
from vitlens.views.windowed import WindowedDistanceResult

__all__ = [
    "AnalysisResult", "AttentionMapsResult", "ComparisonTable", "DecompositionResult", "FilterPCAResult",
    "LogitLensResult", "PRESETS", "PatchingResult", "PositionSimilarityResult", "RelativePositionBiasResult",
    "RolloutResult", "SpaceTimeDistanceResult", "SpaceTimeRolloutResult", "TokenNormsResult", "TubeletFilterPCAResult",
    "VideoPositionSimilarityResult", "WindowedDistanceResult",
    "CLIP_PAGES", "HELD_OUT_SEED", "MAX_UPLOAD_MB", "METHOD_TABLE", "METRIC_TABLE", "SAMPLE_NAMES", "SHAPES",
    "UPLOAD_TYPES", "CHECKPOINT_SUFFIXES", "CLIP_SUFFIXES", "VIEWS",
    "LEDGER_RTOL", "attnlrp_ledger", "clip_frames", "browser_path", "comparison", "counted", "default_metrics",
    "distance_reading", "figure_html", "figure_png", "format_probability", "generate", "has_text_tower", "head_cost",
    "listed_some", "load_model_seeded", "lrp_methods", "max_filter_components", "methods_for",
    "metric_label",
    "model_windows", "prefix_labels", "preselected_methods", "query_label",
    "query_window_attention", "read_uploads", "round_significant", "sampled_clip", "sampled_fps", "scene_names",
    "summary_rows", "survey_figures",
    "time_left", "timing_note", "verdict_rule", "whole_maps_fit", "whole_maps_mb", "window_maps",
]


def whole_maps_fit(spec: vl.ModelSpec) -> bool:
    """Whether every query's maps of one image fit the budget (``WHOLE_MAPS_MB``, read now): computed at once;
    otherwise the page asks for the picked query's rows only."""
    return whole_maps_mb(spec) <= maps_view.WHOLE_MAPS_MB


def clip_frames(m: vl.LoadedModel) -> int:
    """The frames a video model's processor takes from a clip (its config's ``num_frames``; V-JEPA 2's
    ``frames_per_clip``)."""
    return VideoProcessing.of(m).num_frames
