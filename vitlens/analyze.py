"""Running images through a model once and feeding every attention consumer from that one
forward: attention distance (Fig. 7 right, Fig. 11) and rollout (Fig. 6) share the pass, and
``analyze`` adds the two weight-only views (Fig. 7 left and centre).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from .capture import capture_attention
from .errors import InvalidParameterError, ViewNotAvailableError
from .images import iter_batches
from .model import LoadedModel
from .results import Result
from .views.distance import AttentionDistanceAccumulator, AttentionDistanceResult
from .views.filters import FilterPCAResult, embedding_filter_pca, max_filter_components
from .views.position import PositionSimilarityResult, position_similarity
from .views.rollout import RolloutAccumulator, RolloutResult

ProgressFn = Callable[[int, "int | None"], None]


class Consumer(Protocol):
    def begin_batch(self, grid: tuple[int, int], image_size: tuple[int, int], device: torch.device) -> None: ...
    def __call__(self, layer: int, attn: torch.Tensor) -> None: ...


def _count(images: Any) -> int | None:
    if isinstance(images, torch.Tensor):
        return 1 if images.ndim == 3 else int(images.shape[0])
    if isinstance(images, np.ndarray):
        return 1 if images.ndim < 4 else int(images.shape[0])
    if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
        return len(images)
    if hasattr(images, "size") or isinstance(images, (str,)):
        return 1
    return None


def _progress_fn(progress: bool | ProgressFn | None, total: int | None, desc: str) -> tuple[ProgressFn | None, Any]:
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="img")
        return (lambda done, _total: bar.update(done - bar.n)), bar
    if callable(progress):
        return progress, None
    return None, None


def stream_attention(
    m: LoadedModel,
    images: Any,
    consumers: Sequence[Consumer],
    batch_size: int = 32,
    progress: bool | ProgressFn | None = None,
    on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    desc: str = "vitlens",
    capture_mode: str = "side",
) -> int:
    """Run ``images`` through the model once, batch by batch, streaming every block's attention
    to each consumer; ``on_batch(x, logits)`` sees each batch after its forward. Returns the count.

    The views capture in ``"side"`` mode (the model's fused forward untouched, its logits
    bit-identical; the probabilities recomputed beside it). ``capture_mode="inline"`` runs timm's
    non-fused path instead; on a 2-core CPU it measured no faster (``analyses/bench.py``).
    """
    total = _count(images)
    report, bar = _progress_fn(progress, total, desc)
    done = 0

    def dispatch(layer: int, attn: torch.Tensor) -> None:
        for c in consumers:
            c(layer, attn)

    try:
        with capture_attention(m, store=False, consumers=[dispatch], mode=capture_mode):
            for x in iter_batches(images, m.data_config, batch_size):
                x = x.to(m.device)
                grid = m.grid_for(x.shape[-2:])
                for c in consumers:
                    c.begin_batch(grid, tuple(x.shape[-2:]), m.device)
                logits = m.logits(x)
                if on_batch is not None:
                    on_batch(x, logits)
                done += x.shape[0]
                if report is not None:
                    report(done, total)
    finally:
        if bar is not None:
            bar.close()
    return done


def attention_distance(
    m: LoadedModel,
    images: Any,
    batch_size: int = 32,
    renormalize: bool = True,
    progress: bool | ProgressFn | None = None,
) -> AttentionDistanceResult:
    """Mean attention distance of every head, averaged over images (paper Fig. 7 right, Fig. 11).

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        batch_size: images per forward.
        renormalize: renormalise each query's weights over patch keys (the project's default choice);
            False keeps the raw weights (the keras example's convention).
        progress: True for a progress bar, or a callable ``f(done, total)``.
    """
    s = m.spec
    acc = AttentionDistanceAccumulator(s.num_layers, s.num_heads, s.num_prefix_tokens, s.stride_px, renormalize)
    stream_attention(m, images, [acc], batch_size, progress, desc="attention distance")
    return acc.result(s.name)


def _prediction_collector(m: LoadedModel) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], dict]:
    store: dict[str, list] = {"pred": [], "prob": []}

    def collect(_x: torch.Tensor, logits: torch.Tensor) -> None:
        if m.spec.num_classes > 0 and logits.ndim == 2:
            probs = logits.float().softmax(-1)
            p, i = probs.max(-1)
            store["pred"].append(i.cpu().numpy())
            store["prob"].append(p.cpu().numpy().astype(np.float64))
        else:
            store["pred"].append(np.full(logits.shape[0], -1))
            store["prob"].append(np.full(logits.shape[0], np.nan))

    return collect, store


def _rollout_result(m: LoadedModel, acc: RolloutAccumulator, store: dict) -> RolloutResult:
    preds = np.concatenate(store["pred"]).astype(np.int64)
    names = m.label_names()
    return RolloutResult(
        maps=acc.maps,
        predictions=preds,
        probabilities=np.concatenate(store["prob"]),
        grid=acc.grid,  # type: ignore[arg-type]
        image_size=m.spec.image_size if acc.grid == m.spec.grid else (acc.grid[0] * m.spec.stride_px[0],  # type: ignore[index]
                                                                      acc.grid[1] * m.spec.stride_px[1]),  # type: ignore[index]
        head_fusion=acc.head_fusion,
        discard_ratio=acc.discard_ratio,
        source_token=acc.source_token,
        predicted_labels=[names[i] for i in preds] if names and (preds >= 0).all() else [],
        model_name=m.spec.name,
    )


class _RolloutConsumer(RolloutAccumulator):
    """Rollout accumulator that closes each batch itself when the last block has been seen."""

    def __call__(self, layer: int, attn: torch.Tensor) -> None:
        super().__call__(layer, attn)
        if self._layers_seen == self.num_layers:
            self.end_batch()


def attention_rollout(
    m: LoadedModel,
    images: Any,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    batch_size: int = 32,
    progress: bool | ProgressFn | None = None,
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
    s = m.spec
    acc = _RolloutConsumer(s.num_layers, s.num_prefix_tokens, s.has_class_token, head_fusion, discard_ratio)
    collect, store = _prediction_collector(m)
    stream_attention(m, images, [acc], batch_size, progress, on_batch=collect, desc="rollout")
    return _rollout_result(m, acc, store)


@dataclass(eq=False)
class AnalysisResult(Result):
    """All four views of one model over one image set.

    Attributes:
        spec: the model's spec as a dict.
        filters: embedding-filter PCA (Fig. 7 left).
        position: position-embedding similarity (Fig. 7 centre), or None (see ``position_note``).
        distance: attention distance (Fig. 7 right).
        rollout: rollout maps of every image (Fig. 6).
        position_note: why ``position`` is None, if it is.
    """

    kind = "analysis"
    spec: dict
    filters: FilterPCAResult
    position: PositionSimilarityResult | None
    distance: AttentionDistanceResult
    rollout: RolloutResult
    position_note: str = ""


def analyze(
    m: LoadedModel,
    images: Any,
    batch_size: int = 32,
    n_components: int = 28,
    renormalize: bool = True,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    progress: bool | ProgressFn | None = None,
) -> AnalysisResult:
    """All four views; attention distance and rollout come from ONE forward per batch.

    ``n_components`` is capped at the number the model's filters allow.
    """
    s = m.spec
    dist = AttentionDistanceAccumulator(s.num_layers, s.num_heads, s.num_prefix_tokens, s.stride_px, renormalize)
    roll = _RolloutConsumer(s.num_layers, s.num_prefix_tokens, s.has_class_token, head_fusion, discard_ratio)
    collect, store = _prediction_collector(m)
    stream_attention(m, images, [dist, roll], batch_size, progress, on_batch=collect, desc="analyze")
    try:
        position, note = position_similarity(m), ""
    except ViewNotAvailableError as e:
        position, note = None, str(e)
    if n_components < 1:
        raise InvalidParameterError(f"n_components must be >= 1; got {n_components}.")
    filters = embedding_filter_pca(m, min(n_components, max_filter_components(m)))
    return AnalysisResult(spec=s.to_dict(), filters=filters, position=position, distance=dist.result(s.name),
                          rollout=_rollout_result(m, roll, store), position_note=note)
