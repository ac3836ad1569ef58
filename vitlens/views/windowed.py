"""The paper's attention views for windowed, hierarchical ViTs (Swin): mean attention distance in image pixels
per block and stage (Fig. 7 right, Fig. 11), beside the distance uniform attention over the same window would
give, and attention rollout through the windows and the patch mergings to the first stage's grid (Fig. 6).

Definitions (docs/definitions.md, "Windowed and hierarchical ViTs"):

- a block's tokens sit at their centres in the input image: a first-stage token at its patch's centre, a merged
  token at the mean of the centres of the tokens it merges (``stage_centres``: (r + 0.5) x its stage's stride,
  except where a merging's 2x2 block is cut by an odd grid's border); each window's positions are stage tokens
  (``WindowGeometry.index``: the cyclic shift undone, padding marked by the model's own code);
- distance of head h, image b: the mean over the real (non-padding) queries of every window of
  sum_k A[q, k] d(q, k) / sum_k A[q, k] over the real keys (``renormalize``; raw weights otherwise), d in
  pixels; ``window_uniform_px`` is the same mean for attention spread evenly over the keys each query may
  attend (its window, the shifted windows' mask respected, padding excluded);
- rollout: A' = (A + I) / rowsum(A + I) per block on the stage's tokens (A's window blocks placed on the
  stage grid, weight on padding dropped), the source the mean over the last stage's tokens (the model pools
  them by their mean), composed from the last block back; across a patch merging, each coarse token is the
  mean of the fine tokens it merges (``merge_transport``), so the chain runs to the first stage's grid; a stage
  made by its own embedding (PVT: a strided convolution) is crossed by that block's ``stage_from`` transport
  instead (each embedded token the mean of the tokens its kernel covers); prefix tokens (PVT v1's class token in
  its last stage, ``WindowGeometry.prefix_tokens``) are read by the rollout with the grid's tokens, the source
  the class token where the last block has one, their share dropped where they enter as parameters; the distance
  reads the grid's tokens alone.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.native import window_block_sums
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry, block_heads, stage_centres
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..engine.stream import model_name
from ..errors import InvalidParameterError, UnsupportedModelError
from ..results import Result
from ..words import counted
from .distance import KEY_BLOCK, LOCAL_OF_UNIFORM, sum_by_key_blocks
from .moments import ClassMoments, add_samples, merge_moments

if TYPE_CHECKING:  # for the annotations only, as in rollout.py
    from ..loading.model import LoadedModel


def model_windows(m: LoadedModel) -> list[WindowGeometry]:
    """Every block's ``WindowGeometry`` of a hierarchical model (``Family.windows`` at its built size).

    Raises:
        UnsupportedModelError: the model's family has no windows (a ViT with global attention).
    """
    windows = m.family.windows  # an optional ability: None for global attention
    if windows is None:
        raise UnsupportedModelError(f"{m.spec.name}: its family ({m.family.name}) attends globally; "
                                    "the windowed views are for hierarchical models (Swin).")
    return windows(m.model, m.spec.image_size)


def check_batch_size(image_size: tuple[int, int], batch: BatchInfo) -> None:
    """Refuse, in one line, a batch of another size than the model's windows were read at (a model that takes any
    size, Qwen2.5-VL's vision tower: its windows at another size are others). A batch described by its grid alone
    (input size 0 x 0) is not checked."""
    size = tuple(int(s) for s in batch.input_size)
    if size != (0, 0) and size != tuple(image_size):
        raise InvalidParameterError(f"The windowed views read this model at {image_size[0]}x{image_size[1]} px (its "
                                    f"windows at that size); got images of {size[0]}x{size[1]}: resize them, or load "
                                    "the model at that size (its data config's input_size).")


def _distances(g: WindowGeometry, centres: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(d [windows, Nq, Nk] px with 0 at padding keys, the real queries [windows, Nq] and the real keys
    [windows, Nk] as 1.0 / 0.0 (the queries and keys that count), the window-uniform distance: mean over real
    queries of the mean d over the keys each may attend). ``centres``: the queries' grid's centres (the keys'
    too unless the block places its keys itself, ``WindowGeometry.key_centres``)."""
    q_valid, k_valid = g.index >= 0, g.keys >= 0
    key_centres = centres if g.key_centres is None else g.key_centres
    q_pos = torch.from_numpy(np.ascontiguousarray(centres[np.where(q_valid, g.index, 0)], dtype=np.float64))
    k_pos = torch.from_numpy(np.ascontiguousarray(key_centres[np.where(k_valid, g.keys, 0)], dtype=np.float64))
    kv = torch.from_numpy(k_valid)
    # in torch (its threads; a 1024 px SAM's global table is 4,096^2), each axis's square made apart and added, without
    # a [windows, Nq, Nk, 2] temporary: float64 distances within one rounding (2^-52, relative) of numpy's
    d = (q_pos[:, :, None, 0] - k_pos[:, None, :, 0]).square_()
    d.add_((q_pos[:, :, None, 1] - k_pos[:, None, :, 1]).square_()).sqrt_()
    d.masked_fill_(~kv[:, None, :], 0.0)
    allowed = torch.from_numpy(g.allowed) & torch.from_numpy(q_valid)[:, :, None] & kv[:, None, :]
    per_query = torch.where(allowed, d, 0.0).sum(-1) / allowed.sum(-1).clamp_min(1)
    uniform = float(per_query[torch.from_numpy(q_valid)].mean())
    return d, torch.from_numpy(q_valid.astype(np.float64)), torch.from_numpy(k_valid.astype(np.float64)), uniform


