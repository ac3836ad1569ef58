"""Compositions of the library's own pieces that only the tests call: the dense rollout product's step, rollout
of captured maps, and one image's attention distance. They live here, not in vitlens/, because no view
uses them; the tests compare the streaming code against them and against independent computations. Also the
small helpers several test files compare captured maps with (``max_diff``, ``set_attention``)."""
from __future__ import annotations

import numpy as np
import torch

from vitlens.engine.consumer import BatchInfo
from vitlens.views.distance import per_query_distance, token_distance_matrix
from vitlens.views.rollout import RolloutAccumulator


def residual_normalize(fused: torch.Tensor) -> torch.Tensor:
    """(A + I) / rowsum(A + I), rows summing to 1 for each image."""
    a = fused + torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    return a / a.sum(dim=-1, keepdim=True)


def rollout_from_maps(maps: list[torch.Tensor], num_prefix_tokens: int, has_class_token: bool,
                      grid: tuple[int, int], head_fusion: str = "mean", discard_ratio: float = 0.0) -> np.ndarray:
    """Rollout of captured maps (list of [B, H, T, T], first block first) -> [B, gh, gw]."""
    acc = RolloutAccumulator(len(maps), num_prefix_tokens, has_class_token, head_fusion, discard_ratio)
    acc.begin_batch(BatchInfo.of(grid))
    for layer, a in enumerate(maps):
        acc.on_attention(layer, a)
    return acc.end_batch()


def per_image_distance(attn: torch.Tensor, distances: torch.Tensor, num_prefix_tokens: int,
                       renormalize: bool = True) -> torch.Tensor:
    """Attention distance of each image and head: [B, H, T, T] -> [B, H] float64.

    For every patch query, sum_k A[q, k] d(q, k) and sum_k A[q, k] over patch keys
    (``per_query_distance``): relative error within ``FLOAT32_RTOL`` (7.8e-6) of a float64
    computation on any CPU. The renormalisation, the mean over queries and all accumulation across
    images run in float64.

    Args:
        attn: attention probabilities of one block.
        distances: the [N, N] pixel distances between patch tokens (``token_distance_matrix``).
        num_prefix_tokens: leading non-patch tokens to drop as queries and keys.
        renormalize: renormalise each query's weights over patch keys to sum to 1.
    """
    p = num_prefix_tokens
    return per_query_distance(attn[:, :, p:], distances, p, renormalize).mean(0)


def mean_distance(maps: list[torch.Tensor], grid: tuple[int, int], stride_px: tuple[int, int],
                  num_prefix_tokens: int) -> np.ndarray:
    """The attention distance view's ``mean_px`` [L, H] from stored maps (list of [B, H, T, T]): each image's
    distance (``per_image_distance``, renormalised over patch keys) averaged over the images."""
    distances = token_distance_matrix(grid, stride_px)
    return np.stack([per_image_distance(a.double(), distances, num_prefix_tokens).mean(0).numpy() for a in maps])


def max_diff(maps: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest absolute difference between two lists of maps of the same shapes (asserted)."""
    assert len(maps) == len(ref) > 0
    assert all(a.shape == r.shape for a, r in zip(maps, ref))
    return max((a - r).abs().max().item() for a, r in zip(maps, ref))


def set_attention(model: torch.nn.Module, implementation: str) -> torch.nn.Module:
    """A transformers model switched to another attention implementation ("eager", "sdpa", ...), every config."""
    for mod in model.modules():
        if getattr(mod, "config", None) is not None:
            mod.config._attn_implementation = implementation
    return model


def random_sdpa_masks(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    """A boolean mask (True = attend, the diagonal always kept) and an additive one (-inf where the boolean is
    False), [B, 1, T, T], drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(b, 1, t, t, generator=g) > 0.4) | torch.eye(t, dtype=torch.bool)
    additive = torch.randn(b, 1, t, t, generator=g) * 2
    additive[~keep] = float("-inf")
    return {"bool": keep, "additive": additive}


def layer_recorder():
    """An attention consumer that records the layer of every map it is given (``.layers``), to see which blocks a
    view read."""
    from vitlens.engine import AttentionConsumer

    class LayerRecorder(AttentionConsumer):
        def __init__(self) -> None:
            self.layers: list[int] = []

        def on_attention(self, layer, attn, rows=None):
            self.layers.append(layer)

    return LayerRecorder()


def forward_with_feeds(m: object, modules: list[torch.nn.Module], x: torch.Tensor, mode: str) -> tuple:
    """One forward of ``m.model`` plain and one under ``vl.capture_attention(m, mode=mode)``: (plain output, output
    under capture, the captured maps, what each of ``modules`` was fed in the captured forward) — the inputs the
    capture tests recompute each block's own attention from."""
    from vitlens.engine.capture import capture_attention

    feeds: list[torch.Tensor] = []
    hooks = [a.register_forward_pre_hook(lambda _m, args: feeds.append(args[0])) for a in modules]
    try:
        with torch.no_grad():
            plain = m.model(x)
            feeds.clear()
            with capture_attention(m, mode=mode) as cap:
                out = m.model(x)
    finally:
        for h in hooks:
            h.remove()
    return plain, out, cap.maps, feeds
