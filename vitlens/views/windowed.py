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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry, block_heads, merge_transport, stage_centres
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..engine.stream import model_name
from ..errors import InvalidParameterError, UnsupportedModelError
from ..results import Result
from ..words import counted
from .distance import LOCAL_OF_UNIFORM
from .moments import ClassMoments, add_samples, merge_moments
from .rollout import RolloutBatches, RolloutResult
from .rollout_math import check_rollout_params, fuse

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
    q_pos = centres[np.where(q_valid, g.index, 0)]  # [windows, Nq, 2]
    k_pos = key_centres[np.where(k_valid, g.keys, 0)]  # [windows, Nk, 2]
    d = np.sqrt(((q_pos[:, :, None, :] - k_pos[:, None, :, :]) ** 2).sum(-1))
    d = np.where(k_valid[:, None, :], d, 0.0)
    allowed = g.allowed & q_valid[:, :, None] & k_valid[:, None, :]
    per_query = (d * allowed).sum(-1) / np.maximum(allowed.sum(-1), 1)
    uniform = float(per_query[q_valid].mean())
    return (torch.from_numpy(d), torch.from_numpy(q_valid.astype(np.float64)),
            torch.from_numpy(k_valid.astype(np.float64)), uniform)


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


#: float64 elements of window maps reduced at once by the windowed distance (a global block of a 1024 px SAM,
#: [B, 1, heads, 4096, 4096], is reduced a block of queries at a time: memory bounded, the same numbers)
REDUCE_ELEMENTS = 1 << 24


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
            self._tables = [_distances(g, centres[g.stage]) for g in windows]
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
        if rows is not None:
            raise InvalidParameterError("The windowed distance reads whole window maps, not blocks of query rows.")
        if self.windows is None or self._batch is None:
            raise RuntimeError("The windowed distance reads attention between begin_batch and end_batch.")
        d, real, real_keys, _uniform = self._tables[layer]
        g = self.windows[layer]
        b = self._batch.shape[0]
        p = attn.detach().reshape(b, g.num_windows, attn.shape[1], g.window_tokens, g.key_tokens)
        d, real, real_keys = d.to(p.device), real.to(p.device), real_keys.to(p.device)
        per_query = torch.empty(p.shape[:4], dtype=torch.float64, device=p.device)
        step = max(1, REDUCE_ELEMENTS // max(1, b * g.num_windows * attn.shape[1] * g.key_tokens))
        for q0 in range(0, g.window_tokens, step):  # a block of queries at a time, in float64
            q = slice(q0, q0 + step)
            chunk = p[:, :, :, q].to(torch.float64)
            num = torch.einsum("bwhqk,wqk->bwhq", chunk, d[:, q])  # d is 0 at padding keys
            if self.renormalize:  # a padding query's weight on the real keys can be 0 (its mask leaves it only
                # padding keys): it does not count, but 0 / 0 there would make the mean over the real queries NaN,
                # so its denominator is shifted by 1 (a real query's is left as it is)
                den = torch.einsum("bwhqk,wk->bwhq", chunk, real_keys) + (1.0 - real[:, q])[None, :, None, :]
                per_query[:, :, :, q] = num / den
            else:
                per_query[:, :, :, q] = num
        mean = torch.einsum("bwhq,wq->bh", per_query, real) / real.sum()  # over the real queries
        self._batch[:, layer, : attn.shape[1]] = mean.cpu().numpy()

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


def windowed_rollout_row(fused: list[torch.Tensor], windows: list[WindowGeometry]) -> torch.Tensor:
    """The rolled-out row over the first stage's tokens, [B, H_0 * W_0] float64, from every block's head-fused
    window maps [B, windows, N, N] (module docstring: A' = (A + I) / rowsum(A + I) on the stage's tokens,
    composed from the last block back, the source the mean over the last stage's tokens, or its class token where
    the last block has one (``WindowGeometry.prefix_tokens``: the token the classifier reads), each patch merging or
    stage embedding crossed by its transport; a prefix token's share is dropped where the block before has none:
    it enters as a learned parameter, no image token's)."""
    b = fused[0].shape[0]
    last = windows[-1]
    dev = fused[0].device
    v = torch.full((b, last.num_tokens), 1.0 / last.num_tokens, dtype=torch.float64, device=dev)
    pre: torch.Tensor | None = None  # [B, P] the row on the block's prefix tokens (PVT v1's class token)
    if last.prefix_tokens:
        v = torch.zeros_like(v)
        pre = torch.zeros(b, last.prefix_tokens, dtype=torch.float64, device=dev)
        pre[:, 0] = 1.0  # the class token
    for layer in range(len(windows) - 1, -1, -1):
        g, a = windows[layer], fused[layer].to(torch.float64)
        p = g.prefix_tokens
        index = torch.from_numpy(g.index).to(a.device)
        keys = torch.from_numpy(g.keys).to(a.device)
        real = (index >= 0).to(torch.float64)  # [windows, Nq]
        real_keys = (keys >= 0).to(torch.float64)  # [windows, Nk]
        where, key_where = index.clamp(min=0), keys.clamp(min=0)
        x = v[:, where] * real  # [B, windows, Nq]: the row at each real query
        if p:  # the prefix tokens: the first p positions of the block's one window, queries and keys
            if g.num_windows != 1:
                raise InvalidParameterError("A block with prefix tokens attends in one window.")
            pre = torch.zeros(b, p, dtype=torch.float64, device=dev) if pre is None else pre
            x = torch.cat([pre[:, None], x[:, :, p:]], dim=2)
            attended = real_keys.clone()
            attended[:, :p] = 1.0
            a = a * attended[None, :, None, :]  # weight on padding keys is dropped, the prefix keys kept
            w = x / (a.sum(-1) + 1.0)
            mixed = torch.einsum("bwq,bwqk->bwk", w, a)
            pre = mixed[:, 0, :p] + w[:, 0, :p]
            w, mixed = w * real, mixed * real_keys
        else:
            a = a * real_keys[None, :, None, :]  # weight on padding keys is dropped
            w = x / (a.sum(-1) + 1.0)  # [B, windows, Nq]: v / rowsum(A + I) at each real query
            mixed = torch.einsum("bwq,bwqk->bwk", w, a) * real_keys  # w A, at each real key
            pre = None
        key_count = g.keys_grid[0] * g.keys_grid[1]
        out = torch.zeros(b, key_count, dtype=v.dtype, device=v.device).scatter_add_(
            1, key_where.reshape(1, -1).expand(b, -1), mixed.reshape(b, -1))
        own = torch.zeros_like(v).scatter_add_(1, where.reshape(1, -1).expand(b, -1), w.reshape(b, -1))
        # each real token appears once in its block's windows, so ``own`` is w back on the grid; a pooled block
        # carries its keys and its output tokens (the pooled residual) back onto its input tokens
        out = out if g.key_from is None else g.key_from.pull(out)
        own = own if g.query_from is None else g.query_from.pull(own)
        v = out + own
        if layer and g.stage_from is not None:  # back across the stage's embedding into the block before
            v = g.stage_from.pull(v)
        elif layer and windows[layer - 1].grid != g.in_grid:  # back across the patch merging into the block before
            parent, weight = merge_transport(windows[layer - 1].grid, g.in_grid)
            v = v[:, torch.from_numpy(parent).to(v.device)] * torch.from_numpy(weight).to(v.device)
        if layer and not windows[layer - 1].prefix_tokens:
            pre = None  # a prefix token enters here as a learned parameter: its share is no image token's
    return v


class WindowedRolloutAccumulator(AttentionConsumer):
    """Keeps each block's head-fused window maps of the batch ([B, windows, N, N], small: the windows hold
    N tokens each) and rolls them out when the batch ends (``windowed_rollout_row``)."""

    reads_windows = True

    def __init__(self, windows: list[WindowGeometry], image_size: tuple[int, int], head_fusion: str = "mean",
                 label_names: list[str] | None = None, has_classifier: bool = True) -> None:
        check_rollout_params(head_fusion, 0.0)
        self.windows, self.image_size, self.head_fusion = windows, (int(image_size[0]), int(image_size[1])), head_fusion
        self.label_names, self.has_classifier = label_names, has_classifier
        self._fused: list[torch.Tensor] = []
        self.batches = RolloutBatches()

    @classmethod
    def for_model(cls, m: LoadedModel, head_fusion: str = "mean", discard_ratio: float = 0.0
                  ) -> "WindowedRolloutAccumulator":
        if discard_ratio:
            raise InvalidParameterError("discard_ratio is defined for a ViT's whole maps; the windowed rollout takes "
                                        "discard_ratio=0.")
        return cls(model_windows(m), m.spec.image_size, head_fusion, m.label_names(),
                   m.spec.num_classes > 0)

    def begin_batch(self, batch: BatchInfo) -> None:
        check_batch_size(self.image_size, batch)
        self._fused = []

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        if rows is not None or layer != len(self._fused):
            raise InvalidParameterError("The windowed rollout reads every block's whole window maps in order.")
        g = self.windows[layer]
        fused = fuse(attn.detach(), self.head_fusion)  # [B * windows, N, N]
        self._fused.append(fused.reshape(-1, g.num_windows, g.window_tokens, g.key_tokens).float())

    def batch_row(self) -> torch.Tensor:
        """[B, H_0 * W_0] the batch's rolled-out rows on the first block's input grid (``windowed_rollout_row``),
        once every block's maps have come (a survey's rollout statistics read them)."""
        return windowed_rollout_row(self._fused, self.windows)

    def row_layout(self) -> tuple[int, tuple[int, int]]:
        """(no prefix tokens, the first block's input grid): where ``batch_row``'s row lies."""
        return 0, self.windows[0].in_grid

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        row = self.batch_row()
        self._fused = []
        grid = self.windows[0].in_grid
        maps = row.reshape(-1, *grid)
        maps = maps / maps.flatten(1).amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)[:, None, None]
        self.batches.add(maps.cpu().numpy(), logits, self.has_classifier)

    def merge(self, other: "WindowedRolloutAccumulator") -> "WindowedRolloutAccumulator":
        out = WindowedRolloutAccumulator(self.windows, self.image_size, self.head_fusion, self.label_names,
                                         self.has_classifier)
        out.batches = self.batches + other.batches
        return out

    def result(self, spec: ModelSpec | str = "") -> RolloutResult:
        source = rollout_source(self.windows)
        if isinstance(spec, ModelSpec) and spec.not_drawn:  # attention that mixes no tokens: crossed as the identity
            source += f"; {spec.not_drawn.split(' (')[0]} not drawn"  # its name; the spec's facts say why
        return self.batches.result(self.windows[0].in_grid, self.image_size, self.head_fusion, 0.0,
                                   source, self.label_names, spec)


