"""View 4, paper Fig. 6 and Fig. 14: attention rollout (Abnar & Zuidema, 2020).

Per block: fuse heads (mean, or max/min), optionally zero the smallest ``discard_ratio`` of the
fused weights of each image (never the class token's attention to itself), add the residual
path and renormalise rows, A' = (A + I) / rowsum(A + I), then multiply first block first:
R = A'_L ... A'_1. The map is the class token's row of R over patch tokens (for models
without a class token: the mean of the patch tokens' rows), divided by its maximum.

Rollout shows where information was mixed, not what caused the prediction; compare it with
attribution methods before reading it as an explanation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result

HEAD_FUSIONS = ("mean", "max", "min")


@dataclass(eq=False)
class RolloutResult(Result):
    """Rollout maps of a batch of images.

    Attributes:
        maps: [B, gh, gw] rollout over patch tokens, each divided by its maximum.
        predictions: [B] predicted class index (-1 for a model without classifier).
        probabilities: [B] softmax probability of the predicted class (nan without classifier).
        grid: (gh, gw).
        image_size: (H, W) input size.
        head_fusion: "mean", "max" or "min".
        discard_ratio: fraction of fused weights zeroed per image and block.
        source_token: "class token" or "mean over patch tokens".
        predicted_labels: class names of the predictions when known.
        model_name: the model's name.
    """

    kind = "attention_rollout"
    maps: np.ndarray
    predictions: np.ndarray
    probabilities: np.ndarray
    grid: tuple[int, int]
    image_size: tuple[int, int]
    head_fusion: str
    discard_ratio: float
    source_token: str
    predicted_labels: list[str] = field(default_factory=list)
    model_name: str = ""


def check_rollout_params(head_fusion: str, discard_ratio: float) -> None:
    if head_fusion not in HEAD_FUSIONS:
        raise InvalidParameterError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}; got {head_fusion!r}.")
    if not 0.0 <= float(discard_ratio) < 1.0:
        raise InvalidParameterError(f"discard_ratio must be in [0, 1); got {discard_ratio}.")


def fuse_heads(attn: torch.Tensor, head_fusion: str) -> torch.Tensor:
    """[B, H, T, T] -> [B, T, T] float64; fused in the attention's dtype (max/min are exact, the
    mean rounds like the attention itself), everything after it runs in float64."""
    if head_fusion == "mean":
        fused = attn.mean(dim=1)
    elif head_fusion == "max":
        fused = attn.amax(dim=1)
    else:
        fused = attn.amin(dim=1)
    return fused.to(torch.float64)


def discard_smallest(fused: torch.Tensor, discard_ratio: float, protect_class_token: bool) -> torch.Tensor:
    """Zero the smallest ``discard_ratio`` fraction of each image's T*T fused weights.

    The class token's attention to itself (flat index 0) is never zeroed when protected.
    """
    b, t, _ = fused.shape
    k = int(t * t * discard_ratio)
    if k == 0:
        return fused
    flat = fused.reshape(b, t * t).clone()
    ranked = flat.clone()
    if protect_class_token:
        ranked[:, 0] = float("inf")
        k = min(k, t * t - 1)
    idx = ranked.topk(k, dim=-1, largest=False).indices
    flat.scatter_(1, idx, 0.0)
    return flat.reshape(b, t, t)


def residual_normalize(fused: torch.Tensor) -> torch.Tensor:
    """(A + I) / rowsum(A + I), rows summing to 1 for each image."""
    a = fused + torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    return a / a.sum(dim=-1, keepdim=True)


class RolloutAccumulator:
    """Streams per-block attention into the running product A'_l ... A'_1 of each image."""

    def __init__(self, num_layers: int, num_prefix_tokens: int, has_class_token: bool,
                 head_fusion: str = "mean", discard_ratio: float = 0.0) -> None:
        check_rollout_params(head_fusion, discard_ratio)
        self.num_layers = num_layers
        self.num_prefix_tokens = num_prefix_tokens
        self.has_class_token = has_class_token
        self.head_fusion = head_fusion
        self.discard_ratio = float(discard_ratio)
        self._product: torch.Tensor | None = None
        self._layers_seen = 0
        self._maps: list[np.ndarray] = []
        self.grid: tuple[int, int] | None = None

    @property
    def source_token(self) -> str:
        return "class token" if self.has_class_token else "mean over patch tokens"

    def begin_batch(self, grid: tuple[int, int], image_size: tuple[int, int], device: torch.device) -> None:
        self._product, self._layers_seen, self.grid = None, 0, grid

    def __call__(self, layer: int, attn: torch.Tensor) -> None:
        if layer != self._layers_seen:
            raise RuntimeError(f"Rollout expected block {self._layers_seen}, got block {layer}.")
        fused = fuse_heads(attn, self.head_fusion)
        if self.discard_ratio > 0:
            fused = discard_smallest(fused, self.discard_ratio, protect_class_token=self.has_class_token)
        step = residual_normalize(fused)
        self._product = step if self._product is None else step @ self._product
        self._layers_seen += 1

    def end_batch(self) -> np.ndarray:
        """Maps [b, gh, gw] of the batch just run (max-normalised); also kept for ``maps``."""
        if self._product is None or self._layers_seen != self.num_layers or self.grid is None:
            raise RuntimeError("Rollout needs one complete forward per batch.")
        maps = rollout_map(self._product, self.num_prefix_tokens, self.has_class_token, self.grid)
        self._maps.append(maps)
        self._product = None
        return maps

    @property
    def maps(self) -> np.ndarray:
        return np.concatenate(self._maps) if self._maps else np.zeros((0, 0, 0))


def rollout_map(product: torch.Tensor, num_prefix_tokens: int, has_class_token: bool,
                grid: tuple[int, int]) -> np.ndarray:
    """Row of the rolled-out matrix over patch tokens, [B, gh, gw], divided by its maximum."""
    p = num_prefix_tokens
    if has_class_token:
        row = product[:, 0, p:]
    else:
        row = product[:, p:, p:].mean(dim=1)
    row = row / row.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(row.dtype).tiny)
    return row.reshape(row.shape[0], *grid).cpu().numpy()


def rollout_from_maps(maps: list[torch.Tensor], num_prefix_tokens: int, has_class_token: bool,
                      grid: tuple[int, int], head_fusion: str = "mean", discard_ratio: float = 0.0) -> np.ndarray:
    """Rollout of captured maps (list of [B, H, T, T], first block first) -> [B, gh, gw]."""
    acc = RolloutAccumulator(len(maps), num_prefix_tokens, has_class_token, head_fusion, discard_ratio)
    acc.begin_batch(grid, (0, 0), maps[0].device)
    for layer, a in enumerate(maps):
        acc(layer, a)
    return acc.end_batch()
