"""The position view of relative-position models, the analogue of paper Fig. 7 (centre) for models that learn
no absolute E_pos: the bias each block adds to its attention scores, as a function of the 2-D offset from the
query patch to the key patch, per head.

``bias[l, h, dy + gh - 1, dx + gw - 1]`` is what head h of block l adds to the score of a query patch at (r, c)
for the key patch at (r + dy, c + dx): offset = key minus query, in patch rows (dy > 0: the key is below) and
columns (dx > 0: the key is to the right), in attention logits (added to q·k·scale before the softmax). Prefix
tokens have no place on the grid: the biases between them and the patches are stated apart. The bias is read
from the model's own modules (``vitlens.families.common.relative_bias``) and checked to depend on the offset alone.
See docs/definitions.md.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..loading.model import LoadedModel
from ..results import Result
from ..families.common.relative_bias import read_relative_bias

#: how many roundings of the bias's dtype two query/key pairs at one offset may differ by and still count as one
#: value (table look-ups give exactly one; a bias computed pair by pair from the same offset could differ by a
#: rounding or two)
SPREAD_ULPS = 4


@dataclass(eq=False, repr=False)
class RelativePositionBiasResult(Result):
    """The learned relative-position bias of every block and head, by offset between query and key patch.

    Attributes:
        bias: [L, H, Y, X] in attention logits; ``bias[l, h, dy + gh - 1, dx + gw - 1]`` is what head h of block l adds
            to a query patch's score for the key patch dy rows below and dx columns right of it (key minus query),
            Y = 2 gh - 1, X = 2 gw - 1.
        grid: (gh, gw), the patch grid the bias is defined on.
        prefix_labels: what each prefix token is ("class", ...); empty without prefix tokens.
        prefix_to_patch: [L, H, P] the bias of a prefix token's query for any patch key (one number: checked to be
            the same for every patch).
        patch_to_prefix: [L, H, P] the bias of any patch query for a prefix token's key (checked likewise).
        prefix_to_prefix: [L, H, P, P] query prefix token i, key prefix token j.
        sources: per block, the module(s) the bias was read from, in words.
        offset_spread: [L] the largest difference, within each block, between two query/key pairs of one offset (or
            two patches of one prefix pair kind): 0 for a bias looked up by offset.
        model_name: the model's name.
    """

    kind = "relative_position_bias"
    bias: np.ndarray
    grid: tuple[int, int]
    prefix_labels: tuple[str, ...]
    prefix_to_patch: np.ndarray
    patch_to_prefix: np.ndarray
    prefix_to_prefix: np.ndarray
    sources: tuple[str, ...]
    offset_spread: np.ndarray
    model_name: str = ""

    @property
    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(dy, dx): the row offsets of ``bias``'s third axis and the column offsets of its fourth."""
        gh, gw = self.grid
        return np.arange(-(gh - 1), gh), np.arange(-(gw - 1), gw)

    def at(self, layer: int, head: int, dy: int, dx: int) -> float:
        """The bias one head adds for one offset.

        Args:
            layer: the block, 0-based.
            head: the head, 0-based.
            dy: key row minus query row.
            dx: key column minus query column.

        Returns:
            ``bias[layer, head, dy + gh - 1, dx + gw - 1]`` in logits.

        Raises:
            InvalidParameterError: an offset outside the grid.
        """
        gh, gw = self.grid
        if not (abs(dy) < gh and abs(dx) < gw):
            raise InvalidParameterError(f"dy and dx must be offsets within the {gh}x{gw} grid (|dy| < {gh}, "
                                        f"|dx| < {gw}); got ({dy}, {dx}).")
        return float(self.bias[layer, head, dy + gh - 1, dx + gw - 1])

    def shared_by_all_blocks(self) -> bool:
        """Whether every block adds the same bias (a bias shared across blocks, as in vit_srelpos)."""
        return all(np.array_equal(self.bias[0], b, equal_nan=True) for b in self.bias[1:]) and \
            all(np.array_equal(self.prefix_to_patch[0], b) for b in self.prefix_to_patch[1:]) and \
            all(np.array_equal(self.patch_to_prefix[0], b) for b in self.patch_to_prefix[1:])

    def summary(self) -> str:
        layers, heads = self.bias.shape[:2]
        gh, gw = self.grid
        prefix = f", prefix biases for {', '.join(self.prefix_labels)}" if self.prefix_labels else ""
        shared = ", the same in every block" if layers > 1 and self.shared_by_all_blocks() else ""
        return (f"{self.model_name or 'model'}: {layers} blocks x {heads} heads, bias by offset dy in +-{gh - 1}, "
                f"dx in +-{gw - 1} ({gh}x{gw} patches{shared}{prefix}), from {float(np.nanmin(self.bias)):.3g} to "
                f"{float(np.nanmax(self.bias)):.3g} logits")

    def to_rows(self) -> list[dict]:
        """One row per (block, head, query/key pair kind and offset), block and head 1-based: patch-to-patch rows
        by offset (dy, dx: key minus query), then the prefix rows (dy, dx empty)."""
        layers, heads = self.bias.shape[:2]
        dys, dxs = self.offsets
        rows = [{"layer": l + 1, "head": h + 1, "query": "patch", "key": "patch", "dy": int(dy), "dx": int(dx),
                 "bias": float(self.bias[l, h, i, j])}
                for l in range(layers) for h in range(heads) for i, dy in enumerate(dys) for j, dx in enumerate(dxs)
                if not np.isnan(self.bias[l, h, i, j])]  # NaN: an offset or head this block's window has not
        for l in range(layers):
            for h in range(heads):
                for p, label in enumerate(self.prefix_labels):
                    rows.append({"layer": l + 1, "head": h + 1, "query": label, "key": "patch", "dy": None, "dx": None,
                                 "bias": float(self.prefix_to_patch[l, h, p])})
                    rows.append({"layer": l + 1, "head": h + 1, "query": "patch", "key": label, "dy": None, "dx": None,
                                 "bias": float(self.patch_to_prefix[l, h, p])})
                    for q, other in enumerate(self.prefix_labels):
                        rows.append({"layer": l + 1, "head": h + 1, "query": label, "key": other, "dy": None,
                                     "dx": None, "bias": float(self.prefix_to_prefix[l, h, p, q])})
        return rows

    def prefix_rows(self, layer: int) -> list[dict]:
        """Block ``layer``'s (0-based) prefix biases as one row per head (what the app's table shows).

        Args:
            layer: the block, 0-based.

        Returns:
            One dict per head: "head" (1-based) and a column per pair kind ("class -> patch", "patch -> class",
                "class -> class", ...), query first; empty without prefix tokens.
        """
        if not self.prefix_labels:
            return []
        rows = []
        for h in range(self.bias.shape[1]):
            row: dict[str, Any] = {"head": h + 1}
            for p, label in enumerate(self.prefix_labels):
                row[f"{label} -> patch"] = float(self.prefix_to_patch[layer, h, p])
                row[f"patch -> {label}"] = float(self.patch_to_prefix[layer, h, p])
                for q, other in enumerate(self.prefix_labels):
                    row[f"{label} -> {other}"] = float(self.prefix_to_prefix[layer, h, p, q])
            rows.append(row)
        return rows


