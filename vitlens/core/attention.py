"""The maths every model family shares, below both ``loading`` and ``families``: the attention
probabilities a block computes (every attention view: Fig. 6/14 rollout, Fig. 7 right and Fig. 11
attention distance) and the filters a patch-embedding convolution applies (Fig. 7 left).
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence, cast

import math

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from .native import SoftmaxTaps, compiled_wanted, softmax_taps
from .pages import large_empty
from ..errors import ViewNotAvailableError

#: what an engine asks before each block of query rows (``rows``, the block's [B, heads, rows, T] shape): the
#: ``SoftmaxTaps`` the block's softmax pass should fill for the views, or None
TapsFor = Callable[[slice, tuple], "SoftmaxTaps | None"]

#: a bias of the scores that adds itself (``attention_probs``'s ``biases``): ``bias(scores, rows)`` returns the scores
#: [B, heads, rows, T] of the query rows ``rows`` (None: every row) with the bias added, in place where they need no
#: gradients; for a bias with a structure a tensor would spend memory on (SAM's decomposed relative-position bias,
#: ``vitlens.families.sam``: two small tables broadcast over the keys, never a [B, heads, T, T] map)
RowBias = Callable[[torch.Tensor, "slice | None"], torch.Tensor]


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    biases: Sequence[torch.Tensor | RowBias] = (),
    scale_after: bool = False,
    out: torch.Tensor | None = None,
    taps: SoftmaxTaps | None = None,
    workspace: dict | None = None,
    padded_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q * scale @ k^T + biases + mask) in float32, with timm's mask semantics.

    Args:
        q: [B, heads, T, head_dim] queries as the block uses them (after q_norm, RoPE).
        k: [B, heads, T, head_dim] keys as the block uses them (after k_norm, RoPE).
        scale: the module's ``scale`` (head_dim ** -0.5).
        attn_mask: bool (True = attend) or additive float mask broadcastable to [B, heads, T, T].
        is_causal: mask future keys (takes precedence over ``attn_mask``, as in timm).
        biases: additive biases of the scores, added one after the other before the mask, in the
            order the model adds them (relative-position bias, then a shared one): tensors broadcastable to the
            scores, or ``RowBias`` callables (called with rows None: every row of ``q``).
        scale_after: scale the product (q @ k^T) * scale instead of the queries, as Hugging Face
            does (the same numbers for power-of-two scales, rounding apart otherwise).
        out: a float32 tensor of the result's shape to compute into (no gradients): the scores and then the
            probabilities are written there, no new [B, heads, rows, T] tensor (``attention_probs_in_rows`` reuses
            one for every block of a layer). The same numbers. Contiguous, or a block of a buffer whose rows are
            padded to a longer stride (``padded_row_stride``; q and k then of the same leading shape).
        taps: with ``out``, what the views want of these probabilities, computed in the softmax's own pass by the
            native kernel where it applies (``vitlens.core.native.softmax_taps``, which then sets
            ``taps.filled``); the probabilities are the same to float rounding (its exp is ATen's ``exp_u20``, the
            fused kernel's: ``vitlens.core.native.EXP_ULPS``).
        workspace: with ``out``, a session's dict (``session_buffer``) where the scaled queries are made, rather than
            in fresh memory each block (the same numbers).
        padded_keys: with an ``out`` whose rows are padded to a longer stride, the keys k^T [..., head_dim, stride]
            (float32, contiguous) with zeros past T (``attention_probs_in_rows`` makes them): the product then fills
            the block's whole padded rows, a contiguous output (the padding, zeros, is never read), which BLAS writes
            faster than T columns of a strided one (docs/performance.md, issue 67). The same products.

    Returns:
        [B, heads, T, T] float32 probabilities, each row summing to 1 over the keys (``out`` when given).
    """
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if out is not None and not grad:
        qs = q.float()
        if not scale_after:
            qs = qs * scale if workspace is None else torch.mul(
                qs, scale, out=session_tensor(workspace, "queries", qs.shape, qs.dtype, qs.device))
        if out.is_contiguous():
            scores = torch.matmul(qs, k.float().transpose(-2, -1), out=out)
        elif padded_keys is not None and padded_keys.shape[-1] == out.stride(-2) and padded_keys.is_contiguous():
            # the block's whole padded rows, [.., rows, stride]: contiguous (padded_row_stride's layout)
            scores = out
            whole = out.as_strided((*out.shape[:-1], padded_keys.shape[-1]), out.stride())
            torch.bmm(qs.reshape(-1, *qs.shape[-2:]), padded_keys.reshape(-1, *padded_keys.shape[-2:]),
                      out=whole.view(-1, *whole.shape[-2:]))
        else:  # rows padded to an aligned stride (padded_row_stride): one batched product into the strided block
            scores = out
            torch.bmm(qs.reshape(-1, *qs.shape[-2:]), k.float().transpose(-2, -1).reshape(-1, k.shape[-1], k.shape[-2]),
                      out=out.view(-1, *out.shape[-2:]))
        if scale_after:
            scores.mul_(scale)
    elif scale_after:
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    else:
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)
    for bias in biases:
        if callable(bias):
            scores = bias(scores, None)
        else:
            scores = scores + bias.float() if scores.requires_grad else scores.add_(bias.float())
    n = scores.shape[-1]
    if is_causal:
        scores = scores + scores.new_full((n, n), float("-inf")).triu_(1)
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            add = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill_(~attn_mask, float("-inf"))
        else:
            add = attn_mask.float()
        scores = scores + add if scores.requires_grad else scores.add_(add)
    if scores.requires_grad:
        return scores.softmax(dim=-1)
    if out is not None and (taps is not None or not scores.is_contiguous()) and softmax_taps(scores,
                                                                                          taps or SoftmaxTaps()):
        return scores  # (a padded block goes through the native pass even without taps: ATen's softmax would copy it)
    # in place: one [B, heads, rows, T] buffer instead of two (the same numbers as softmax into a new tensor)
    return torch.softmax(scores, dim=-1, out=scores)


