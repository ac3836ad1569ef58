"""The arithmetic of attention rollout (paper Fig. 6; Abnar & Zuidema 2020; docs/definitions.md, "Attention rollout"):
heads fused (mean, max or min), the smallest fused weights discarded per image and block (never the class token's
attention to itself), A' = (A + I) / rowsum(A + I), the source row rolled out R = A'_L ... A'_1 with the first block
applied first, and the row read on the patch grid. The accumulators (``vitlens.views.rollout``, the windowed and
class-attention ones) call these."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..core.native import rollout_step
from .rollout_store import HALF_SCALE, as_float64


HEAD_FUSIONS = ("mean", "max", "min")

def check_rollout_params(head_fusion: str, discard_ratio: float) -> None:
    if head_fusion not in HEAD_FUSIONS:
        raise InvalidParameterError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}; got {head_fusion!r}.")
    if not 0.0 <= float(discard_ratio) < 1.0:
        raise InvalidParameterError(f"discard_ratio must be in [0, 1); got {discard_ratio}.")

def fused_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``fuse`` returns for maps of ``dtype``: theirs, half precision widened to float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32

def fuse(attn: torch.Tensor, head_fusion: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, T, T] -> [B, T, T] in the attention's dtype (half-precision maps in float32); ``out``: a tensor of
    that shape and dtype to write into (a block of rows of a layer's buffer: no new tensor, no copy)."""
    attn = attn.to(fused_dtype(attn.dtype))
    ops: dict[str, Callable[..., torch.Tensor]] = {"mean": torch.mean, "max": torch.amax, "min": torch.amin}
    op = ops[head_fusion]
    return op(attn, dim=1) if out is None else op(attn, dim=1, out=out)

def discard_smallest(fused: torch.Tensor, discard_ratio: float, protect_class_token: bool,
                     inplace: bool = False) -> torch.Tensor:
    """Zero the smallest ``discard_ratio`` fraction of each image's T*T fused weights.

    The class token's attention to itself (flat index 0) is never zeroed when protected.
    ``inplace``: zero them in ``fused`` itself (contiguous; the rollout consumer's own buffer), so
    no copy of the B x T x T map is made (the ranking still needs ``topk``'s k values and indices).
    """
    b, t, _ = fused.shape
    k = int(t * t * discard_ratio)
    if k == 0:
        return fused
    flat = fused.reshape(b, t * t) if inplace and fused.is_contiguous() else fused.reshape(b, t * t).clone()
    kept = flat[:, 0].clone()
    if protect_class_token:
        flat[:, 0] = float("inf")  # ranked last, restored below
        k = min(k, t * t - 1)
    idx = flat.topk(k, dim=-1, largest=False).indices
    flat.scatter_(1, idx, 0.0)
    if protect_class_token:
        flat[:, 0] = kept
    return flat.reshape(b, t, t)

def source_vector(batch: int, tokens: int, num_prefix_tokens: int, has_class_token: bool,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, T] float64: the class token's indicator, or the mean over the patch tokens."""
    v = torch.zeros(batch, tokens, dtype=torch.float64, device=device)
    if has_class_token:
        v[:, 0] = 1.0
    else:
        v[:, num_prefix_tokens:] = 1.0 / (tokens - num_prefix_tokens)
    return v

def pool_vector(pool: torch.Tensor, tokens: int, head_fusion: str = "mean") -> torch.Tensor:
    """[B, T] float64: an attention pool's probabilities [B, heads, queries, T_pool] fused over heads (as the
    blocks are) and averaged over its queries; a pool that reads the patch tokens only (T_pool < T) gives the
    prefix tokens zero. The class-like row of a model that pools through a MAP head."""
    v = fuse(pool.float(), head_fusion).mean(dim=1).to(torch.float64)
    if v.shape[-1] < tokens:
        v = torch.cat([v.new_zeros(v.shape[0], tokens - v.shape[-1]), v], dim=-1)
    return v

def rollout_row(fused: list[torch.Tensor], num_prefix_tokens: int, has_class_token: bool,
                start: torch.Tensor | None = None) -> torch.Tensor:
    """The source row of R = A'_L ... A'_1, [B, T] float64, from the fused maps of every block
    (``start``: another source vector [B, T], e.g. an attention pool's, ``pool_vector``). A float16 map is one held
    scaled by ``HALF_SCALE`` (``vitlens.views.rollout_store``): its entries are read unscaled, exactly.

    Only one row of R is shown, so it is computed as a vector-matrix chain from the last block
    back: v <- v A'_l for l = L..1, with v A' = w (A + I), w = v / rowsum(A + I). That is T^2
    work per block and image instead of the T^3 of the full product (same numbers, float64).
    """
    b, t = fused[0].shape[0], fused[0].shape[-1]
    v = source_vector(b, t, num_prefix_tokens, has_class_token, fused[0].device) \
        if start is None else start.to(device=fused[0].device, dtype=torch.float64)
    # float64 a block of rows at a time (at most ROLLOUT_ROWS_BYTES), never a float64 copy of a whole map
    step = max(1, ROLLOUT_ROWS_BYTES // (8 * b * t))
    for a in reversed(fused):
        stepped = rollout_step(a, v, 1.0 / HALF_SCALE)  # the native kernel, where it applies: one read of the map
        if stepped is not None:
            v = stepped
            continue
        w = torch.empty_like(v)
        out = torch.zeros_like(v)
        for r0 in range(0, t, step):
            part = as_float64(a[:, r0:r0 + step])  # [B, rows, T]
            w[:, r0:r0 + step] = v[:, r0:r0 + step] / (part.sum(dim=-1) + 1.0)
            out += torch.bmm(w[:, None, r0:r0 + step], part).squeeze(1)
        v = out + w
    return v

#: the float64 rows ``rollout_row`` converts at once (16 MiB)
ROLLOUT_ROWS_BYTES = 16 * 2**20

def row_map(row: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int]) -> np.ndarray:
    """[B, T] rollout row -> [B, gh, gw] over the patch tokens, each divided by its maximum."""
    patch = row[:, num_prefix_tokens:]
    patch = patch / patch.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(patch.dtype).tiny)
    return patch.reshape(patch.shape[0], *grid).cpu().numpy()

def predictions(logits: torch.Tensor | None, batch: int, has_classifier: bool) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class [b] int64, its probability [b] float64) of a batch's logits; -1 and NaN for a model
    without a classifier (or without logits): what a rollout result records beside each map."""
    if has_classifier and logits is not None and logits.ndim == 2 and logits.shape[-1] > 1:
        p, i = logits.float().softmax(-1).max(-1)
        return i.cpu().numpy().astype(np.int64), p.cpu().numpy().astype(np.float64)
    return np.full(batch, -1, dtype=np.int64), np.full(batch, np.nan)

def rollout_map(product: torch.Tensor, num_prefix_tokens: int, has_class_token: bool,
                grid: tuple[int, int]) -> np.ndarray:
    """The source row of a full rolled-out matrix [B, T, T] over patch tokens, [B, gh, gw], max-normalised."""
    row = product[:, 0] if has_class_token else product[:, num_prefix_tokens:].mean(dim=1)
    return row_map(row, num_prefix_tokens, grid)


__all__ = ["HEAD_FUSIONS", "ROLLOUT_ROWS_BYTES", "check_rollout_params", "discard_smallest", "fuse", "fused_dtype",
           "pool_vector", "predictions", "rollout_map", "rollout_row", "row_map", "source_vector"]
