"""The generic call-level capture's reading of a block (the helper layer of ``vitlens.families.generic``): each block's
one ``scaled_dot_product_attention`` call read from its own arguments, the probabilities made beside it (side) or
handed on from the block's own softmax (inline), checked against the block's output, a packed sequence of images
unpacked into each image's own attention; and the layout (``common.layouts``) that finds a model's pieces, or a
one-line refusal naming the layouts it reads."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...core.attention import attention_probs, attention_probs_in_rows
from ...core.tokens import TokenLayout
from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles
from . import layouts_hf  # noqa: F401  (registers the Hugging Face layout)
from .layouts import Layout, layout_of
from .mha import install_block_inline, install_block_side
from .readers import SoftmaxApplied
from .sdpa_calls import CallMode, sdpa_arguments

#: the prefix count a model's probe forward found (for a capture of the raw module after ``spec``)
FOUND_PREFIX: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
#: a model whose tokens are not prefix then row-major cells: its declared order (``vitlens.core.tokens``)
FOUND_TOKENS: "weakref.WeakKeyDictionary[nn.Module, TokenLayout]" = weakref.WeakKeyDictionary()
#: the token layout a user stated for a model (``vl.load_model(module, token_layout=...)``), read by ``spec``
STATED_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, TokenLayout]" = weakref.WeakKeyDictionary()
#: images of different sizes packed in one sequence during ``packed_forward`` (Pixtral): their layout
PACKING: "weakref.WeakKeyDictionary[nn.Module, TokenLayout]" = weakref.WeakKeyDictionary()


def unpack_images(probs: torch.Tensor, images: int) -> torch.Tensor:
    """A packed sequence of ``images`` images of one size [1, heads, images * n, images * n] (block-diagonal mask) as
    a batch of each image's own attention [images, heads, n, n]: the diagonal blocks, each row's whole mass (the
    mask gives every other image's keys exactly zero probability)."""
    n = probs.shape[-1] // images
    return torch.cat([probs[:, :, i * n:(i + 1) * n, i * n:(i + 1) * n] for i in range(images)])

def layout_or_refuse(model: nn.Module, name: str | None = None) -> Layout:
    """The layout that reads ``model`` (``layouts.layout_of``), or a one-line refusal."""
    layout = layout_of(model)
    if layout is None:
        raise UnsupportedModelError(
            f"{name or type(model).__name__!r} has none of the layouts vitlens's generic call-level capture reads "
            "(one patch convolution and one attention module per block: timm-style patch_embed.proj and "
            "blocks[i].attn, a Hugging Face vision model's embeddings and layers, open_clip's conv1 and resblocks).")
    return layout

def pixel_channels(layout: Layout, model: nn.Module) -> int:
    """The image channels: the patch convolution's input channels, or a hybrid stem's first convolution's."""
    stem = layout.stem(model)
    first = next((m for m in stem.modules() if isinstance(m, nn.Conv2d)), None) if stem is not None else None
    return int(first.in_channels) if first is not None else layout.patch_embedding(model).in_channels

def install_call_capture(model: nn.Module, capture: CaptureRequest, handles: Handles, name: str | None = None,
                         check_tokens: bool = True) -> None:
    """Capture every block's attention at its ``F.scaled_dot_product_attention`` call (the module docstring).

    Each block's attention module (the layout's ``attention_modules``) runs, for the session, inside a
    ``CallMode`` that reads its one SDPA call; the patch convolution's output gives the patch tokens of the
    forward (its spatial positions), so the call's token count is verified against prefix + patches.

    Args:
        model: the model (a layout of ``vitlens.families.common.layouts`` matches it).
        capture: the capture's request: where the probabilities go, ``capture.mode`` ("inline": return ``P v``
            computed from the handed-over probabilities, detached unless ``capture.detach`` is False, instead
            of the fused call's output), and by how many query rows side capture computes them.
        handles: where the forwards and hooks are undone.
        name: the model's name, for messages.
        check_tokens: verify each call's tokens against prefix + patches (off for the probe that infers them).

    Raises:
        UnsupportedModelError: during a forward, a block making no SDPA call or more than one, or one
            whose call is not a self-attention over prefix + patch tokens.
    """
    name = name or type(model).__name__
    layout = layout_or_refuse(model, name)
    state: dict[str, Any] = {}
    prefix = FOUND_PREFIX.get(model, layout.declared_prefix(model)) if check_tokens else None
    tokens = FOUND_TOKENS.get(model) if check_tokens else None
    workspace: dict = {}
    patches = layout.patch_embedding(model)
    packs = layout.packs(model)  # the images of a batch in one sequence (Pixtral)
    per_image = layout.calls_per_image(model)  # one call per image of the batch (Qwen3-VL): the calls' maps, in order

    def patches_hook(_mod: nn.Module, _inp: tuple, out: Any) -> None:
        found = patches.tokens(out)  # [B, D, gh, gw] or [B, N, D]: the patch tokens of this forward
        if found is not None:
            state["patches"] = found
            state["images"] = int(out.shape[0]) if isinstance(out, torch.Tensor) else 1

    orders: dict[tuple[int, int], TokenLayout | None] = {}

    def grid_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        state["grid"] = forward_grid(patches, args, kwargs)

    def order_now() -> TokenLayout | None:
        """The declared order on this forward's grid: a dynamic model fed another size than its spec's (Qwen3-VL's
        merge blocks, Llama 4's class token last) has its layout rebuilt for that grid (a stated one is kept)."""
        grid = state.get("grid")
        if tokens is None or grid is None or grid == tuple(tokens.grids[0]) or model in STATED_LAYOUTS:
            return tokens
        if grid not in orders:
            orders[grid] = layout.token_layout(model, grid)
        return orders[grid]

    handles.hook(patches.module.register_forward_hook(patches_hook))
    handles.hook(layout.tower(model).register_forward_pre_hook(grid_hook, with_kwargs=True))
    handles.on_remove(state.clear)
    handles.on_remove(orders.clear)
    for layer, attn in enumerate(layout.attention_modules(model)):
        if isinstance(attn, nn.MultiheadAttention):  # (BridgeTower's tower): read from its own in-projection
            def check(probs: torch.Tensor, _layer: int = layer, _attn: nn.Module = attn) -> None:
                _verify(name, _layer, _attn, probs, probs, {"dropout_p": _attn.dropout if _attn.training else 0.0},
                        state.get("patches"), prefix)

            install = install_block_inline if capture.mode == "inline" else install_block_side
            install(attn, layer, capture, handles, check)
            continue
        original = attn.forward

        def forward(*args: Any, _layer: int = layer, _original: Callable = original, _attn: nn.Module = attn,
                    **kwargs: Any) -> Any:
            calls: list[int] = []
            maps: list[torch.Tensor] = []  # per_image: each image's call's map, handed over as one batch

            def on_call(a: tuple, kw: dict) -> torch.Tensor:
                calls.append(1)
                if len(calls) > 1 and not per_image:
                    raise UnsupportedModelError(
                        f"{name!r}: block {_layer}'s attention ({type(_attn).__name__}) calls "
                        "scaled_dot_product_attention more than once, so no single attention map is the one it "
                        "applies; vitlens's generic call-level capture reads one call per block.")
                call = sdpa_arguments(a, kw)
                q, k, v = call["query"], call["key"], call["value"]
                order = order_now()
                pack, images = (PACKING.get(model), state.get("images", 1)) if packs else (None, 1)
                if pack is not None:  # images of different sizes: the pack's tokens, handed over whole
                    _verify(name, _layer, _attn, q, k, call, len(pack), 0)
                elif packs:  # a batch of one size packed in one sequence: each image's block, as a batch
                    _verify(name, _layer, _attn, q, k, call, images * state.get("patches", 0), prefix)
                else:
                    _verify(name, _layer, _attn, q, k, call, state.get("patches"), prefix)
                scale = call["scale"] if call["scale"] is not None else q.shape[-1] ** -0.5
                mask, causal = call["attn_mask"], bool(call["is_causal"])
                if call["enable_gqa"] and k.shape[-3] != q.shape[-3]:
                    groups = q.shape[-3] // k.shape[-3]
                    k_rep = k.repeat_interleave(groups, dim=-3)
                    v_rep = v.repeat_interleave(groups, dim=-3)
                else:
                    k_rep, v_rep = k, v
                if capture.mode == "inline" or order is not None or packs or per_image:
                    with torch.autocast(device_type=q.device.type, enabled=False):
                        probs = attention_probs(q, k_rep, scale, mask, causal)
                    seen = probs.detach() if capture.detach or capture.mode != "inline" else probs
                    if packs and pack is None and images > 1:
                        seen = unpack_images(seen, images)
                    # the views read prefix then row-major cells: the model's own order, permuted (exact)
                    seen = order.to_canonical(seen) if order is not None else seen
                    if per_image:
                        maps.append(seen)
                    else:
                        capture(_layer, seen)
                    if capture.mode == "inline":
                        return (probs.to(v_rep.dtype) @ v_rep)
                    return F.scaled_dot_product_attention(*a, **kw)
                out = F.scaled_dot_product_attention(*a, **kw)
                with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
                    for item in attention_probs_in_rows(q, k_rep, scale, capture.query_rows, mask, causal,
                                                        workspace=workspace, taps=capture.taps_for(_layer)):
                        capture(_layer, *item)
                        del item
                return out

            softmax = SoftmaxApplied()
            with CallMode(on_call), softmax:
                result = _original(*args, **kwargs)
            if maps:
                if len({m.shape for m in maps}) != 1:
                    raise UnsupportedModelError(
                        f"{name!r}: block {_layer} attends over images of different sizes in one forward; run them "
                        "one by one (vl.analyze_each does).")
                capture(_layer, torch.cat(maps))
            if not calls:
                probs = _own_softmax(name, _layer, _attn, softmax, layout.fused_hint)
                _verify(name, _layer, _attn, probs, probs, {"dropout_p": 0.0}, state.get("patches"), prefix)
                detach = capture.detach or capture.mode != "inline"
                capture(_layer, probs.detach().float() if detach else probs)
            return result

        handles.set_attr(attn, "forward", forward)

def forward_grid(patches: Any, args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """The patch grid of a tower's forward from its inputs: the rows and columns of its ``grid_thw`` (one size for
    every image), else the patch embedding's grid of a [B, C, H, W] pixel batch; None when neither says it."""
    thw = kwargs.get("grid_thw")
    if isinstance(thw, torch.Tensor) and thw.dim() == 2 and thw.shape[0] > 0 and bool((thw == thw[0]).all()):
        return int(thw[0, 1]), int(thw[0, 2])
    pixels = kwargs.get("pixel_values", args[0] if args else None)
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4:
        return patches.grid(pixels.shape[-2:])
    return None

def _own_softmax(name: str, layer: int, attn: nn.Module, softmax: SoftmaxApplied, hint: str) -> torch.Tensor:
    """The probabilities of an attention that makes no SDPA call (eager-only: BLIP, GIT, a timm module off its
    fused path): the result of its one softmax call, which a matrix product then applies to the values as it is
    (``SoftmaxApplied``); the model's own tensor, read as returned.

    Raises:
        UnsupportedModelError: no softmax call, several, or one whose result is changed before it is applied.
    """
    where = f"{name!r}: block {layer}'s attention ({type(attn).__name__})"
    n = len(softmax.results)
    if n != 1:
        raise UnsupportedModelError(
            f"{where} made no scaled_dot_product_attention call and {n} softmax calls, so no single map is the one it "
            f"applies; vitlens reads one SDPA call or one softmax per block: {hint}.")
    if not softmax.applied[0] or softmax.results[0].dim() != 4:
        raise UnsupportedModelError(
            f"{where} made no scaled_dot_product_attention call, and its one softmax's result is not what it "
            "multiplies with the values (changed before the product, or not [batch, heads, tokens, tokens]), so "
            f"vitlens has nothing exact to read: {hint}.")
    return softmax.results[0]

def _verify(name: str, layer: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, call: dict,
            patches: int | None, prefix: int | None) -> None:
    """Refuse an SDPA call that is not one global self-attention over the image's tokens (in one line)."""
    where = f"{name!r}: block {layer}'s attention ({type(attn).__name__})"
    if q.dim() != 4 or k.dim() != 4:
        raise UnsupportedModelError(f"{where} calls scaled_dot_product_attention with queries of shape "
                                    f"{tuple(q.shape)}; vitlens reads [batch, heads, tokens, head_dim].")
    if q.shape[-2] != k.shape[-2]:
        raise UnsupportedModelError(f"{where} attends {q.shape[-2]} queries over {k.shape[-2]} keys (pooled or cross "
                                    "attention), not one attention over the image's tokens.")
    if float(call["dropout_p"] or 0.0) > 0:
        raise UnsupportedModelError(f"{where} calls scaled_dot_product_attention with dropout_p={call['dropout_p']} "
                                    "(a model in training mode): put the model in eval() first.")
    if patches is not None and prefix is not None and q.shape[-2] != prefix + patches:
        raise UnsupportedModelError(
            f"{where} attends over {q.shape[-2]} tokens, not the {prefix} prefix + {patches} patch tokens of the "
            "patch embedding (windowed, pooled or packed attention), so its maps would not be over the image's grid.")


__all__ = ["FOUND_PREFIX", "FOUND_TOKENS", "PACKING", "STATED_LAYOUTS", "install_call_capture", "layout_or_refuse",
           "pixel_channels", "unpack_images"]
