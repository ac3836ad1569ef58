"""View 3, paper Fig. 7 (right) and Fig. 11: mean attention distance per head and layer.

For block l, head h and one image: the mean over patch queries q of sum_k A[q, k] * d(q, k),
with d the Euclidean distance between token centres in input pixels (stride-aware: the patch
size of a ViT, the CNN's total stride of a hybrid; rows and columns of non-square grids kept
apart). Only patch tokens are queries and keys. By default (a **choice**, docs/definitions.md)
the weights over patch keys are renormalised to sum to 1 per query, so a head that parks
attention on the class token does not count as local; ``renormalize=False`` keeps raw weights.

Statistics stream: the accumulator keeps per-head running mean and sum of squared deviations
over images in float64, so memory does not grow with the number of images, and two partial
results over disjoint image sets merge into the result over both.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from ..core.attention import session_tensor
from ..errors import InvalidParameterError
from ..core.spec import ModelSpec
from ..results import Result
from ..engine.consumer import AttentionConsumer, BatchInfo, query_rows
from ..engine.stream import model_name
from ..core.native import SoftmaxTaps, compiled_wanted, key_block_sums
from ..words import counted
from .moments import ClassMoments, add_samples, merge_moment_rows, merge_moments  # noqa: F401  (importable here)


#: THE definition of a local head (Fig. 7 right, Fig. 11), used by every view, reading and report: a head is
#: local when its mean attention distance is at most this multiple of the distance of uniform attention on
#: its grid. Grid-relative, so it reads an 8x8 grid of 64 px (where uniform attention is half the width) as
#: it reads a 14x14 one; the model card's and the locality sweep's criterion.
LOCAL_OF_UNIFORM = 0.6


def local_rule(multiple: float = LOCAL_OF_UNIFORM) -> str:
    """The definition of a local head in words, as every page states it (``LOCAL_OF_UNIFORM``)."""
    return f"at most {multiple:g}x the uniform-attention distance"


@dataclass(eq=False, repr=False)
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

    def summary(self) -> str:
        layers, heads = self.mean_px.shape
        return (f"{self.model_name or 'model'}: {layers} layers x {heads} heads over "
                f"{counted(self.n_images, 'image')}, "
                f"{self.mean_px.min():.1f}-{self.mean_px.max():.1f} px (uniform "
                f"{uniform_distance(self.grid, self.stride_px):.1f} px), "
                f"{'renormalised' if self.renormalize else 'raw weights'}")

    def to_rows(self) -> list[dict]:
        """One row per (layer, head), both 1-based: mean and std over images, in pixels."""
        return [{"layer": layer + 1, "head": head + 1, "mean_px": float(self.mean_px[layer, head]),
                 "std_px": float(self.std_px[layer, head]), "n_images": self.n_images}
                for layer in range(self.mean_px.shape[0]) for head in range(self.mean_px.shape[1])]

    @property
    def uniform_px(self) -> float:
        """The distance of uniform attention on this grid (the figure's dotted line)."""
        return uniform_distance(self.grid, self.stride_px)

    @property
    def of_uniform(self) -> np.ndarray:
        """[L, H] each head's distance as a multiple of ``uniform_px`` (1.0: as far as uniform attention)."""
        return self.mean_px / self.uniform_px

    def local_heads(self, multiple: float = LOCAL_OF_UNIFORM) -> np.ndarray:
        """[L, H] booleans: which heads are local (mean distance at most ``multiple`` x ``uniform_px``,
        the one rule of ``LOCAL_OF_UNIFORM``)."""
        return self.mean_px <= multiple * self.uniform_px

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
        return AttentionDistanceResult.from_moments(mean, m2, n, self.image_size, self.grid, self.stride_px,
                                                    self.renormalize, self.model_name)

    @classmethod
    def from_moments(cls, mean_px: np.ndarray, m2: np.ndarray, n_images: int, image_size: tuple[int, int],
                     grid: tuple[int, int], stride_px: tuple[int, int], renormalize: bool = True,
                     model_name: str = "") -> "AttentionDistanceResult":
        """The result of running moments over ``n_images`` images (mean and sum of squared deviations
        per head): the one way a result is built, by the accumulator, ``merge`` and a survey."""
        size, g, stride = (tuple(int(v) for v in t) for t in (image_size, grid, stride_px))
        return cls(mean_px=np.asarray(mean_px, dtype=np.float64), std_px=np.sqrt(np.asarray(m2) / max(n_images, 1)),
                   # the ignore below: pairs (set by begin_batch / from the state), typed as loose tuples
                   m2=np.asarray(m2, dtype=np.float64), n_images=int(n_images), image_size=size,  # type: ignore[arg-type]
                   # the ignore below: pairs (set by begin_batch / from the state), typed as loose tuples
                   grid=g, stride_px=stride, renormalize=bool(renormalize), model_name=model_name)  # type: ignore[arg-type]


def uniform_distance(grid: tuple[int, int], stride_px: tuple[int, int]) -> float:
    """What every head would show if it attended uniformly over patch tokens, in pixels (the
    mean distance between two token centres, self-pairs included; 116.5 px on 14x14 of 16 px)."""
    return float(token_distance_matrix(grid, stride_px).mean())


def token_distance_matrix(grid: tuple[int, int], stride_px: tuple[int, int],
                          device: torch.device | str = "cpu", queries: slice | None = None) -> torch.Tensor:
    """[N, N] Euclidean distances in pixels between patch-token centres, row-major, float64
    (``queries``: only those rows, [q, N], so a block of queries never needs the whole matrix)."""
    gh, gw = grid
    rows, cols = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                                indexing="ij")
    y = (rows.reshape(-1) * stride_px[0]).to(device)
    x = (cols.reshape(-1) * stride_px[1]).to(device)
    qy, qx = (y, x) if queries is None else (y[queries], x[queries])
    return torch.sqrt((qy[:, None] - y[None, :]) ** 2 + (qx[:, None] - x[None, :]) ** 2)


