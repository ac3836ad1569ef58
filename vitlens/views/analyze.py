"""The views as one call each, and all four from one pass: attention distance (Fig. 7 right,
Fig. 11) and rollout (Fig. 6) share one forward per batch; ``analyze`` adds the two weight-only
views (Fig. 7 left and centre).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..images import Images
from ..loading.model import LoadedModel
from ..loading.spec import ModelSpec
from ..progress import ProgressArg
from ..results import Result
from .distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .engine import stream_attention
from .filters import FilterPCAResult, embedding_filter_pca, max_filter_components
from .position import PositionSimilarityResult, position_similarity
from .rollout import RolloutAccumulator, RolloutResult


def attention_distance(
    m: LoadedModel,
    images: Images,
    batch_size: int = 32,
    renormalize: bool = True,
    progress: ProgressArg = None,
) -> AttentionDistanceResult:
    """Mean attention distance of every head, averaged over images (paper Fig. 7 right, Fig. 11).

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        batch_size: images per forward.
        renormalize: renormalise each query's weights over patch keys (the default choice);
            False keeps the raw weights (the keras example's convention).
        progress: True for a progress bar, or a callable ``f(done, total)``.
    """
    acc = AttentionDistanceAccumulator.for_model(m.spec, renormalize)
    stream_attention(m, images, [acc], batch_size, progress, desc="attention distance")
    return acc.result(m.spec)


def attention_rollout(
    m: LoadedModel,
    images: Images,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    batch_size: int = 32,
    progress: ProgressArg = None,
) -> RolloutResult:
    """Attention rollout maps (paper Fig. 6, Fig. 14) with the model's predictions.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        head_fusion: "mean" (default), "max" or "min" over heads.
        discard_ratio: fraction of the smallest fused weights zeroed per image and block.
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.
    """
    acc = RolloutAccumulator.for_model(m, head_fusion, discard_ratio)
    stream_attention(m, images, [acc], batch_size, progress, desc="rollout")
    return acc.result(m.spec)


@dataclass(eq=False, repr=False)
class AnalysisResult(Result):
    """All four views of one model over one image set.

    Attributes:
        spec: the model's spec.
        filters: embedding-filter PCA (Fig. 7 left).
        position: position-embedding similarity (Fig. 7 centre), or None (see ``position_note``).
        distance: attention distance (Fig. 7 right).
        rollout: rollout maps of every image (Fig. 6).
        position_note: why ``position`` is None, if it is.
    """

    kind = "analysis"
    spec: ModelSpec
    filters: FilterPCAResult
    position: PositionSimilarityResult | None
    distance: AttentionDistanceResult
    rollout: RolloutResult
    position_note: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):  # files written before the spec was a ModelSpec
            self.spec = ModelSpec.from_dict(self.spec)

    def summary(self) -> str:
        return f"{self.spec.name}: four views over {self.distance.n_images} images"

    def to_rows(self) -> list[dict[str, Any]]:
        """The attention-distance rows (the view with a number per head)."""
        return self.distance.to_rows()


def analyze(
    m: LoadedModel,
    images: Images,
    batch_size: int = 32,
    n_components: int = 28,
    renormalize: bool = True,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    progress: ProgressArg = None,
) -> AnalysisResult:
    """All four views; attention distance and rollout come from ONE forward per batch.

    ``n_components`` is capped at the number the model's filters allow.
    """
    if n_components < 1:
        raise InvalidParameterError(f"n_components must be >= 1; got {n_components}.")
    dist = AttentionDistanceAccumulator.for_model(m.spec, renormalize)
    roll = RolloutAccumulator.for_model(m, head_fusion, discard_ratio)
    stream_attention(m, images, [dist, roll], batch_size, progress, desc="analyze")
    try:
        position, note = position_similarity(m), ""
    except ViewNotAvailableError as e:
        position, note = None, str(e)
    filters = embedding_filter_pca(m, min(n_components, max_filter_components(m)))
    return AnalysisResult(spec=m.spec, filters=filters, position=position, distance=dist.result(m.spec),
                          rollout=roll.result(m.spec), position_note=note)


__all__ = ["AnalysisResult", "analyze", "attention_distance", "attention_rollout"]