def bias_by_offset(bias: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """One block's full bias [heads, T, T] (query rows, key columns) by offset, with its prefix biases.

    Args:
        bias: [heads, T, T], T = num_prefix_tokens + gh * gw, patch tokens in row-major order after the prefix.
        grid: (gh, gw).
        num_prefix_tokens: P, the tokens before the patch tokens.

    Returns:
        ``(by_offset [heads, 2gh-1, 2gw-1], prefix_to_patch [heads, P], patch_to_prefix [heads, P],
            prefix_to_prefix [heads, P, P], spread)`` in float64 (exactly the bias's values: each entry is the bias of
            one query/key pair of that offset, the query at the top-left-most place the offset allows), and
            ``spread``, the largest difference between two pairs of one offset or one prefix pair kind.
    """
    gh, gw = grid
    p, n = num_prefix_tokens, gh * gw
    if bias.dim() != 3 or tuple(bias.shape[1:]) != (p + n, p + n):
        raise ViewNotAvailableError(f"A bias of shape {list(bias.shape)} is not [heads, {p + n}, {p + n}] for "
                                    f"{p} prefix tokens and a {gh}x{gw} grid.")
    b = bias.detach().to(torch.float64).cpu()  # exact: every float16/bfloat16/float32 value is a float64
    heads = b.shape[0]
    patches = b[:, p:, p:].reshape(heads, n * n)
    rows, cols = torch.div(torch.arange(n), gw, rounding_mode="floor"), torch.arange(n) % gw
    dy = rows[None, :] - rows[:, None]  # [query, key]: key minus query
    dx = cols[None, :] - cols[:, None]
    offset = ((dy + gh - 1) * (2 * gw - 1) + dx + gw - 1).reshape(1, -1).expand(heads, -1)
    size = (heads, (2 * gh - 1) * (2 * gw - 1))
    high = torch.full(size, -torch.inf, dtype=torch.float64).scatter_reduce(1, offset, patches, "amax")
    low = torch.full(size, torch.inf, dtype=torch.float64).scatter_reduce(1, offset, patches, "amin")
    spread = float((high - low).max())
    # one pair per offset: the query at the top-left-most cell from which the key is still on the grid
    oy, ox = torch.arange(-(gh - 1), gh)[:, None], torch.arange(-(gw - 1), gw)[None, :]
    qy, qx = (-oy).clamp_min(0), (-ox).clamp_min(0)
    q, k = qy * gw + qx, (qy + oy) * gw + qx + ox
    by_offset = b[:, p:, p:][:, q, k]
    to_patch, from_patch = b[:, :p, p:], b[:, p:, :p]
    if p:
        spread = max(spread, float((to_patch.amax(-1) - to_patch.amin(-1)).max()),
                     float((from_patch.amax(-2) - from_patch.amin(-2)).max()))
    # a prefix pair kind's one number, read at the first patch (the spread says the others agree)
    return (by_offset.numpy(), to_patch[:, :, 0].numpy(), from_patch[:, 0, :].numpy(), b[:, :p, :p].numpy().copy(),
            spread)


def _padded(parts: list[tuple], grids: list[tuple[int, int]]) -> tuple[list[tuple], tuple[int, int]]:
    """Blocks whose windows or heads differ (Swin's stages) on one offset grid: each block's bias by offset placed at
    its offsets inside the largest window's, NaN at the offsets its window does not have and at the heads it
    does not have (no prefix tokens: a windowed model has none)."""
    gh, gw = max(g[0] for g in grids), max(g[1] for g in grids)
    heads = max(part[0].shape[0] for part in parts)
    out = []
    for part, (h, w) in zip(parts, grids):
        if part[1].size:
            raise ViewNotAvailableError("Blocks of different windows with prefix tokens are not read by offset.")
        by_offset = np.full((heads, 2 * gh - 1, 2 * gw - 1), np.nan)
        by_offset[: part[0].shape[0], gh - h: gh + h - 1, gw - w: gw + w - 1] = part[0]
        out.append((by_offset, np.zeros((heads, 0)), np.zeros((heads, 0)), np.zeros((heads, 0, 0)), part[4]))
    return out, (gh, gw)


def relative_position_bias(m: LoadedModel | nn.Module) -> RelativePositionBiasResult:
    """The learned relative-position bias of every block and head as a function of the offset between query and
    key patch (the position view of models without an absolute E_pos; the analogue of paper Fig. 7 centre).

    Args:
        m: the model: a ``LoadedModel``, or a module vitlens reads the bias of without loading it (a Hugging Face
            ``BeitModel`` or ``Data2VecVisionModel``, whose attention the views do not capture).

    Returns:
        A ``RelativePositionBiasResult``: ``bias`` [layers, heads, 2gh-1, 2gw-1] in logits by offset (key minus
            query, in patch rows and columns), the prefix-token biases apart, and where each block's bias was read.

    Raises:
        ViewNotAvailableError: a model without a learned relative-position bias (the reason in one line), or one whose
            bias is not a function of the offset alone (the largest difference between two pairs of one offset named).
    """
    if isinstance(m, LoadedModel):
        name, labels = m.spec.name, m.spec.prefix_labels
        found = m.family.relative_bias(m.model, m.spec)
        reason = m.family.no_relative_bias_reason(m.model, m.spec) if found is None else ""
    else:
        name, labels = type(m).__name__, ()
        found = read_relative_bias(m)
        reason = ("it has none of the relative-position bias modules vitlens reads (timm RelPosBias / RelPosMlp, "
                  "timm BEiT, Hugging Face BEiT / Data2VecVision)")
    if found is None:
        raise ViewNotAvailableError(f"The relative-position bias view is not available for {name}: {reason}.")
    p = found.num_prefix_tokens
    if len(labels) != p:
        labels = ("class",) if p == 1 else tuple(f"prefix {i + 1}" for i in range(p))
    parts = [bias_by_offset(b, found.block_grid(layer), p) for layer, b in enumerate(found.biases)]
    grid = found.grid
    if found.grids is not None or len({part[0].shape for part in parts}) > 1:  # blocks of other windows or heads
        parts, grid = _padded(parts, [found.block_grid(layer) for layer in range(len(parts))])
    spreads = np.array([part[4] for part in parts])
    for layer, (b, spread) in enumerate(zip(found.biases, spreads)):
        tolerance = SPREAD_ULPS * torch.finfo(b.dtype).eps * float(b.abs().max()) if b.numel() else 0.0
        if spread > tolerance:
            raise ViewNotAvailableError(
                f"The relative-position bias of {name} is not a function of the offset alone: in block {layer + 1} "
                f"({found.sources[layer]}) two query/key pairs of one offset differ by {spread:.3g} logits (more than "
                f"{SPREAD_ULPS} roundings of its largest value), so a view by offset would hide what it adds.")
    return RelativePositionBiasResult(
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        bias=np.stack([part[0] for part in parts]), grid=tuple(grid),  # type: ignore[arg-type]
        prefix_labels=tuple(labels), prefix_to_patch=np.stack([part[1] for part in parts]),
        patch_to_prefix=np.stack([part[2] for part in parts]), prefix_to_prefix=np.stack([part[3] for part in parts]),
        sources=tuple(found.sources), offset_spread=spreads, model_name=name)


def offset_structure(result: RelativePositionBiasResult) -> dict[str, float]:
    """Summary of the bias's locality, in logits, averaged over blocks and heads (what a survey keeps of it):

    - ``self``: the bias for the query's own patch (offset (0, 0));
    - ``neighbours``: the mean bias at the 4 offsets one row or column away;
    - ``far_ge3``: the mean over offsets at least 3 cells away along some axis (Chebyshev distance >= 3), each
      offset counted once (not weighted by how many pairs have it).

    A bias that favours nearby keys shows as ``neighbours`` above ``far_ge3``.

    Args:
        result: the relative-position bias (``relative_position_bias``).

    Returns:
        ``{"self": ..., "neighbours": ..., "far_ge3": ...}`` (NaN where the grid has no such offset).
    """
    dys, dxs = result.offsets
    cheb = np.maximum(np.abs(dys)[:, None], np.abs(dxs)[None, :])
    manhattan = np.abs(dys)[:, None] + np.abs(dxs)[None, :]
    with np.errstate(invalid="ignore"), warnings.catch_warnings():  # NaN: an offset or head a block has not
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_map = np.nanmean(result.bias, axis=(0, 1))

    def mean(sel: np.ndarray) -> float:
        vals = mean_map[sel]
        vals = vals[np.isfinite(vals)]
        return float(vals.mean()) if vals.size else float("nan")

    return {"self": mean(manhattan == 0), "neighbours": mean(manhattan == 1), "far_ge3": mean(cheb >= 3)}
