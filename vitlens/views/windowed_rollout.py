"""Rollout through a windowed model's windows and stages (paper Fig. 6 for hierarchical ViTs; docs/definitions.md,
"Windowed rollout"): each block's window maps placed on its stage's grid, A' = (A + I) / rowsum(A + I) within the
windows, carried across patch mergings (and query pooling) by the stated transport to the first stage's grid; and one
image's window maps for the Attention maps page. The distance of the same windows is ``vitlens.views.windowed``."""
from __future__ import annotations

from typing import TYPE_CHECKING


import numpy as np
import torch

from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry, merge_transport
from ..engine.capture import capture_attention
from ..engine.consumer import AttentionConsumer, BatchInfo
from ..errors import InvalidParameterError
from .rollout import RolloutBatches, RolloutResult
from .rollout_math import check_rollout_params, fuse
from .windowed import check_batch_size, model_windows

if TYPE_CHECKING:  # for the annotations only, as in rollout.py
    from ..loading.model import LoadedModel


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


__all__ = ["WindowedRolloutAccumulator", "query_window_attention", "rollout_source", "window_maps",
           "windowed_rollout_row"]