def rollout_source(windows: list[WindowGeometry]) -> str:
    """The windowed rollout's source and path, in words (``RolloutResult.source_token``)."""
    source = ("the class token (the token the classifier reads; its share dropped where it enters as a parameter)"
              if windows[-1].prefix_tokens else "mean over the last stage's tokens")
    if any(g.stage_from is not None for g in windows) and any(g.key_from is not None for g in windows):
        return (source + ", through the spatial-reduction poolings and the stage embeddings (stated transport: each "
                "pooled or embedded token the mean of the tokens its kernel covers)")
    if any(g.stage_from is not None for g in windows):  # TinyViT's, DaViT's convolutional stage starts
        return (source + ", through the windows and the convolutional stage embeddings (stated transport: each "
                "embedded token the mean of the tokens its kernel covers)")
    if any(g.key_from is not None or g.query_from is not None for g in windows):
        return (source + ", through the poolings (stated transport: each pooled token the mean of the tokens its "
                "kernel covers)")
    if len({g.grid for g in windows}) == 1:  # one grid throughout (Qwen2.5-VL's tower, SAM / ViTDet): no merging
        return source.replace("last stage's tokens", "tokens") + ", through the windows and global blocks"
    return source + ", through the windows and patch mergings"


def window_maps(m: LoadedModel, image: object) -> list[torch.Tensor]:
    """Every block's window maps of one image, [windows, heads, N, N] float32 (side capture: the model's own
    probabilities, its output untouched), first block first; ``query_window_attention`` reads a query's row.

    Args:
        m: a hierarchical model (``LoadedModel``).
        image: one image, or a preprocessed tensor (its first image is used).
    """
    model_windows(m)  # refuses a model without windows, in one line
    x = image[:1] if isinstance(image, torch.Tensor) else m.preprocess([image])
    from ..engine.capture import capture_attention

    with capture_attention(m) as cap, torch.no_grad():
        m.forward(x.to(m.device))
    return cap.maps