def mha_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int, heads: int,
             queries: int, keys: int) -> torch.Tensor | None:
    """The additive float mask [B, heads, queries, keys] that ``nn.MultiheadAttention`` applies for its
    ``attn_mask`` ([queries, keys] or [B * heads, queries, keys]) and ``key_padding_mask`` ([B, keys]),
    with its semantics: a boolean True means *not allowed* (the opposite of SDPA's and timm's, where
    True means attend), a float mask is added to the scores. None when neither is given."""
    out = None
    for mask, shape in ((attn_mask, None), (key_padding_mask, (batch, 1, 1, keys))):
        if mask is None:
            continue
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask, float("-inf"))
        mask = mask.float()
        if shape is None:
            mask = mask.reshape(batch, heads, queries, keys) if mask.dim() == 3 else mask.reshape(1, 1, queries, keys)
        else:
            mask = mask.reshape(shape)
        out = mask if out is None else out + mask
    return out


def effective_weight(conv: nn.Conv2d) -> torch.Tensor:
    """The weight a conv actually applies: weight-standardised for timm's StdConv2d(Same).

    Args:
        conv: the convolution.

    Returns:
        Its [D, C, kh, kw] weight as applied (detached), standardised per filter for ``StdConv2d``.
    """
    w = conv.weight.detach().to(torch.float64).cpu()
    if type(conv).__name__ in ("StdConv2d", "StdConv2dSame"):
        flat = w.reshape(w.shape[0], -1)
        mean = flat.mean(dim=1, keepdim=True)
        var = flat.var(dim=1, unbiased=False, keepdim=True)
        w = ((flat - mean) / torch.sqrt(var + conv.eps)).reshape_as(w)
    return w


def conv_filters(conv: nn.Module, name: str, why: str, model_name: str) -> tuple[torch.Tensor, str, str]:
    """(weight, module name, description) of a convolution's filters, as the layer applies them.

    Args:
        conv: the module holding the filters (must be an ``nn.Conv2d``).
        name: its module name, for the description.
        why: why this convolution is the one shown (e.g. "the hybrid CNN's first convolution").
        model_name: the model's name, for the error message.

    Returns:
        ``(weight [D, C, kh, kw], name, description)``.

    Raises:
        ViewNotAvailableError: ``conv`` is not a convolution.
    """
    if not isinstance(conv, nn.Conv2d):
        raise ViewNotAvailableError(f"{model_name}: {name} is a {type(conv).__name__}, not a convolution.")
    w = effective_weight(conv)
    d, c, kh, kw = w.shape
    std = " (weight-standardised, as the layer applies it)" if type(conv).__name__.startswith("StdConv") else ""
    return w, name, f"{name}: {d} filters of {kh}x{kw}x{c}, {why}{std}"


