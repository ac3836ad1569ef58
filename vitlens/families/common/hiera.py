"""What timm's Hiera, Hugging Face's Hiera and SAM 2's HieraDet share (the helper layer of
``vitlens.families.hiera`` and ``vitlens.families.hieradet``): the attention's own probabilities read block by block
(its query pooling, "mask unit" windows), and the geometry of each block's windows read through the model's own code
by one-hot token numbers (``read_windows``: which input tokens each output token and key window came from, and the
transport of a query pooling), for the windowed views (distance in image pixels per stage, rollout through the
windows and poolings)."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...core.attention import conv_filters
from ...core.spec import ModelSpec
from ...core.windows import Transport, WindowGeometry, transport_centres
from ...errors import UnsupportedModelError
from ..base import CaptureAbilities, CaptureRequest, Handles
from .blocks import StagedFamily, check_blocks
from .readers import read_fused_or_own, read_softmax
from .timm import timm_data_config
from .windows import StandIn, identity, token_centres


#: channels of one-hot token numbers run through a block at a time (the geometry's memory: tokens x CHUNK)
CHUNK = 512

_MATMULS = (torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul)

def zero_product(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.new_zeros(())

class QueriesAndKeys(TorchFunctionMode):
    """Inside an attention's forward on one-hot channels: the first matrix product's operands are q * scale and
    k^T (recorded); the second (probabilities @ v) is answered with q itself, so the attention's own output code
    puts each query's one-hot where its output token goes."""

    def __init__(self, zero: bool = False) -> None:
        super().__init__()
        self.operands: list[tuple] = []
        self.zero = zero  # answer the second product with zeros instead (the block's residual alone)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _MATMULS:
            self.operands.append(args)
            if len(self.operands) == 2:
                q = self.operands[0][0]
                return torch.zeros_like(q) if self.zero else q
        return func(*args, **kwargs)


def queries_and_keys(mode: QueriesAndKeys, attn: nn.Module, out: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The queries [windows, Q, d] and keys [windows, K, d] of the non-fused path's first of its two matrix products
    (q k^T, then the probabilities times v), with the first output, or a refusal naming what it made instead."""
    if len(mode.operands) != 2:
        raise UnsupportedModelError(f"{type(attn).__name__}: its non-fused path made {len(mode.operands)} matrix "
                                    "products, not q k^T and then the probabilities times v; vitlens cannot read "
                                    "its windows.")
    q, kt = mode.operands[0]
    return q.reshape(-1, *q.shape[-2:]), kt.transpose(-1, -2).reshape(-1, kt.shape[-1], kt.shape[-2]), out[0]


@dataclass(frozen=True)
class Dialect:
    """Where timm's and transformers' Hiera keep what the geometry reads: the attention's heads / head size /
    output width / query stride / scale attributes, what its non-fused path needs, the block's modules replaced
    by the identity or zero on the stand-in, and how its attention's and its own outputs come back."""

    heads: str
    out_dim: str
    q_stride: str
    attention_extra: tuple[tuple[str, Any], ...]
    identities: tuple[str, ...]
    zeros: tuple[str, ...]
    attention_returns_tuple: bool
    #: the block's width attributes its forward reads, for a stand-in of ``c`` channels (transformers' layer pools
    #: its residual where its input and output widths differ, and views it at its output width)
    widths: Callable[[nn.Module, int], dict[str, int]] = lambda block, c: {}

TIMM = Dialect(heads="heads", out_dim="dim_out", q_stride="q_stride", attention_extra=(("fused_attn", False),),
               identities=("norm1", "proj", "norm2", "ls1", "ls2", "drop_path1", "drop_path2"),
               zeros=("mlp",), attention_returns_tuple=False)

HF = Dialect(heads="num_heads", out_dim="hidden_size_output", q_stride="query_stride", attention_extra=(),
             identities=("layernorm_before", "proj", "layernorm_after", "drop_path"), zeros=("mlp",),
             attention_returns_tuple=True,
             widths=lambda block, c: {"hidden_size": c if block.hidden_size == block.hidden_size_output else 0,
                                      "hidden_size_output": c})

def triple(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x, x], dim=-1)