def query_window_attention(probs: torch.Tensor, window: WindowGeometry, row: int, col: int) -> np.ndarray:
    """One query's attention in one block of a windowed model, on its keys' grid: [heads, H_k, W_k], the window
    (or, in a shifted block, the keys its mask allows; in a pooling block, the pooled keys) it attends, zero
    elsewhere (Fig. 7's per-head maps for hierarchical models).

    Args:
        probs: the block's captured maps of one image, [windows, heads, Nq, Nk] (``capture_attention``'s
            ``maps[layer]``, batch of one).
        window: the block's ``WindowGeometry``.
        row: the query's row on the block's query grid (its stage's).
        col: its column.

    Returns:
        [heads, H_k, W_k] float64 (the stage's grid where the keys are the queries' tokens).

    Raises:
        InvalidParameterError: a query outside the stage's grid, or maps of another block.
    """
    (h, w) = window.grid
    if not (0 <= row < h and 0 <= col < w):
        raise InvalidParameterError(f"The query ({row}, {col}) is outside this block's {h}x{w} stage grid.")
    if probs.shape[0] != window.num_windows or probs.shape[-1] != window.key_tokens:
        raise InvalidParameterError(f"Maps of shape {tuple(probs.shape)} are not this block's ({window.num_windows} "
                                    f"windows of {window.key_tokens} keys): pass one image's maps of the block.")
    win, pos = (int(v[0]) for v in np.nonzero(window.index == row * w + col))
    keys = window.keys[win]
    real = keys >= 0
    kh, kw = window.keys_grid
    out = np.zeros((probs.shape[1], kh * kw))
    out[:, keys[real]] = probs[win, :, pos].detach().double().cpu().numpy()[:, real]
    return out.reshape(-1, kh, kw)


__all__ = ["WindowedDistanceAccumulator", "query_window_attention", "window_maps", "WindowedDistanceResult",
           "WindowedRolloutAccumulator", "model_windows", "windowed_rollout_row"]
