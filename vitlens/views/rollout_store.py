"""Where rollout (Fig. 6) keeps its per-block head-fused maps until the batch's last block, and in what precision.

The chain runs from the last block back, so every block's map of an image is held until its last block: L - 1
maps of T x T an image (11 x 4097^2 at 1024 px on a ViT-B: 0.74 GB in float32). Two things here:

- **One store, made once.** The maps of a batch live in one [kept, B, T, T] tensor that the accumulator keeps for
  its next batch (the sub-batches the plan cuts a large batch into reuse it): memory touched for the first time once
  per call, not once per block and sub-batch. A mean-fused map in float16 storage is written into its slot by the
  native softmax pass, row by row (``vitlens.core.native.SoftmaxTaps.half_mean``: the float32 mean of the heads in
  the thread's own row, times ``HALF_SCALE``, rounded to nearest even: ``store_half``'s numbers to the bit), one
  pass in all; otherwise (the eager code, max/min fusion, ``discard_ratio`` > 0, which ranks the float32 map) it is
  made in one float32 [B, T, T] buffer reused by every block, then scaled in place and copied into the slot
  (``store_half``: two more passes over the float32 map).
- **Half the bytes when large** (``precision``): "float32" keeps the maps as they are made; "float16" stores each
  entry a times ``HALF_SCALE`` = 2^15 rounded to float16 (the entries are probabilities, means or extrema of them,
  in [0, 1]: the scaled ones stay below float16's largest, 65,504, for a <= 1.99, and entries down to 2^-29 stay in
  its normal range); "auto" (the default) is float16 where one image's float32 maps would exceed ``HALF_ABOVE_MB``,
  float32 below it (every small image bit-identical to float32 storage). The chain itself stays float64.

The bound (docs/definitions.md, under rollout), for the map a stored as â (rounding to nearest; u = 2^-11,
float16's unit roundoff; δ = 2^-40, half float16's smallest subnormal spacing 2^-24 divided by the scale):

- per entry: |â - a| <= u a + δ (relative in float16's normal range, a >= 2^-29; absolute below it, and 0 stays 0);
- the chain's row v (non-negative, summing to 1; every step's A' = (A + I) / rowsum(A + I) is row-stochastic), over
  the S stored maps: ||v̂ - v||_1 <= 2 S (u + T δ) (each step adds at most 2 max_r ||x̂_r - x_r||_1 / ||x_r||_1 for
  x_r = A_r + e_r, ||x_r||_1 = rowsum + 1 >= 1); ``half_bound``;
- where every stored entry is 0 or in the normal range: entrywise |v̂_k - v_k| <= ((1 + u)/(1 - u))^S - 1) v_k
  (every term of a step is a non-negative product of entries each within a factor (1 +- u), the row sums too);
  for a ViT-B (S = 11) 1.08%.

float16 scaled rather than bfloat16: bfloat16's unit roundoff is 2^-8, eight times float16's, for a range the
scaled probabilities do not need.
"""
from __future__ import annotations

import torch

from ..core.pages import large_empty
from ..errors import InvalidParameterError

#: how rollout holds its maps: "auto" (float16 where large), "float32", "float16"
ROLLOUT_PRECISIONS = ("auto", "float32", "float16")

HALF_SCALE = 2.0 ** 15
"""A stored float16 entry is the map's entry times this (a power of two: scaling and unscaling are exact)."""

HALF_UNIT = 2.0 ** -11
"""float16's unit roundoff: the relative error of rounding to nearest in its normal range."""

HALF_ABS = 2.0 ** -40
"""The absolute error of an entry below float16's normal range after scaling: half its subnormal spacing (2^-24),
divided by ``HALF_SCALE``."""