def _run_attention(attn: nn.Module, x: torch.Tensor, d: Dialect) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [windows, Nq, c], k [windows, Nk, c], the output [N_out, c]) of ``attn``'s own code on one-hot
    channels ``x`` [1, N, c] (one head of c channels, the module itself untouched)."""
    c = x.shape[-1]
    stand_in = StandIn(attn, qkv=triple, proj=identity, scale=1.0, head_dim=c,
                       **{d.heads: 1, d.out_dim: c}, **dict(d.attention_extra))
    mode = QueriesAndKeys()
    with mode:
        out = type(attn).forward(stand_in, x)
    out = out[0] if d.attention_returns_tuple else out
    return queries_and_keys(mode, attn, out)

class _ZeroAttention(StandIn):
    """The block's attention seen with its attributes (its query stride), answering zero."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        zero = args[0].new_zeros(())
        return (zero, None) if self.__dict__["_tuple"] else zero

    def __init__(self, attn: nn.Module, d: Dialect) -> None:
        super().__init__(attn, _tuple=d.attention_returns_tuple)

def _run_block(block: nn.Module, attn_out: torch.Tensor, x: torch.Tensor, d: Dialect) -> torch.Tensor:
    """The block's own forward on one-hot channels ``x`` [1, N, c], its norms the identity and its attention and
    MLP zero: its residual, pooled where it pools ([N_out, c'])."""
    replaced: dict[str, Any] = {name: identity for name in d.identities if getattr(block, name, None) is not None}
    replaced.update({name: zero_product for name in d.zeros})
    replaced.update(d.widths(block, x.shape[-1]))
    out = inspect.unwrap(type(block).forward)(StandIn(block, attn=_ZeroAttention(block.attn, d), **replaced), x)
    return (out[0] if isinstance(out, tuple) else out)[0]

def _one_hot(n: int, start: int, stop: int) -> torch.Tensor:
    """[1, n, stop - start]: channel j the one-hot of position start + j (float32: 0 and 1, maxima and copies exact)."""
    x = torch.zeros(1, n, stop - start, dtype=torch.float32)
    x[0, torch.arange(start, stop), torch.arange(stop - start)] = 1.0
    return x

def _sets(parts: list[torch.Tensor], n: int) -> np.ndarray:
    """[..., n] bool: which of the n input positions each row's channels hold (parts: the chunks' channels)."""
    return np.concatenate([p.ne(0).numpy() for p in parts], axis=-1)[..., :n]