@functools.lru_cache(maxsize=2)
def whole_distances(grid: tuple[int, int], stride_px: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``token_distance_matrix`` of a whole grid in float32, made once for the last two grids a process asked for
    (a stream of batches, and call after call at one size, share it; it is only ever read). Built one grid row of
    queries at a time from the squared row and column offsets, each entry the same float64 numbers as
    ``token_distance_matrix``'s (the offsets of whole multiples of the stride are exact) rounded once: the first call
    touches the [N, N] float32 matrix alone, never float64 temporaries of its size (1024 px: 67 MB, not 0.7 GB of
    fresh memory)."""
    gh, gw = grid
    ys = torch.arange(gh, dtype=torch.float64, device=device) * stride_px[0]
    xs = torch.arange(gw, dtype=torch.float64, device=device) * stride_px[1]
    dy2, dx2 = (ys[:, None] - ys[None, :]) ** 2, (xs[:, None] - xs[None, :]) ** 2  # [gh, gh], [gw, gw]
    out = torch.empty(gh, gw, gh, gw, dtype=torch.float32, device=device)
    step = max(1, DISTANCE_ROWS_BYTES // (8 * gw * gh * gw))
    for i in range(0, gh, step):  # queries of grid rows [i, i + step): [rows, gw, gh, gw]
        out[i:i + step] = torch.sqrt(dx2[None, :, None, :] + dy2[i:i + step, None, :, None])
    return out.reshape(gh * gw, gh * gw)


#: the float64 entries ``whole_distances`` makes at once (16 MiB: a few grid rows of queries)
DISTANCE_ROWS_BYTES = 16 * 2**20


#: the accumulator keeps a grid's whole float32 patch-distance matrix [N, N] up to this many bytes (1024 px:
#: 67 MB), and builds each block's rows as they come above it
WHOLE_DISTANCES_BYTES = 128 * 2**20


KEY_BLOCK = 64
"""Keys per float32 partial sum of the bound below (the partial sums are added in float64)."""

SCRATCH_BYTES = 8 * 2**20
"""Float32 products ``per_query_distance`` makes at once (a few queries' worth, cache-sized: 8 MiB)."""

FLOAT32_RTOL = (2 * KEY_BLOCK + 3) * 2.0 ** -24
"""Bound on the relative error of one image's attention distance against float64 (7.8e-6).

Derived, not observed, so it holds for any BLAS, any vector width and any summation order: each
query's two sums over patch keys (distance-weighted, and the patch-key mass) are float32 sums over
blocks of at most ``KEY_BLOCK`` keys of non-negative terms; with u = 2^-24, a product A[q, k] * d(q, k)
rounds once (u), the distance itself was rounded to float32 (u), and a block's sum of at most
``KEY_BLOCK`` terms carries a relative error of at most ``(KEY_BLOCK - 1) * u`` in any order: so at most
``(KEY_BLOCK + 1) * u`` for the weighted sum and ``(KEY_BLOCK - 1) * u`` for the mass. Block sums, the
ratio of the two and the mean over queries run in float64, so the per-query ratio is within
``(2 * KEY_BLOCK + 3) * u`` (to first order, with room for the float64 steps) and so is their mean (all
terms positive). The standard deviation over images is then within ``FLOAT32_RTOL * max(mean_px)`` in
pixels (it moves by at most the largest change of one image's value), which is the precision to read
it at: the spread of per-image means can be far smaller than the means themselves. Float64 attention
is summed in float64 throughout (tighter still).
"""


def per_query_distance(attn: torch.Tensor, distances: torch.Tensor, num_prefix_tokens: int,
                       renormalize: bool = True, workspace: dict | None = None) -> torch.Tensor:
    """Each patch query's attention distance: [B, H, q, T] patch-query rows -> [q, B, H] float64.

    ``distances`` are the [q, N] pixel distances of the same queries to the N patch keys
    (``token_distance_matrix`` rows). The products A[q, k] * d(q, k) are made in the attention's
    float32 a few queries at a time (``SCRATCH_BYTES``, one reused buffer: no large temporary), summed
    over blocks of ``KEY_BLOCK`` keys in float32 and the block sums added in float64 (the derivation of
    ``FLOAT32_RTOL``). Float64 attention is summed in float64; half precision is widened to float32.
    ``workspace``: a dict kept by the caller (the accumulator) where that buffer stays from call to call.
    Large float32 maps on the CPU go through the native kernel instead (``vitlens.core.native.key_block_sums``,
    where ``compiled_wanted`` says so: one pass over the maps, the same key-block sums, so the same bound).
    """
    p = num_prefix_tokens
    if attn.dtype not in (torch.float32, torch.float64):  # half-precision maps (inline capture under autocast)
        attn = attn.float()
    b, h, q, t = attn.shape
    n = t - p
    if distances.shape != (q, n):
        raise InvalidParameterError(f"Distances of shape {tuple(distances.shape)} do not fit {q} queries over "
                                    f"{n} patch keys.")
    rows = attn.reshape(b * h, q, t)[..., p:]  # [BH, q, N]: prefix keys weigh 0
    d = distances.to(device=attn.device, dtype=attn.dtype)
    sums = torch.empty(2, b * h, q, dtype=torch.float64, device=attn.device)
    if key_block_sums(rows, d, KEY_BLOCK, sums):  # the native kernel, where it applies: one read of each probability
        return distance_from_sums(sums, renormalize, q, b, h)
    step = max(1, min(q, SCRATCH_BYTES // (attn.element_size() * b * h * max(n, 1))))
    # in the workspace: a fresh buffer's pages cost as much as the products at 224 px
    scratch = session_tensor(workspace, "products", (b * h, step, n), attn.dtype, attn.device)
    for q0 in range(0, q, step):
        s = min(step, q - q0)
        block = rows[:, q0:q0 + s]
        sum_by_key_blocks(torch.mul(block, d[q0:q0 + s], out=scratch[:, :s]), sums[0, :, q0:q0 + s])
        sum_by_key_blocks(block, sums[1, :, q0:q0 + s])
    return distance_from_sums(sums, renormalize, q, b, h)


def distance_from_sums(sums: torch.Tensor, renormalize: bool, q: int, b: int, h: int) -> torch.Tensor:
    """Each query's attention distance from its two key-block sums: [2, BH, q] (distance-weighted, patch-key mass;
    what ``per_query_distance`` and the native softmax pass, ``core.native.softmax_taps``, make) -> [q, B, H]
    float64, the weighted sum divided by the mass (``renormalize``) or as it is.

    Args:
        sums: [2, B * H, q] float64 sums.
        renormalize: divide by the patch-key mass (the default definition).
        q: queries.
        b: images.
        h: heads.

    Returns:
        [q, B, H] float64 per-query distances in pixels.
    """
    per_query = sums[0]
    if renormalize:
        per_query = per_query / sums[1].clamp_min(torch.finfo(torch.float64).tiny)
    return per_query.transpose(0, 1).reshape(q, b, h)


def sum_by_key_blocks(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [...] (float64) = sums over the last axis of ``x`` [..., N]: in ``x``'s dtype over blocks
    of ``KEY_BLOCK`` keys, the block sums (and a shorter last block) added in float64 (``FLOAT32_RTOL``'s rule;
    the windowed distance's too, ``vitlens.views.windowed``)."""
    n = x.shape[-1]
    whole = n - n % KEY_BLOCK
    if whole:
        out.copy_(x[..., :whole].unflatten(-1, (whole // KEY_BLOCK, KEY_BLOCK)).sum(-1).sum(-1, dtype=torch.float64))
    else:
        out.zero_()
    if whole < n:
        out += x[..., whole:].sum(-1, dtype=torch.float64)


class AttentionDistanceAccumulator(AttentionConsumer):
    """Streams per-block attention into running per-head statistics (no map is kept).

    A consumer of the streaming engine (``vitlens.engine``); partial accumulators over
    disjoint image sets merge. After ``per_class``, it keeps the same moments per class of the images
    (``BatchInfo.labels``) too: its ``state()`` is what a survey keeps of the view per image shard, and
    ``table_rows`` the survey table's rows of it.
    """

    def __init__(self, num_layers: int, num_heads: int, num_prefix_tokens: int, stride_px: tuple[int, int],
                 renormalize: bool = True) -> None:
        self.num_prefix_tokens = num_prefix_tokens
        self.stride_px = (int(stride_px[0]), int(stride_px[1]))
        self.renormalize = renormalize
        self.mean = np.zeros((num_layers, num_heads))
        self.m2 = np.zeros((num_layers, num_heads))
        self.counts = np.zeros(num_layers, dtype=np.int64)
        self.classes = ClassMoments(0, (num_layers,), (num_heads,))
        self._labels: np.ndarray | None = None
        self.grid: tuple[int, int] | None = None
        self.image_size: tuple[int, int] | None = None
        self._distances: torch.Tensor | None = None  # the grid's whole float32 distance matrix, when small
        self._device = torch.device("cpu")
        self._queries: dict[int, list[torch.Tensor]] = {}  # layer -> per-query distances of a layer in flight
        self._workspace: dict = {}  # the products' buffer, kept from block to block
        self._tap: tuple[int, int, SoftmaxTaps] | None = None  # (layer, first row, sums) asked of the next block

    @classmethod
    def for_model(cls, spec: "ModelSpec | Any", renormalize: bool = True) -> "AttentionDistanceAccumulator":
        """The accumulator for a model: its ``ModelSpec``, or the ``LoadedModel`` (as the other kinds' take)."""
        spec = getattr(spec, "spec", spec)
        return cls(spec.num_layers, spec.num_heads, spec.num_prefix_tokens, spec.stride_px, renormalize)

    def per_class(self, num_classes: int) -> "AttentionDistanceAccumulator":
        """Keep the moments per class of the images too (labels 0 .. ``num_classes`` - 1; before any image): what a
        survey keeps (``View.survey``). Returns the accumulator."""
        self.classes = ClassMoments(num_classes, self.mean.shape[:1], self.mean.shape[1:])
        return self

    def __getstate__(self) -> dict:
        # the distance matrix is rebuilt where it is needed; a layer in flight does not travel
        return {**self.__dict__, "_distances": None, "_queries": {}, "_workspace": {}, "_tap": None}

    def begin_batch(self, batch: BatchInfo) -> None:
        grid, image_size, device = batch.grid, batch.input_size, batch.device
        grid = (int(grid[0]), int(grid[1]))
        if self.grid is not None and grid != self.grid:
            raise InvalidParameterError(
                f"All images of one attention-distance result must share a grid; got {grid} after {self.grid}. "
                "Compute a result per input size.")
        device = torch.device(device or "cpu")
        self._labels = batch.labels
        n = grid[0] * grid[1]
        whole = n * n * 4 <= WHOLE_DISTANCES_BYTES
        if whole and (self._distances is None or self._distances.device != device or self.grid != grid):
            self._distances = whole_distances(grid, self.stride_px, device)
        elif not whole:
            self._distances = None  # each block's rows are built as they come (``_distance_rows``)
        self._device = device
        self.grid = grid
        self.image_size = (int(image_size[0]), int(image_size[1])) if image_size and min(image_size) > 0 else \
            (grid[0] * self.stride_px[0], grid[1] * self.stride_px[1])

    def _distance_rows(self, queries: slice) -> torch.Tensor:
        """Pixel distances [q, N] of the patch queries ``queries`` (0 = the first patch token) to every
        patch key, float32 (rounded from float64, as ``FLOAT32_RTOL`` counts)."""
        if self._distances is not None:
            return self._distances[queries]
        # the ignore below: pairs (set by begin_batch / from the state), typed as loose tuples
        return token_distance_matrix(self.grid, self.stride_px, self._device, queries=queries).float()  # type: ignore[arg-type]

    def _check(self, layer: int, attn: torch.Tensor) -> None:
        if self.grid is None:
            raise RuntimeError("begin_batch must be called before the forward")
        n = self.grid[0] * self.grid[1]
        if attn.shape[-1] != n + self.num_prefix_tokens:
            raise InvalidParameterError(
                f"Block {layer} attends over {attn.shape[-1]} tokens, but {self.num_prefix_tokens} prefix + {n} "
                "patch tokens were expected; the input size does not match the model's grid.")

    def add(self, layer: int, d: np.ndarray) -> None:
        """Fold per-image distances [B, H] of block ``layer`` into the running statistics."""
        self.mean[layer], self.m2[layer], self.counts[layer] = add_samples(
            self.mean[layer], self.m2[layer], int(self.counts[layer]), d)

    def softmax_tap(self, layer: int, rows: slice, shape: tuple) -> SoftmaxTaps | None:
        """The block's per-query sums (distance-weighted, patch-key mass) from its softmax pass (float32 attention:
        the same key-block rule, so the same ``FLOAT32_RTOL`` bound); ``layer_values`` reads them when filled."""
        b, h, r, t = shape
        p = self.num_prefix_tokens
        start, stop = int(rows.start or 0), int(rows.stop)
        q0 = max(start, p)
        if (self.grid is None or t != self.grid[0] * self.grid[1] + p or q0 >= stop
                or not compiled_wanted(self._device, t)):  # no kernel to fill it
            return None
        tap = SoftmaxTaps(distances=self._distance_rows(slice(q0 - p, stop - p)).contiguous(), first=q0 - start,
                          prefix=p, key_block=KEY_BLOCK,
                          sums=torch.empty(2, b * h, stop - q0, dtype=torch.float64, device=self._device))
        self._tap = (layer, start, tap)
        return tap

    def layer_values(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> np.ndarray | None:
        """Whole maps or blocks of query rows of block ``layer``: each patch query's distance is kept
        until the layer's last block, which returns the per-image distances [B, H] (None before
        it); the same numbers however the rows were split."""
        self._check(layer, attn)
        start, stop, last = query_rows(attn, rows)
        p = self.num_prefix_tokens
        q0 = max(start, p)
        tap, self._tap = self._tap, None
        if q0 < stop:
            if tap is not None and tap[:2] == (layer, start) and tap[2].filled:  # the softmax pass made the sums
                b, h = attn.shape[:2]
                # a filled tap asked for the sums (the tap this consumer made holds them)
                values = distance_from_sums(cast(torch.Tensor, tap[2].sums), self.renormalize, stop - q0, b, h)
            else:
                values = per_query_distance(attn[:, :, q0 - start:], self._distance_rows(slice(q0 - p, stop - p)), p,
                                            self.renormalize, self._workspace)
            self._queries.setdefault(layer, []).append(values)
        if not last:
            return None
        return torch.cat(self._queries.pop(layer, [])).mean(0).cpu().numpy()

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        d = self.layer_values(layer, attn, rows)
        if d is not None:
            self.add(layer, d)
            self.classes.add(self._labels, d, (layer,))

    def merge(self, other: "AttentionDistanceAccumulator") -> "AttentionDistanceAccumulator":
        """The accumulator over the images of both (Chan et al.'s parallel update, per head)."""
        if (self.mean.shape != other.mean.shape or self.stride_px != other.stride_px
                or self.renormalize != other.renormalize or self.num_prefix_tokens != other.num_prefix_tokens
                or (self.grid is not None and other.grid is not None and self.grid != other.grid)):
            raise InvalidParameterError("Only accumulators of the same model, grid and renormalize setting merge.")
        out = AttentionDistanceAccumulator(self.mean.shape[0], self.mean.shape[1], self.num_prefix_tokens,
                                           self.stride_px, self.renormalize)
        out.mean, out.m2, out.counts = merge_moment_rows(self.mean, self.m2, self.counts, other.mean, other.m2,
                                                         other.counts)
        out.classes = self.classes.merge(other.classes)
        out.grid = self.grid or other.grid
        out.image_size = self.image_size or other.image_size
        return out

    def state(self) -> dict[str, np.ndarray]:
        """The running moments as arrays: mean, m2, counts, grid and image_size ((0, 0) before any image), and the
        per-class moments (``ClassMoments``: [C, L, H], C = 0 without classes)."""
        return {"mean": self.mean, "m2": self.m2, "counts": self.counts, "grid": np.asarray(self.grid or (0, 0)),
                "image_size": np.asarray(self.image_size or (0, 0)), **self.classes.state()}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], stride_px: tuple[int, int] = (0, 0), num_prefix_tokens: int = 0,
                   renormalize: bool = True) -> "AttentionDistanceAccumulator":
        """The accumulator of a ``state()``; the model's stride, prefix and renormalize setting are not
        in the state: pass them where its result is made (they only label it)."""
        mean = np.asarray(state["mean"], dtype=np.float64)
        out = cls(mean.shape[0], mean.shape[1], num_prefix_tokens, stride_px, renormalize)
        out.mean, out.m2, out.counts = mean, np.asarray(state["m2"], dtype=np.float64), np.asarray(state["counts"])
        out.classes = ClassMoments.from_state(state, mean.shape[:1], mean.shape[1:])
        grid, size = (tuple(int(v) for v in np.asarray(state[k])) for k in ("grid", "image_size"))
        out.grid = grid if any(grid) else None  # type: ignore[assignment]  # None: a state saved before any image
        out.image_size = size if any(size) else None  # type: ignore[assignment]  # None: a state saved before any image
        return out

    def result(self, spec: ModelSpec | str = "") -> AttentionDistanceResult:
        if self.grid is None or self.counts.min() == 0:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        if self.counts.min() != self.counts.max():
            raise RuntimeError("Blocks saw different numbers of images; a forward was interrupted.")
        return AttentionDistanceResult.from_moments(
            # the ignore below: pairs (set by begin_batch / from the state), typed as loose tuples
            self.mean.copy(), self.m2.copy(), int(self.counts[0]), image_size=self.image_size,  # type: ignore[arg-type]
            grid=self.grid, stride_px=self.stride_px, renormalize=self.renormalize, model_name=model_name(spec))

    def table_rows(self, spec: dict, classes: list[str], renormalize: bool = True) -> list[dict]:
        """The survey table's rows of it (``metric``, ``value``, ``n``, ``layer``, ``head``, ``cls``): uniform
        distance, per head mean / std in pixels and mean in image widths, and per class.

        Args:
            spec: the model's ``ModelSpec.to_dict()`` (its stride labels the pixels).
            classes: the image set's class names (``classes[c]`` names label c).
            renormalize: the setting the survey ran with.
        """
        if not self.counts.size or int(self.counts.min()) == 0:
            return []
        acc = AttentionDistanceAccumulator.from_state(self.state(), tuple(spec["stride_px"]),
                                                      int(spec.get("num_prefix_tokens", 0)), renormalize)
        d = acc.result()
        n, width = d.n_images, float(d.image_size[1])
        rows: list[dict] = [dict(metric="uniform_distance_px", value=d.uniform_px, n=n)]
        for l, h in np.ndindex(*d.mean_px.shape):
            rows += [dict(metric="mean_distance_px", value=d.mean_px[l, h], n=n, layer=l + 1, head=h + 1),
                     dict(metric="std_distance_px", value=d.std_px[l, h], n=n, layer=l + 1, head=h + 1),
                     dict(metric="mean_distance_width", value=d.mean_px[l, h] / width, n=n, layer=l + 1, head=h + 1)]
        per = self.classes
        for c, name in enumerate(classes):
            if per.has(c):
                for l, h in np.ndindex(*per.mean.shape[1:]):
                    cn = int(per.n[c, l])
                    rows += [dict(metric="mean_distance_px", value=per.mean[c, l, h], n=cn, layer=l + 1,
                                  head=h + 1, cls=name),
                             dict(metric="mean_distance_width", value=per.mean[c, l, h] / width, n=cn,
                                  layer=l + 1, head=h + 1, cls=name)]
        return rows