HALF_ABOVE_MB = 256.0
"""``auto``: float16 where one image's float32 maps would exceed this many MB (1024 px on a ViT-B: 704 MiB;
768 px: 223 MiB, float32)."""


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``ROLLOUT_PRECISIONS``, else a one-line error."""
    if precision not in ROLLOUT_PRECISIONS:
        raise InvalidParameterError(f"rollout precision must be one of {', '.join(ROLLOUT_PRECISIONS)}; got "
                                    f"{precision!r}.")
    return precision


def storage_for(precision: str, kept: int, tokens: int) -> str:
    """"float32" or "float16": how ``kept`` maps of ``tokens`` x ``tokens`` an image are held (the rule above)."""
    if precision != "auto":
        return precision
    return "float16" if 4.0 * kept * tokens * tokens > HALF_ABOVE_MB * 2**20 else "float32"


def half_bound(stored: int, tokens: int) -> tuple[float, float]:
    """(the bound on ||v̂ - v||_1 of the rolled-out row, which sums to 1; the entrywise relative bound where every
    stored entry is 0 or at least 2^-29) for ``stored`` maps of ``tokens`` tokens held in float16 (module docstring)."""
    u = HALF_UNIT
    return 2.0 * stored * (u + tokens * HALF_ABS), ((1 + u) / (1 - u)) ** stored - 1.0


def store_half(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (float16) = ``src`` (float32, the accumulator's own buffer, scaled in place) times ``HALF_SCALE``,
    rounded to nearest."""
    src.mul_(HALF_SCALE)
    out.copy_(src)


def as_float64(stored: torch.Tensor) -> torch.Tensor:
    """Stored map entries in float64, unscaled (float16 maps are always ``HALF_SCALE`` times the map)."""
    out = stored.to(torch.float64)
    return out.mul_(1.0 / HALF_SCALE) if stored.dtype == torch.float16 else out


class MapStore:
    """One batch's kept maps, [kept, B, T, T] in the storage's dtype, made once and reused by the batches after
    (while their shape fits), and the float32 buffer a float16 map is made in where the softmax pass does not write
    its slot."""

    def __init__(self) -> None:
        self._maps: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None

    @staticmethod
    def _fits(t: torch.Tensor | None, shape: tuple[int, ...], batch_axis: int, dtype: torch.dtype,
              device: torch.device) -> bool:
        """Whether ``t`` holds ``shape`` (at least as many images on ``batch_axis``) in that dtype on that device."""
        if t is None or t.dtype != dtype or t.device != torch.device(device) or t.dim() != len(shape):
            return False
        pairs = enumerate(zip(t.shape, shape))
        return all(have >= want if i == batch_axis else have == want for i, (have, want) in pairs)

    def slot(self, index: int, kept: int, batch: int, tokens: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """Map ``index``'s place, [batch, T, T] (contiguous), in a store of ``kept`` maps."""
        if not self._fits(self._maps, (kept, batch, tokens, tokens), 1, dtype, device):
            self._maps = None  # the old store goes before the new one is made
            self._maps = large_empty(kept, batch, tokens, tokens, dtype=dtype, device=device)
        return self._maps[index, :batch]  # type: ignore[index]  # made just above when it did not fit

    def buffer(self, batch: int, tokens: int, device: torch.device) -> torch.Tensor:
        """The float32 [batch, T, T] buffer a map is made in before it is stored in float16."""
        if not self._fits(self._buffer, (batch, tokens, tokens), 0, torch.float32, device):
            self._buffer = None
            self._buffer = large_empty(batch, tokens, tokens, dtype=torch.float32, device=device)
        return self._buffer[:batch]  # type: ignore[index]  # made just above when it did not fit

    def release(self) -> None:
        """Let the memory go (the accumulator's result is made; nothing is streamed after)."""
        self._maps, self._buffer = None, None


__all__ = ["HALF_ABOVE_MB", "HALF_ABS", "HALF_SCALE", "HALF_UNIT", "MapStore", "ROLLOUT_PRECISIONS", "as_float64",
           "check_precision", "half_bound", "storage_for", "store_half"]
