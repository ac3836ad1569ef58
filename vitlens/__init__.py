"""vitlens: the interpretability views of the ViT paper (Dosovitskiy et al., ICLR 2021, section 4.5)
for any timm Vision Transformer.

    import vitlens as vl
    m = vl.load_model("ref-vit")
    r = vl.analyze(m, vl.sample_images())
"""
from __future__ import annotations

from .analyze import AnalysisResult, analyze, attention_distance, attention_rollout, stream_attention
from .attribution import METHODS as ATTRIBUTION_METHODS
from .attribution import AttributionResult, attribute
from .capture import AttentionCapture, attention_probs, capture_attention
from .errors import (
    CheckpointError,
    ImageLoadError,
    InvalidParameterError,
    UnknownModelError,
    UnsupportedModelError,
    ViewNotAvailableError,
    VitlensError,
    WeightsUnavailableError,
)
from .faithfulness import ComparisonTable, FaithfulnessResult, compare_methods, deletion_insertion
from .images import preprocess, sample_images, to_rgb
from .model import LoadedModel, ModelSpec, load_model
from .presets import PRESETS, list_models
from .results import Result, load_result
from .views.distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .views.filters import FilterPCAResult, embedding_filter_pca
from .views.position import PositionSimilarityResult, position_similarity
from .views.rollout import RolloutAccumulator, RolloutResult

__version__ = "0.1.0"

__all__ = [
    "ATTRIBUTION_METHODS", "AttributionResult", "ComparisonTable", "FaithfulnessResult", "attribute",
    "compare_methods", "deletion_insertion",
    "AnalysisResult", "AttentionCapture", "AttentionDistanceAccumulator", "AttentionDistanceResult",
    "CheckpointError", "FilterPCAResult", "ImageLoadError", "InvalidParameterError", "LoadedModel", "ModelSpec",
    "PRESETS", "PositionSimilarityResult", "Result", "RolloutAccumulator", "RolloutResult", "UnknownModelError",
    "UnsupportedModelError", "ViewNotAvailableError", "VitlensError", "WeightsUnavailableError", "analyze",
    "attention_distance", "attention_probs", "attention_rollout", "capture_attention", "embedding_filter_pca",
    "list_models", "load_model", "load_result", "position_similarity", "preprocess", "sample_images",
    "stream_attention", "to_rgb",
]