def session_buffer(workspace: dict | None, key: str, numel: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A flat tensor of at least ``numel`` elements for a computation repeated block after block:
    ``workspace[key]`` when it is large enough (same dtype and device), else a new one, kept there for
    the next call. A fresh large tensor per block costs its page faults every time. Without a
    workspace, a new tensor each call."""
    flat = None if workspace is None else workspace.get(key)
    if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
        flat = large_empty(numel, dtype=dtype, device=device)
        if workspace is not None:
            workspace[key] = flat
    return flat


def session_tensor(workspace: dict | None, key: str, shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` in ``workspace[key]``'s memory (``session_buffer``), valid until the next
    call under that key."""
    numel = math.prod(shape)
    return session_buffer(workspace, key, numel, dtype, device)[:numel].view(*shape)


def session_copy(workspace: dict | None, key: str, x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` made in ``workspace[key]`` (``session_buffer``: the memory of the last layer's copy,
    no fresh pages), valid until the next copy under that key; without a workspace, or where ``x`` needs gradients,
    ``x.contiguous()``. The same numbers."""
    if workspace is None or (torch.is_grad_enabled() and x.requires_grad):
        return x.contiguous()
    return session_tensor(workspace, key, x.shape, x.dtype, x.device).copy_(x)


def unobserved(x: torch.Tensor, modules: Sequence[nn.Module]) -> bool:
    """Whether a forward of ``modules`` on ``x`` may be computed into a session's workspace (``linear_in``,
    ``vitlens.families.timm_vit.mlp_in_workspace``): no gradients, no autocast on ``x``'s device, and no hook that
    could see or keep its tensors (a forward hook or pre-hook on one of ``modules``, or a global one)."""
    return not (torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or any(mod._forward_hooks or mod._forward_pre_hooks for mod in modules))


def linear_in(workspace: dict | None, key: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a plain ``nn.Linear`` computed into ``workspace[key]`` (``session_buffer``; valid until the
    next call under that key): ``addmm(bias, x as rows, weight^T)``, the product torch's own linear runs for a
    contiguous input with a bias (``mm`` without one), so the same numbers (tested bit for bit). Anything else (no
    workspace, another module or dtype, gradients, autocast, hooks on the layer or global ones) is ``layer(x)``."""
    if (workspace is None or type(layer) is not nn.Linear or x.dim() < 2 or not x.is_contiguous()
            or x.dtype != layer.weight.dtype or x.device != layer.weight.device or not unobserved(x, (layer,))):
        return layer(x)
    rows = x.reshape(-1, x.shape[-1])
    out = session_tensor(workspace, key, (rows.shape[0], layer.out_features), x.dtype, x.device)
    if layer.bias is None:
        torch.mm(rows, layer.weight.t(), out=out)
    else:
        torch.addmm(layer.bias, rows, layer.weight.t(), out=out)
    return out.view(*x.shape[:-1], layer.out_features)


PROBS_BUFFER = "probs"
"""The workspace key of the probabilities' buffer (``attention_probs_in_rows``). Between one layer's attention and the
next nothing in it is read (a block of probabilities is valid during its ``on_probs`` call only), so a block's other
passing activations may be made there (``vitlens.families.timm_vit.mlp_in_workspace``: the MLP's hidden activation)."""

QKV_BUFFER = "qkv"
"""The workspace key of a block's q, k, v projection (``linear_in``): free once the attention's output is made (the
keys and values are copied, the queries scaled into buffers of their own), so the block's MLP output may be made
there (``vitlens.families.timm_vit.mlp_in_workspace``)."""

ROW_ALIGN = 16
"""Floats a padded row's stride is a multiple of (``padded_row_stride``): 64 bytes, a cache line and an AVX-512
vector, the alignment torch gives a CPU tensor's memory."""


def padded_row_stride(tokens: int, device: torch.device) -> int:
    """The row stride of the probabilities' buffer in ``attention_probs_in_rows``: ``tokens`` rounded up to a
    multiple of ``ROW_ALIGN`` where the native softmax pass runs on the CPU (``compiled_wanted``: it reads strided
    rows; ATen's softmax would copy them), else ``tokens`` (contiguous).

    Rule: a ViT's T = 1 + (patches) is odd, so a contiguous [rows, T] block starts every row at another offset in a
    cache line, and the products q k^T and P v run slower on unaligned rows; with every row starting on a cache
    line they run at the speed of an aligned T (docs/performance.md, round three). The numbers are the same: only
    where each row lives changes (the padding is never read)."""
    if tokens % ROW_ALIGN == 0 or not compiled_wanted(device, tokens):
        return tokens
    return -(-tokens // ROW_ALIGN) * ROW_ALIGN


def attention_probs_in_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    query_rows: int | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    biases: Sequence[torch.Tensor | RowBias] = (),
    scale_after: bool = False,
    workspace: dict | None = None,
    taps: TapsFor | None = None,
) -> Iterator[tuple[torch.Tensor, slice | None]]:
    """``attention_probs`` a block of ``query_rows`` queries at a time: yields (probs [B, heads, rows,
    T], rows slice), so no [B, heads, T, T] map need exist at once. Each row's numbers are those of
    the whole computation (the same products and softmax over the same keys). ``query_rows`` None
    (or >= T), and causal attention, give one block of every row (rows None: a fresh tensor).

    The blocks of a layer are computed into one buffer (a fresh [B, heads, rows, T] tensor per block
    cost a third of a block's work at 768 px in page faults alone), so a yielded block is valid until
    the next one is asked for: what a caller keeps, it copies (the engine's consumer protocol says so).
    ``workspace``: a dict the caller keeps for a capture session, where that buffer stays from layer to
    layer and forward to forward (grown when a larger one is needed); with it, ``query_rows >= T``
    gives one block ``slice(0, T)`` in that buffer too (a whole map's fresh 28 MB per layer at 224 px,
    batch 16, is page faults again).

    Args:
        q: [B, heads, T, head_dim] queries, as for ``attention_probs``.
        k: [B, heads, T, head_dim] keys.
        scale: the module's ``scale``.
        query_rows: queries per block (None: one block of every row).
        attn_mask: as for ``attention_probs``.
        is_causal: as for ``attention_probs``.
        biases: as for ``attention_probs`` (a tensor with T query rows is sliced to each block's; a ``RowBias`` is
            called with each block's rows).
        scale_after: as for ``attention_probs``.
        workspace: the caller's dict for the session's buffer (above), or None.
        taps: asked before each block (in a workspace's buffer) for what its softmax pass should also compute for
            the views (``TapsFor``; ``attention_probs``'s ``taps``).

    Yields:
        ``(probs, rows)``: probs [B, heads, rows, T] float32 (valid until the next block), rows the slice
            of query indices it holds (None for one fresh block of every row, without a workspace).
    """
    t = q.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if not query_rows or is_causal or (query_rows >= t and (workspace is None or grad)):
        yield attention_probs(q, k, scale, attn_mask, is_causal, biases, scale_after), None
        return
    query_rows = min(int(query_rows), t)

    def rows_of(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
        return x[..., rows, :] if x is not None and x.dim() >= 2 and x.shape[-2] == t else x

    def bias_rows(bias: torch.Tensor | RowBias, rows: slice) -> torch.Tensor | RowBias:
        if callable(bias):
            return lambda scores, _all: bias(scores, rows)
        return cast(torch.Tensor, rows_of(bias, rows))

    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    # rows padded to an aligned stride where q and k share their leading shape (one batched product fills the block)
    ld = padded_row_stride(t, q.device) if q.shape[:-2] == k.shape[:-2] == lead else t
    # one float32 copy of the keys for all of the layer's blocks, stored transposed: k is a strided view of the fused
    # qkv projection, which each block's product would otherwise copy again, and q k^T runs faster from a
    # contiguous k^T [B, heads, head_dim, T] than from a transposed view of k; where the rows are padded, k^T is too
    # (zeros past T), so that each product writes whole padded rows (``attention_probs``'s ``padded_keys``)
    padded_keys = None
    if ld > t and not grad:
        padded_keys = session_tensor(workspace, "keys", (*k.shape[:-2], k.shape[-1], ld), torch.float32, k.device)
        padded_keys[..., t:].zero_()
        k = padded_keys[..., :t].copy_(k.transpose(-2, -1)).transpose(-2, -1)
    else:
        k = session_copy(workspace, "keys", k.float().transpose(-2, -1)).transpose(-2, -1)
    flat = None if grad else session_buffer(workspace, PROBS_BUFFER, lead.numel() * query_rows * ld, torch.float32,
                                            q.device)
    for start in range(0, t, query_rows):
        rows = slice(start, min(t, start + query_rows))
        out = None if flat is None else flat[:lead.numel() * (rows.stop - start) * ld].view(
            *lead, rows.stop - start, ld)[..., :t]
        tap = taps(rows, tuple(out.shape)) if taps is not None and out is not None else None
        yield attention_probs(q[..., rows, :], k, scale, rows_of(attn_mask, rows), False,
                              [bias_rows(b, rows) for b in biases], scale_after, out=out, taps=tap,
                              workspace=workspace, padded_keys=padded_keys), rows


def attention_output_in_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    query_rows: int | None,
    on_probs: Callable[[torch.Tensor, "slice | None"], None],
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    drop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    workspace: dict | None = None,
    taps: TapsFor | None = None,
    biases: Sequence[torch.Tensor | RowBias] = (),
) -> torch.Tensor:
    """A block's non-fused attention output ``softmax(q * scale @ k^T + mask) @ v`` computed
    ``query_rows`` queries at a time, handing each block of probabilities to ``on_probs(probs,
    rows)`` before it is multiplied by ``v`` (inline capture by query rows: every attention view,
    Fig. 6 and Fig. 7 right, at any T without a [B, heads, T, T] map and without computing the
    probabilities twice). Returns [B, heads, T, head_dim] (a view of a [B, T, heads, head_dim]
    tensor, so the usual ``transpose(1, 2).reshape(B, T, heads * head_dim)`` costs nothing).

    The probabilities are ``attention_probs_in_rows``'s, float32 (a block is valid during its
    ``on_probs`` call only); ``drop`` (the module's attention dropout) is applied to each block
    before the product, which runs in ``v``'s dtype. Each output row is that of the whole
    product up to float rounding (the same terms; BLAS may block the sums differently).
    ``workspace``, ``taps`` and ``biases``: as for ``attention_probs_in_rows`` (the probabilities' buffer kept across
    layers; what each block's softmax pass computes for the views; the scores' biases before the mask); with a
    workspace (and no gradients) the values' copy and the output are made in it too, so the returned tensor is valid
    until the next call with that workspace.
    """
    b, h, t, d = v.shape
    # one contiguous copy of the values for all blocks: v is a strided view of the fused qkv projection,
    # which each block's product would otherwise copy again (a 28 MB copy per block at 768 px, batch 4); it and the
    # output live in the workspace (fresh memory costs its page faults every layer)
    v = session_copy(workspace, "values", v)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out = v.new_empty(b, t, h, d) if workspace is None or grad else \
        session_tensor(workspace, "output", (b, t, h, d), v.dtype, v.device)
    for probs, rows in attention_probs_in_rows(q, k, scale, query_rows, attn_mask, is_causal, biases,
                                               workspace=workspace, taps=taps):
        on_probs(probs, rows)
        p = drop(probs) if drop is not None else probs
        p = p.to(v.dtype)
        block = torch.matmul(p, v) if workspace is None or grad else torch.matmul(  # [B, heads, rows, d]
            p, v, out=session_tensor(workspace, "block", (*p.shape[:-1], d), v.dtype, v.device))
        if rows is None:
            out.copy_(block.transpose(1, 2))
        else:
            out[:, rows].copy_(block.transpose(1, 2))
        del probs, p
    return out.transpose(1, 2)