def _cells(sets: np.ndarray, tokens: np.ndarray, grid: tuple[int, int], stride: tuple[int, int],
           what: str) -> np.ndarray:
    """The cell of the grid pooled by ``stride`` that each row's positions fill ([rows]): each row's positions
    (input grid tokens ``tokens`` at them) must be exactly one whole ``stride`` block of the input grid."""
    h, w = grid
    sy, sx = stride
    k = sy * sx
    counts = sets.sum(1)
    if not (counts == k).all():
        raise UnsupportedModelError(f"{what}: a token holds {int(counts[counts != k][0])} input tokens, not the "
                                    f"{sy}x{sx} = {k} of its pooling; vitlens cannot place it.")
    held = np.sort(tokens[np.nonzero(sets)[1].reshape(-1, k)], axis=1)  # [rows, k] input grid tokens
    r, c = np.divmod(held[:, 0], w)
    want = ((r[:, None] + np.repeat(np.arange(sy), sx)[None]) * w + c[:, None] + np.tile(np.arange(sx), sy)[None])
    bad = (r % sy != 0) | (c % sx != 0) | (held != want).any(1)
    if bad.any():
        raise UnsupportedModelError(f"{what}: a token pools tokens {held[bad][0].tolist()} of the {h}x{w} grid, not "
                                    f"one {sy}x{sx} block; vitlens reads Hiera's 2-D max pools only.")
    return (r // sy) * (w // sx) + c // sx

def _pool_transport(sets: np.ndarray, tokens: np.ndarray, cells: np.ndarray, coarse: int, fine: int) -> Transport:
    """Each pooled token the mean of the fine tokens it max-pools (the rows' positions, read from the model)."""
    row, pos = np.nonzero(sets)
    rows, cols = cells[row].astype(np.int64), tokens[pos].astype(np.int64)
    weights = 1.0 / sets.sum(1)[row]
    order = np.lexsort((cols, rows))
    return Transport(rows[order], cols[order], weights[order], (coarse, fine))

def stage_geometry(stage: int, grid: tuple[int, int], stride: tuple[int, int], index: np.ndarray, keys: np.ndarray,
                   allowed: np.ndarray, kind: str, input_grid: tuple[int, int], centres: np.ndarray,
                   move: Transport | None, what: str) -> tuple[WindowGeometry, np.ndarray]:
    """One block's ``WindowGeometry`` from its queries' and keys' tokens, and the query centres the next block reads:
    a query-pooled block (``move``: the pooling's transport) has keys on the input grid and queries at the pooled
    centres; any other block's keys are its queries' tokens (refused otherwise, naming ``what``)."""
    if move is not None:
        coarse = transport_centres(move, centres)
        return WindowGeometry(stage=stage, grid=grid, stride_px=stride, index=index, allowed=allowed,
                              kind="query-pooled " + kind, key_index=keys, key_grid=input_grid, query_centres=coarse,
                              key_centres=centres, input_grid=input_grid, query_from=move), coarse
    if not np.array_equal(keys, index):
        raise UnsupportedModelError(f"{what}: its keys are not its queries' tokens; vitlens cannot read it.")
    return WindowGeometry(stage=stage, grid=grid, stride_px=stride, index=index, allowed=allowed, kind=kind,
                          query_centres=centres), centres


def read_windows(unroll: Callable[[torch.Tensor], torch.Tensor], blocks: Sequence[tuple[int, nn.Module]],
                 grid: tuple[int, int], patch_stride: tuple[int, int], q_stride: tuple[int, int],
                 d: Dialect) -> list[WindowGeometry]:
    """Every block's ``WindowGeometry``, read through the model's own code (module docstring).

    Args:
        unroll: the model's unroll of [1, H * W, C] row-major tokens into its sequence order.
        blocks: (stage, block) of every block, first to last.
        grid: (H, W) the patch tokens' grid.
        patch_stride: (sy, sx) the patch embedding's stride in pixels.
        q_stride: (qy, qx) the query pooling's 2-D stride.
        d: the implementation's ``Dialect``.

    Returns:
        One ``WindowGeometry`` per block: "window" (mask units), "global", or "query-pooled window" /
            "query-pooled global" for a block that max-pools its queries.
    """
    h, w = grid
    n = h * w
    parts = [unroll(_one_hot(n, s, min(s + CHUNK, n))) for s in range(0, n, CHUNK)]
    order = _sets([p[0] for p in parts], n)  # [positions, grid tokens]
    if not (order.sum(1) == 1).all():
        raise UnsupportedModelError("Hiera's unroll did not place every patch token once; vitlens cannot read it.")
    tokens = order.argmax(1)  # the grid token at each sequence position
    centres = token_centres((h, w), patch_stride)
    stride = tuple(int(s) for s in patch_stride)
    out = []
    with torch.no_grad():
        for layer, (stage, block) in enumerate(blocks):
            what = f"block {layer + 1} (stage {stage + 1}, {type(block).__name__})"  # counted from 1, as the app
            attn = block.attn
            pooled = int(getattr(attn, d.q_stride)) > 1
            if pooled and int(getattr(attn, d.q_stride)) != math.prod(q_stride):
                raise UnsupportedModelError(f"{what}: its query stride {getattr(attn, d.q_stride)} is not the "
                                            f"model's {q_stride[0]}x{q_stride[1]}.")
            step = (q_stride[0], q_stride[1]) if pooled else (1, 1)
            n_in = tokens.size
            qs, ks, att, res = [], [], [], []
            for s in range(0, n_in, CHUNK):
                x = _one_hot(n_in, s, min(s + CHUNK, n_in))
                q, k, a = _run_attention(attn, x, d)
                qs.append(q)
                ks.append(k)
                att.append(a)
                res.append(_run_block(block, a, x, d)[:, : x.shape[-1]])  # a max|mean concat: its max half
            q_sets, k_sets, a_sets, r_sets = (_sets(p, n_in) for p in (qs, ks, att, res))
            if not np.array_equal(a_sets, r_sets):
                raise UnsupportedModelError(f"{what}: its attention's output tokens are not in the order of its "
                                            "(pooled) residual; vitlens cannot read it.")
            if not (k_sets.sum(-1) == 1).all():
                raise UnsupportedModelError(f"{what}: a key is not one input token; vitlens cannot read it.")
            nw, nq = q_sets.shape[:2]
            out_grid = (h // step[0], w // step[1])
            index = _cells(q_sets.reshape(nw * nq, -1), tokens, (h, w), step, what).reshape(nw, nq)
            keys = tokens[k_sets.argmax(-1)]  # [windows, Nk] input grid tokens
            next_tokens = _cells(r_sets, tokens, (h, w), step, what)
            stride = (stride[0] * step[0], stride[1] * step[1])
            allowed = np.ones((nw, nq, keys.shape[1]), dtype=bool)
            move = _pool_transport(r_sets, tokens, next_tokens, out_grid[0] * out_grid[1], n_in) if pooled else None
            kind = "global" if nw == 1 else "window"
            g, centres = stage_geometry(stage, out_grid, stride, index, keys, allowed, kind, (h, w), centres, move,
                                        what)
            out.append(g)
            tokens, (h, w) = next_tokens, out_grid
    return out

def window_emitter(emit: CaptureRequest) -> Callable[..., None]:
    """Hiera's probabilities [B, heads, windows, Nq, Nk] (global: [B, heads, Nq, Nk]) handed on as
    [B * windows, heads, Nq, Nk]."""
    def send(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        if probs.dim() == 5:
            probs = probs.transpose(1, 2).reshape(-1, probs.shape[1], *probs.shape[-2:])
        emit(layer, probs, rows)
    return send

def _softmax_of(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A non-fused ``MaskUnitAttention``'s own probabilities, as its one ``softmax`` returns them (the very tensor its
    output is computed from)."""
    read_softmax(attn, layer, capture, handles, capture.detach,
                 lambda n: f"{type(attn).__name__}'s non-fused forward made {n} softmax calls; vitlens reads one.")

class TimmHieraBase(StagedFamily):
    """What timm's Hiera and HieraDet share: blocks of one attention module (``attn``, with a ``fused_attn`` switch:
    side capture reads a fused module's one SDPA call, a non-fused one's own softmax; inline turns the non-fused path
    on for the session and reads its softmax), handed on as [B * windows, heads, Nq, Nk]; the patch convolution's
    filters and timm's data config."""

    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("norm1",)

    def check_block_classes(self, model: nn.Module, name: str, block_cls: type, attn_cls: type) -> None:
        """Refuse, in one line, a block that is not exactly ``block_cls`` with ``attn_cls``."""
        check_blocks(name, ((f"block {i}", b) for i, b in enumerate(model.blocks)), block_cls, (attn_cls,), "timm")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(window_emitter(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, by_window, handles, inline=False, own=_softmax_of)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(window_emitter(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, by_window, handles, inline=True, own=_softmax_of)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads side by side at the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


__all__ = ["CHUNK", "Dialect", "HF", "QueriesAndKeys", "TIMM", "TimmHieraBase", "queries_and_keys", "read_windows",
           "triple", "window_emitter", "zero_product"]
