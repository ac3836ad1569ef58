"""vitlens: the interpretability views of the ViT paper (Dosovitskiy et al., ICLR 2021, section 4.5)
for any timm Vision Transformer.

    import vitlens as vl
    m = vl.load_model("ref-vit")
    r = vl.analyze(m, vl.sample_images())

The package, by what each part is:

- ``core``: ``ModelSpec`` and the attention and filter maths every family shares (imports nothing of vitlens);
- ``loading``: names to models (embedded pair, timm hub, checkpoints, user modules);
- ``families``: how each kind of ViT is read exactly (spec, attention capture, filters, E_pos);
- ``views``: the paper's four views (and the relative-position bias, Fig. 7 centre's analogue), one image's
  attention maps, and the streaming engine;
- ``attribution``: class-specific attributions, faithfulness, mask metrics;
- ``compare``: layer-by-layer CKA between models, head importance;
- ``components``: the output as an exact sum over embeddings, heads x tokens, MLPs and biases (with a ledger);
- ``reference``: the embedded reference pair (scenes, models, training, weights);
- ``survey``: a model zoo x an image set on Ray, resumable, one tidy table;
- ``report``: the command line and its offline HTML pages;
- ``figures``, ``results``, ``images``, ``progress``, ``errors``: shared pieces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__

if TYPE_CHECKING:  # the public names, imported on first use (``_lazy``): ``import vitlens`` does not import torch
    from .attribution import METHODS as ATTRIBUTION_METHODS
    from .attribution import (
        AttributionResult, ComparisonTable, FaithfulnessResult, attribute, compare_methods, deletion_insertion)
    from .attribution import SanityResult, perturbation_test, road, sanity_check, sanity_table
    from .compare import CKAResult, HeadImportanceResult, cka, head_importance
    from .components import DecompositionResult, LogitLensResult, PatchingResult, TokenNormsResult
    from .components import decompose, logit_lens, patch_activations, token_norms
    from .components import MeanAblationResult, TextSpanResult, mean_ablate, text_span
    from .errors import (
        CheckpointError,
        DeviceUnavailableError,
        ClipLoadError,
        ImageLoadError,
        InvalidParameterError,
        UnknownModelError,
        UnsupportedModelError,
        ViewNotAvailableError,
        VitlensError,
        WeightsUnavailableError,
    )
    from .images import Images, preprocess, sample_images, to_rgb
    from .kinds import Kind, all_kinds, kind_of, register_kind, registered_kind
    from .loading import PRESETS, LoadedModel, ModelSpec, list_models, load_model
    from .results import Result, load_result
    from .report.data import ComparisonData, ReportData
    from .survey import SurveyResult, load_survey, survey
    from .views.analyze import AnalysisResult, analyze, attention_distance, attention_rollout
    from .views.attention_maps import AttentionMapsResult, attention_maps, query_token
    from .views.packed import analyze_each
    from .engine.capture import AttentionCapture, attention_probs, capture_attention
    from .views.distance import AttentionDistanceAccumulator, AttentionDistanceResult
    from .engine import AttentionConsumer, BatchInfo, stream_attention
    from .views.filters import FilterPCAResult, embedding_filter_pca
    from .views.video_weights import (TubeletFilterPCAResult, VideoPositionSimilarityResult, video_filter_pca,
                                      video_position_similarity)
    from .clips import Clip, MovingShape, clip_pixel_values, moving_shape_clip, read_clip, write_gif, write_mp4
    from .views.position import PositionSimilarityResult, position_similarity
    from .views.prefix import PrefixAttentionAccumulator, PrefixDiagnosticsResult, prefix_diagnostics
    from .views.registry import available_views
    from .views.relpos import RelativePositionBiasResult, relative_position_bias
    from .views.rollout import RolloutAccumulator, RolloutResult, rollout_sources
    from .views.windowed import WindowedDistanceAccumulator, WindowedDistanceResult, WindowedRolloutAccumulator
    from .views.class_attention import (ClassAttentionDistanceAccumulator, ClassAttentionDistanceResult,
                                        ClassAttentionRolloutAccumulator)
    from .views.spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult

__getattr__, __dir__ = lazy_names(__name__, __file__, globals())

__all__ = [
    "ATTRIBUTION_METHODS", "AnalysisResult", "CKAResult", "HeadImportanceResult", "PrefixAttentionAccumulator",
    "PrefixDiagnosticsResult", "cka", "head_importance", "prefix_diagnostics", "SurveyResult", "load_survey",
    "survey", "AttentionCapture", "AttentionConsumer", "AttentionDistanceAccumulator",
    "AttentionDistanceResult", "AttentionMapsResult", "AttributionResult", "BatchInfo", "CheckpointError",
    "ComparisonTable", "DeviceUnavailableError", "FaithfulnessResult", "FilterPCAResult", "ImageLoadError", "Images",
    "InvalidParameterError", "LoadedModel", "ModelSpec", "PRESETS", "PositionSimilarityResult", "Result",
    "RolloutAccumulator", "RolloutResult", "WindowedDistanceAccumulator", "WindowedDistanceResult",
    "WindowedRolloutAccumulator", "ClassAttentionDistanceAccumulator", "ClassAttentionDistanceResult",
    "ClassAttentionRolloutAccumulator", "UnknownModelError", "UnsupportedModelError", "ViewNotAvailableError",
    "VitlensError", "WeightsUnavailableError", "analyze", "attention_distance", "attention_maps", "attention_probs",
    "attention_rollout", "attribute", "capture_attention", "compare_methods", "deletion_insertion",
    "embedding_filter_pca", "list_models", "load_model", "load_result", "position_similarity", "preprocess",
    "query_token", "sample_images", "stream_attention", "to_rgb", "RelativePositionBiasResult", "relative_position_bias",
    "SanityResult", "perturbation_test", "road", "sanity_check", "sanity_table",
    "Kind", "all_kinds", "kind_of", "register_kind", "registered_kind", "available_views",
    "ComparisonData", "ReportData", "rollout_sources",
    "DecompositionResult", "decompose", "LogitLensResult", "logit_lens", "TokenNormsResult", "token_norms",
    "PatchingResult", "patch_activations",
    "TextSpanResult", "text_span", "MeanAblationResult", "mean_ablate",
    "analyze_each",
    "ClipLoadError", "Clip", "MovingShape", "clip_pixel_values", "moving_shape_clip", "read_clip", "write_gif",
    "write_mp4", "TubeletFilterPCAResult", "VideoPositionSimilarityResult", "video_filter_pca",
    "video_position_similarity",
    "SpaceTimeDistanceResult", "SpaceTimeRolloutResult",
]