#: the windowed distance's tables of the last models read (``_shared_tables``): call after call on one model shares them
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
_TABLES_KEPT = 64
_TABLES_LOCK = threading.Lock()  # two threads reading models at once: one of them looks up, adds or evicts at a time


def _shared_tables(windows: list[WindowGeometry], centres: dict[int, np.ndarray]
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """``_distances`` of every block: one table for the blocks of the same windows (a SAM's global blocks share one
    [1, 4096, 4096] table at 1024 px, not one each), kept for the calls after (the last ``_TABLES_KEPT`` distinct
    windows a process read: the tables are only ever read; made again, they cost a Swin-B at 768 px 0.6 s a call)."""
    out = []
    for g in windows:
        digest = hashlib.sha256()
        for a in (np.asarray(g.stage), g.index, g.keys, g.allowed, centres[g.stage],
                  np.asarray([]) if g.key_centres is None else g.key_centres):
            digest.update(str((a.dtype, a.shape)).encode())
            digest.update(np.ascontiguousarray(a).tobytes())
        key = digest.hexdigest()
        with _TABLES_LOCK:
            if key not in _TABLES:
                while len(_TABLES) >= _TABLES_KEPT:
                    del _TABLES[next(iter(_TABLES))]  # the oldest first
                _TABLES[key] = _distances(g, centres[g.stage])
            out.append(_TABLES[key])
    return out


@dataclass(eq=False, repr=False)
class WindowedDistanceResult(Result):
    """Mean attention distance of every head of a windowed, hierarchical model, averaged over images.

    Attributes:
        mean_px: [L, H] mean over images of the per-image distance in input pixels (H the most heads of any
            block; NaN for the heads a block does not have).
        std_px: [L, H] standard deviation over images (population).
        m2: [L, H] sum of squared deviations (kept so results merge).
        n_images: images averaged.
        image_size: (H, W) input pixels.
        stages: [L] the stage of each block.
        kinds: each block's attention: "window", "shifted window", "global", "grid" (MaxViT), or for a pooling block
            "query-pooled
            window" / "query-pooled global" (Hiera) or "pooled" (``WindowGeometry.kind``).
        stride_px: [L, 2] pixels between the tokens of each block's stage.
        window_uniform_px: [L] the distance uniform attention over each query's window would give.
        renormalize: whether weights over real keys were renormalised per query.
        model_name: the model's name.
        query_grids: [L, 2] each block's query grid (rows, columns): its stage's (None: a result saved before).
        key_grids: [L, 2] each block's key grid: its stage's, or the pooled grid of a pooling block (MViT v2).
    """

    kind = "windowed_distance"
    mean_px: np.ndarray
    std_px: np.ndarray
    m2: np.ndarray
    n_images: int
    image_size: tuple[int, int]
    stages: np.ndarray
    kinds: tuple[str, ...]
    stride_px: np.ndarray
    window_uniform_px: np.ndarray
    renormalize: bool
    model_name: str = ""
    query_grids: np.ndarray | None = None
    key_grids: np.ndarray | None = None

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}: {self.mean_px.shape[0]} blocks in {len(set(self.stages.tolist()))} "
                f"stages over {counted(self.n_images, 'image')}, {np.nanmin(self.mean_px):.1f}-"
                f"{np.nanmax(self.mean_px):.1f} px (window-uniform {self.window_uniform_px.min():.1f}-"
                f"{self.window_uniform_px.max():.1f} px)")

    @property
    def of_window(self) -> np.ndarray:
        """[L, H] each head's distance as a multiple of its window's uniform distance (1.0: it fills its window)."""
        return self.mean_px / self.window_uniform_px[:, None]

    @property
    def of_uniform(self) -> np.ndarray:
        """``of_window``: the uniform distance a windowed head is read against is its window's."""
        return self.of_window

    def local_heads(self, multiple: float = LOCAL_OF_UNIFORM) -> np.ndarray:
        """[L, H] which heads are local: at most ``multiple`` x the uniform distance of their window."""
        return self.of_window <= multiple

    @property
    def mean_fraction_of_width(self) -> np.ndarray:
        """``mean_px`` in units of the image width (Fig. 11 across models of other input sizes)."""
        return self.mean_px / float(self.image_size[1])

    @property
    def depth_fraction(self) -> np.ndarray:
        """[L] each block's depth as a fraction of the model's ((l + 1) / L)."""
        return (np.arange(self.mean_px.shape[0]) + 1) / self.mean_px.shape[0]

    def to_rows(self) -> list[dict]:
        """One row per (block, head) the block has, both 1-based (with the grids of the block's queries and keys,
        "HxW", where the result holds them)."""
        grids = ({} if self.query_grids is None or self.key_grids is None else
                 {layer: {"queries": "x".join(str(int(n)) for n in self.query_grids[layer]),
                          "keys": "x".join(str(int(n)) for n in self.key_grids[layer])}
                  for layer in range(self.mean_px.shape[0])})
        return [{"layer": layer + 1, "stage": int(self.stages[layer]) + 1, "attention": self.kinds[layer],
                 **grids.get(layer, {}), "head": head + 1, "mean_px": float(self.mean_px[layer, head]),
                 "std_px": float(self.std_px[layer, head]),
                 "window_uniform_px": float(self.window_uniform_px[layer]),
                 "of_window": float(self.of_window[layer, head]), "n_images": self.n_images}
                for layer in range(self.mean_px.shape[0]) for head in range(self.mean_px.shape[1])
                if not np.isnan(self.mean_px[layer, head])]

    def merge(self, other: "WindowedDistanceResult") -> "WindowedDistanceResult":
        """The result over the images of both (the same model and settings)."""
        if (self.mean_px.shape != other.mean_px.shape or self.renormalize != other.renormalize
                or not np.array_equal(self.stride_px, other.stride_px) or self.kinds != other.kinds):
            raise InvalidParameterError("Only windowed distances of the same model and settings merge.")
        mean, m2, n = merge_moments(self.mean_px, self.m2, self.n_images, other.mean_px, other.m2, other.n_images)
        return WindowedDistanceResult(mean, np.sqrt(m2 / max(n, 1)), m2, n, self.image_size, self.stages, self.kinds,
                                      self.stride_px, self.window_uniform_px, self.renormalize, self.model_name,
                                      self.query_grids, self.key_grids)


