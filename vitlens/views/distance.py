"""View 3, paper Fig. 7 (right) and Fig. 11: mean attention distance per head and layer.

For block l, head h and one image: the mean over patch queries q of sum_k A[q, k] * d(q, k),
with d the Euclidean distance between token centres in input pixels (stride-aware: the patch
size of a ViT, the CNN's total stride of a hybrid; rows and columns of non-square grids kept
apart). Only patch tokens are queries and keys. By default (**choice** in the project notes)
the weights over patch keys are renormalised to sum to 1 per query, so a head that parks
attention on the class token does not count as local; ``renormalize=False`` keeps raw weights.

Statistics stream: the accumulator keeps per-head running mean and sum of squared deviations
over images in float64, so memory does not grow with the number of images, and two partial
results over disjoint image sets merge into the result over both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result


@dataclass(eq=False)
class AttentionDistanceResult(Result):
    """Mean attention distance of every head, averaged over images.

    Attributes:
        mean_px: [L, H] mean over images of the per-image attention distance, in input pixels.
        std_px: [L, H] standard deviation over images (population; 0 for one image).
        m2: [L, H] sum of squared deviations over images (kept so results can be merged).
        n_images: images averaged.
        image_size: (H, W) input size in pixels.
        grid: (gh, gw) token grid.
        stride_px: (sy, sx) pixels between neighbouring tokens.
        renormalize: whether weights over patch keys were renormalised per query.
        model_name: the model's name.
    """

    kind = "attention_distance"
    mean_px: np.ndarray
    std_px: np.ndarray
    m2: np.ndarray
    n_images: int
    image_size: tuple[int, int]
    grid: tuple[int, int]
    stride_px: tuple[int, int]
    renormalize: bool
    model_name: str = ""

    @property
    def mean_fraction_of_width(self) -> np.ndarray:
        """``mean_px`` in units of the image width, for comparing models of different input sizes."""
        return self.mean_px / float(self.image_size[1])

    def merge(self, other: "AttentionDistanceResult") -> "AttentionDistanceResult":
        """The result over the images of both (Chan et al.'s parallel mean/variance update)."""
        if (self.mean_px.shape != other.mean_px.shape or self.grid != other.grid
                or self.stride_px != other.stride_px or self.renormalize != other.renormalize):
            raise InvalidParameterError("Only results of the same model, grid and renormalize setting merge.")
        mean, m2, n = merge_moments(self.mean_px, self.m2, self.n_images, other.mean_px, other.m2, other.n_images)
        return AttentionDistanceResult(
            mean_px=mean, std_px=np.sqrt(m2 / max(n, 1)), m2=m2, n_images=n, image_size=self.image_size,
            grid=self.grid, stride_px=self.stride_px, renormalize=self.renormalize, model_name=self.model_name,
        )


def merge_moments(mean_a: np.ndarray, m2_a: np.ndarray, n_a: int,
                  mean_b: np.ndarray, m2_b: np.ndarray, n_b: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Combine (mean, sum of squared deviations, count) of two disjoint samples."""
    n = n_a + n_b
    if n_a == 0:
        return mean_b.copy(), m2_b.copy(), n_b
    if n_b == 0:
        return mean_a.copy(), m2_a.copy(), n_a
    delta = mean_b - mean_a
    return mean_a + delta * (n_b / n), m2_a + m2_b + delta**2 * (n_a * n_b / n), n


def token_distance_matrix(grid: tuple[int, int], stride_px: tuple[int, int],
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, N] Euclidean distances in pixels between patch-token centres, row-major, float64."""
    gh, gw = grid
    rows, cols = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                                indexing="ij")
    y = (rows.reshape(-1) * stride_px[0]).to(device)
    x = (cols.reshape(-1) * stride_px[1]).to(device)
    return torch.sqrt((y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2)


def per_image_distance(attn: torch.Tensor, distances: torch.Tensor, num_prefix_tokens: int,
                       renormalize: bool = True) -> torch.Tensor:
    """Attention distance of each image and head: [B, H, T, T] -> [B, H] float64.

    The sums over keys run in the attention's own dtype as elementwise products reduced with
    pairwise summation (float32: relative error about 1e-7, i.e. 1e-5 px). A batched contraction
    (einsum) is 3x faster here but 20x less accurate, so it is not used. The renormalisation, the
    mean over queries and all accumulation across images run in float64.

    Args:
        attn: attention probabilities of one block.
        distances: [N, N] pixel distances between patch tokens (``token_distance_matrix``).
        num_prefix_tokens: leading non-patch tokens to drop as queries and keys.
        renormalize: renormalise each query's weights over patch keys to sum to 1.
    """
    p = num_prefix_tokens
    a = attn[:, :, p:, p:]
    per_query = (a * distances.to(device=a.device, dtype=a.dtype)).sum(-1).to(torch.float64)
    if renormalize:
        per_query = per_query / a.sum(-1).to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny)
    return per_query.mean(-1)


class AttentionDistanceAccumulator:
    """Streams per-block attention into running per-head statistics (no map is kept)."""

    def __init__(self, num_layers: int, num_heads: int, num_prefix_tokens: int, stride_px: tuple[int, int],
                 renormalize: bool = True) -> None:
        self.num_prefix_tokens = num_prefix_tokens
        self.stride_px = tuple(stride_px)
        self.renormalize = renormalize
        self.mean = np.zeros((num_layers, num_heads))
        self.m2 = np.zeros((num_layers, num_heads))
        self.counts = np.zeros(num_layers, dtype=np.int64)
        self.grid: tuple[int, int] | None = None
        self.image_size: tuple[int, int] | None = None
        self._distances: torch.Tensor | None = None

    def begin_batch(self, grid: tuple[int, int], image_size: tuple[int, int], device: torch.device) -> None:
        if self.grid is not None and grid != self.grid:
            raise InvalidParameterError(
                f"All images of one attention-distance result must share a grid; got {grid} after {self.grid}. "
                "Compute a result per input size.")
        if self._distances is None or self._distances.device != torch.device(device):
            self._distances = token_distance_matrix(grid, self.stride_px, device)
        self.grid, self.image_size = grid, tuple(image_size)

    def __call__(self, layer: int, attn: torch.Tensor) -> None:
        assert self._distances is not None, "begin_batch must be called before the forward"
        n = self._distances.shape[0]
        if attn.shape[-1] != n + self.num_prefix_tokens:
            raise InvalidParameterError(
                f"Block {layer} attends over {attn.shape[-1]} tokens, but {self.num_prefix_tokens} prefix + {n} "
                "patch tokens were expected; the input size does not match the model's grid.")
        d = per_image_distance(attn, self._distances, self.num_prefix_tokens, self.renormalize).cpu().numpy()
        batch_mean = d.mean(axis=0)
        batch_m2 = ((d - batch_mean) ** 2).sum(axis=0)
        self.mean[layer], self.m2[layer], self.counts[layer] = merge_moments(
            self.mean[layer], self.m2[layer], int(self.counts[layer]), batch_mean, batch_m2, d.shape[0])

    def result(self, model_name: str = "") -> AttentionDistanceResult:
        if self.grid is None or self.counts.min() == 0:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        if self.counts.min() != self.counts.max():
            raise RuntimeError("Blocks saw different numbers of images; a forward was interrupted.")
        n = int(self.counts[0])
        return AttentionDistanceResult(
            mean_px=self.mean.copy(), std_px=np.sqrt(self.m2 / n), m2=self.m2.copy(), n_images=n,
            image_size=self.image_size, grid=self.grid, stride_px=self.stride_px,  # type: ignore[arg-type]
            renormalize=self.renormalize, model_name=model_name,
        )