#: float32 products of window maps made at once by the windowed distance (a global block of a 1024 px SAM,
#: [B, 1, heads, 4096, 4096], is reduced a block of queries at a time: memory bounded, the same numbers)
REDUCE_ELEMENTS = 1 << 21


def window_distance_sums(p: torch.Tensor, d: torch.Tensor, real_keys: torch.Tensor | None, pad_queries: torch.Tensor,
                         renormalize: bool, out: torch.Tensor, scratch: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
    """Each window query's attention distance, by ``FLOAT32_RTOL``'s rule (the ViT's, ``per_query_distance``): the
    products A[q, k] d(q, k) in float32 (float64 for float64 maps), summed over blocks of ``KEY_BLOCK`` keys and
    the block sums added in float64; the mass over the real keys alike; one divided by the other (``renormalize``).
    Float32 maps without padding keys go through the native kernel where it runs (``window_block_sums``: the same
    rule, one read of each probability, the products fused; so the same bound).

    Args:
        p: [B, windows, heads, q, Nk] probabilities of ``q`` queries of each window (float32 or float64; half
            precision is widened to float32).
        d: [windows, q, Nk] the queries' distances in pixels in ``p``'s compute dtype, 0 at padding keys.
        real_keys: [windows, Nk] 1.0 at real keys, 0.0 at padding (None: every key is real).
        pad_queries: [windows, q] float64, 1.0 at padding queries: their mass is shifted by 1 so that a padding
            query whose mask leaves it only padding keys gives no 0 / 0 (it does not count in the mean).
        renormalize: divide by the mass over the real keys.
        out: [B, windows, heads, q] float64, written.
        scratch: memory for the products, kept by the caller (None, too small or of another dtype: made here).

    Returns:
        The scratch used (the caller keeps it for its next call; the one given where the native kernel ran).
    """
    if p.dtype not in (torch.float32, torch.float64):
        p = p.float()
    b, w, h, q, nk = p.shape
    if real_keys is None and p.dtype == torch.float32:
        sums = torch.empty(b, w, 2, h, q, dtype=torch.float64, device=p.device)
        if window_block_sums(p, d, KEY_BLOCK, sums):
            if renormalize:
                torch.div(sums[:, :, 0], sums[:, :, 1] + pad_queries[None, :, None, :], out=out)
            else:
                out.copy_(sums[:, :, 0])
            return scratch
    step = max(1, min(q, REDUCE_ELEMENTS // max(1, b * w * h * nk)))
    need = b * w * h * step * nk
    if scratch is None or scratch.dtype != p.dtype or scratch.device != p.device or scratch.numel() < need:
        scratch = torch.empty(max(need, REDUCE_ELEMENTS), dtype=p.dtype, device=p.device)
    mass = torch.empty(b, w, h, step, dtype=torch.float64, device=p.device) if renormalize else None
    for q0 in range(0, q, step):  # a block of queries at a time: the products' memory bounded
        s = min(step, q - q0)
        chunk = p[:, :, :, q0:q0 + s]
        prod = scratch[:b * w * h * s * nk].view(b, w, h, s, nk)
        sum_by_key_blocks(torch.mul(chunk, d[None, :, None, q0:q0 + s], out=prod), out[..., q0:q0 + s])
        if mass is None:
            continue
        m = mass[..., :s]
        if real_keys is None:
            sum_by_key_blocks(chunk, m)
        else:  # times 1.0 or 0.0: exact, so the mass over the real keys carries the same rounding as the sum
            sum_by_key_blocks(torch.mul(chunk, real_keys[None, :, None, None, :], out=prod), m)
        out[..., q0:q0 + s] /= m + pad_queries[None, :, None, q0:q0 + s]
    return scratch


class WindowedDistanceAccumulator(AttentionConsumer):
    """Streams the windowed attention distance: per block, the window maps [B * windows, heads, Nq, Nk] are
    reduced as they come (nothing kept; at most ``REDUCE_ELEMENTS`` float64 values at once), per image and head;
    running moments over images in float64. ``state()`` / ``from_state`` carry it between processes (surveys):
    the moments and what labels the result (stages, kinds, strides, window-uniform distances), not the windows.
    After ``per_class``, the same moments per class of the images (``BatchInfo.labels``): its state is what a survey
    keeps of the view per image shard, and ``table_rows`` the survey table's rows of it.
    """

    reads_windows = True

    def __init__(self, windows: list[WindowGeometry] | None, heads: list[int], image_size: tuple[int, int],
                 renormalize: bool = True) -> None:
        self.windows, self.heads, self.image_size = windows, list(heads), (int(image_size[0]), int(image_size[1]))
        self.renormalize = bool(renormalize)
        self._tables = []
        if windows is not None:
            centres = stage_centres(windows)
            self._tables = _shared_tables(windows, centres)
            self.stages = np.array([g.stage for g in windows])
            self.kinds = tuple(g.kind for g in windows)
            self.stride_px = np.array([g.stride_px for g in windows])
            self.window_uniform_px = np.array([t[3] for t in self._tables])
            self.query_grids = np.array([g.grid for g in windows], dtype=np.int64)
            self.key_grids = np.array([g.keys_grid for g in windows], dtype=np.int64)
        shape = (len(self.heads), max(self.heads))
        self.mean, self.m2, self.n = np.zeros(shape), np.zeros(shape), 0
        self.classes = ClassMoments(0, (), shape)
        self._batch: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self._per_query: torch.Tensor | None = None  # a block's per-query distances while its rows come
        self._scratch: torch.Tensor | None = None  # the products' memory, kept from block to block
        self._on_device: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    @classmethod
    def for_model(cls, m: LoadedModel, renormalize: bool = True) -> "WindowedDistanceAccumulator":
        return cls(model_windows(m), block_heads(m.family, m.model), m.spec.image_size,
                   renormalize)

    def per_class(self, num_classes: int) -> "WindowedDistanceAccumulator":
        """Keep the moments per class of the images too (before any image): what a survey keeps. Returns the
        accumulator."""
        self.classes = ClassMoments(num_classes, (), self.mean.shape)
        return self

    def begin_batch(self, batch: BatchInfo) -> None:
        if self.windows is None:
            raise InvalidParameterError("This windowed distance was rebuilt from a saved state: it merges and "
                                        "gives its result, but reads no images (build it with for_model).")
        check_batch_size(self.image_size, batch)
        self._batch = np.full((batch.size, len(self.windows), max(self.heads)), np.nan)
        self._labels = batch.labels

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        """A block's window maps [B * windows, heads, Nq, Nk], or a block of each window's query rows (``rows``: the
        queries it holds, in order; the layer's mean is taken at its last rows)."""
        if self.windows is None or self._batch is None:
            raise RuntimeError("The windowed distance reads attention between begin_batch and end_batch.")
        g = self.windows[layer]
        start, stop = (0, g.window_tokens) if rows is None else (int(rows.start or 0), int(rows.stop))
        if stop - start != attn.shape[-2] or not 0 <= start < stop <= g.window_tokens:
            raise InvalidParameterError(f"Rows {start}:{stop} do not match a block of {attn.shape[-2]} queries of "
                                        f"windows of {g.window_tokens} queries.")
        b, heads = self._batch.shape[0], attn.shape[1]
        p = attn.detach().reshape(b, g.num_windows, heads, stop - start, g.key_tokens)
        if start == 0:
            self._per_query = torch.empty(b, g.num_windows, heads, g.window_tokens, dtype=torch.float64,
                                          device=p.device)
        elif self._per_query is None or self._per_query.shape != (b, g.num_windows, heads, g.window_tokens):
            raise RuntimeError(f"The windowed distance got rows {start}:{stop} of block {layer} before its first.")
        d, real, real_keys = self._device_tables(layer, p.dtype, p.device)
        self._scratch = window_distance_sums(p, d[:, start:stop], real_keys, (1.0 - real[:, start:stop]),
                                             self.renormalize, self._per_query[..., start:stop], self._scratch)
        if stop < g.window_tokens:
            return
        per_query, self._per_query = self._per_query, None
        mean = torch.einsum("bwhq,wq->bh", per_query, real) / real.sum()  # over the real queries
        self._batch[:, layer, :heads] = mean.cpu().numpy()

    def _device_tables(self, layer: int, dtype: torch.dtype, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the layer's distances in the products' dtype, float32 or float64, its real queries and its real keys
        (None where every key is real), float64) on ``device``, made once per table, dtype and device."""
        d, real, real_keys, _uniform = self._tables[layer]
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        key = (id(d), dtype, str(device))
        if key not in self._on_device:
            keys = None if bool((real_keys > 0).all()) else real_keys.to(device=device, dtype=dtype)
            # the distances rounded once to float32 (``FLOAT32_RTOL`` counts that rounding)
            self._on_device[key] = (d.to(device=device, dtype=dtype), real.to(device), keys)
        return self._on_device[key]

    def batch_values(self) -> np.ndarray:
        """[B, L, H] the batch's per-image distances so far (NaN: a head a block does not have), before
        ``end_batch`` folds them in (a survey's per-class statistics read them)."""
        if self._batch is None:
            raise RuntimeError("The windowed distance has no batch: begin_batch starts one.")
        return self._batch

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        samples, self._batch = self._batch, None  # NaN at the heads a block does not have: 0 until the result
        if samples is None:
            raise RuntimeError("The windowed distance has no batch: begin_batch starts one.")
        values = np.nan_to_num(samples, nan=0.0)
        self.classes.add(self._labels, values)
        self.mean, self.m2, self.n = add_samples(self.mean, self.m2, self.n, values)

    def _labelled_like(self, other: "WindowedDistanceAccumulator") -> "WindowedDistanceAccumulator":
        out = WindowedDistanceAccumulator(None, self.heads, self.image_size, self.renormalize)
        out.windows, out._tables = self.windows or other.windows, self._tables or other._tables
        out.stages, out.kinds, out.stride_px = self.stages, self.kinds, self.stride_px
        out.window_uniform_px = self.window_uniform_px
        out.query_grids, out.key_grids = self.query_grids, self.key_grids
        return out

    def merge(self, other: "WindowedDistanceAccumulator") -> "WindowedDistanceAccumulator":
        """The accumulator over the images of both (Chan et al.'s parallel update: exact up to float64 rounding)."""
        if (self.heads != other.heads or self.kinds != other.kinds or self.renormalize != other.renormalize
                or not np.array_equal(self.stride_px, other.stride_px) or self.image_size != other.image_size):
            raise InvalidParameterError("Only windowed distances of the same model, input size and settings merge.")
        out = self._labelled_like(other)
        out.mean, out.m2, out.n = merge_moments(self.mean, self.m2, self.n, other.mean, other.m2, other.n)
        out.classes = self.classes.merge(other.classes)
        return out

    def state(self) -> dict[str, np.ndarray]:
        """The running moments and the result's labels as arrays (``from_state`` rebuilds it)."""
        return {"mean": self.mean, "m2": self.m2, "n": np.asarray(self.n), "heads": np.asarray(self.heads),
                "image_size": np.asarray(self.image_size), "renormalize": np.asarray(self.renormalize),
                "stages": self.stages, "kinds": np.asarray(self.kinds, dtype=str), "stride_px": self.stride_px,
                "window_uniform_px": self.window_uniform_px, "query_grids": self.query_grids,
                "key_grids": self.key_grids, **self.classes.state()}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "WindowedDistanceAccumulator":
        """The accumulator of a ``state()``: it merges and gives its result; it reads no images."""
        out = cls(None, [int(h) for h in np.asarray(state["heads"])],
                  (int(state["image_size"][0]), int(state["image_size"][1])), bool(np.asarray(state["renormalize"])))
        out.mean, out.m2 = np.asarray(state["mean"], dtype=np.float64), np.asarray(state["m2"], dtype=np.float64)
        out.n = int(np.asarray(state["n"]))
        out.stages, out.stride_px = np.asarray(state["stages"]), np.asarray(state["stride_px"])
        out.kinds = tuple(str(k) for k in np.asarray(state["kinds"]))
        out.window_uniform_px = np.asarray(state["window_uniform_px"], dtype=np.float64)
        out.query_grids, out.key_grids = (np.asarray(state[k], dtype=np.int64) for k in ("query_grids", "key_grids"))
        out.classes = ClassMoments.from_state(state, (), out.mean.shape)
        return out

    def result(self, spec: ModelSpec | str = "") -> WindowedDistanceResult:
        if self.n == 0:
            raise InvalidParameterError("No images were processed; pass at least one image.")
        missing = np.arange(self.mean.shape[1])[None, :] >= np.asarray(self.heads)[:, None]
        mean = np.where(missing, np.nan, self.mean)
        m2 = np.where(missing, np.nan, self.m2)
        return WindowedDistanceResult(
            mean_px=mean, std_px=np.sqrt(m2 / self.n), m2=m2, n_images=self.n, image_size=self.image_size,
            stages=self.stages.copy(), kinds=self.kinds, stride_px=self.stride_px.copy(),
            window_uniform_px=self.window_uniform_px.copy(), renormalize=self.renormalize,
            model_name=model_name(spec), query_grids=self.query_grids.copy(), key_grids=self.key_grids.copy())

    def table_rows(self, spec: dict, classes: list[str], renormalize: bool = True) -> list[dict]:
        """The survey table's rows of it. Per head: mean / std in pixels, mean in image widths and as a multiple of
        its window's uniform distance; per block: the window-uniform distance; per stage: the mean over its heads
        (in pixels and of the window); per class: the heads' means. Every row names its stage (1-based)."""
        if self.n == 0:
            return []
        d = self.result()
        n, width = d.n_images, float(d.image_size[1])
        rows: list[dict] = []
        for layer in range(d.mean_px.shape[0]):
            stage = int(d.stages[layer]) + 1
            rows.append(dict(metric="window_uniform_px", value=d.window_uniform_px[layer], n=n, layer=layer + 1,
                             stage=stage))
            for h in range(self.heads[layer]):
                at = dict(n=n, layer=layer + 1, head=h + 1, stage=stage)
                rows += [dict(metric="mean_distance_px", value=d.mean_px[layer, h], **at),
                         dict(metric="std_distance_px", value=d.std_px[layer, h], **at),
                         dict(metric="mean_distance_width", value=d.mean_px[layer, h] / width, **at),
                         dict(metric="mean_distance_of_window", value=d.of_window[layer, h], **at)]
        for s in np.unique(d.stages):
            sel = d.stages == s
            rows += [dict(metric="mean_distance_px", value=float(np.nanmean(d.mean_px[sel])), n=n, stage=int(s) + 1),
                     dict(metric="mean_distance_of_window", value=float(np.nanmean(d.of_window[sel])), n=n,
                          stage=int(s) + 1)]
        per = self.classes
        for c, name in enumerate(classes):
            if per.has(c):
                for layer in range(d.mean_px.shape[0]):
                    for h in range(self.heads[layer]):
                        rows.append(dict(metric="mean_distance_px", value=per.mean[c, layer, h], n=int(per.n[c]),
                                         layer=layer + 1, head=h + 1, stage=int(d.stages[layer]) + 1, cls=name))
        return rows


__all__ = ["WindowedDistanceAccumulator", "WindowedDistanceResult", "check_batch_size", "model_windows"]
