"""Generic call-level capture: the fallback for a timm-style ViT whose attention class no family names.

A model is read this way when no family matches it (or when the family that matches refuses only its
attention class) and it has the shape of a timm ViT: a ``patch_embed`` whose ``proj`` is a convolution
(its stride is the token stride) and a sequence ``blocks``, each with an ``attn`` module. Whatever that
module does before (rotary embeddings, relative-position or learned biases, qk-norm, gating), most
modern attention ends in one call of ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
attn_mask, dropout_p, is_causal, scale, enable_gqa)``, whose output is exactly ``P v`` with

    P = softmax(q k^T * scale + mask)

(``scale`` default ``1 / sqrt(head_dim)``; a boolean mask keeps the keys where it is True, a float mask
is added; ``is_causal`` masks future keys; ``enable_gqa`` repeats the key heads to the query heads). So
the captured maps are the attention the block applies to its values by construction, whatever came before.

While a block's ``attn`` module runs, a thread-local ``torch.overrides.TorchFunctionMode`` (the idea AttnLRP
uses, ``vitlens.attribution.lrp``) intercepts that call:

- side capture lets the real call produce the output (the model's outputs bit-for-bit those of a run
  without capture) and computes ``P`` beside it in float32 from the very arguments of the call;
- inline capture computes ``P`` once, hands it over and returns ``P v`` in place of the fused call (the
  output within float rounding of the fused one; with ``detach=False`` the maps are in the graph).

An explicit ``softmax`` is not read: what a module does with its probabilities after a softmax (talking
heads, a differential pair, dropout) is not visible from the call, whereas the SDPA call's output is ``P v``.
A block whose attention makes no SDPA call, or more than one, is refused when the model is read (a probe
forward at the built size) and again at capture, naming the block. So are queries and keys of different
lengths (pooled or cross attention) and a token count that is not the prefix tokens plus the patch grid.

Token geometry: the grid from the convolution's arithmetic at the input size (checked against
``patch_embed.grid_size`` where the module has one), the prefix count as the probe forward's tokens minus
the grid's cells, checked against ``num_prefix_tokens`` (or the ``cls_token`` / ``dist_token`` /
``reg_token`` parameters) where the model declares it. Windowed attention (Swin, SAM), CaiT's class
attention and XCiT's cross-covariance attention stay refused by name before this fallback is tried.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.attention import attention_probs, attention_probs_in_rows, conv_filters
from ..core.spec import ModelSpec
from ..errors import UnsupportedModelError
from .base import CaptureAbilities, CaptureRequest, Family, Handles, prefix_labels, refuse_other_size, register

#: the parameters of ``F.scaled_dot_product_attention`` in order, with their defaults
_SDPA_PARAMS = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
                ("is_causal", False), ("scale", None), ("enable_gqa", False))

#: the prefix count a model's probe forward found (for a capture of the raw module after ``spec``)
_PREFIX: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of one ``F.scaled_dot_product_attention`` call by name, defaults filled in.

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments.

    Returns:
        A dict with query, key, value, attn_mask, dropout_p, is_causal, scale and enable_gqa.
    """
    out = {}
    for i, (name, default) in enumerate(_SDPA_PARAMS):
        out[name] = args[i] if i < len(args) else kwargs.get(name, default)
    return out


class _CallMode(TorchFunctionMode):
    """While active (on this thread), hands every ``F.scaled_dot_product_attention`` call to ``on_call``;
    every other function runs as it is. Inside the handler the mode is off, so ``on_call``'s own calls
    (the real kernel, the probabilities) are not intercepted again."""

    def __init__(self, on_call: Callable[[tuple, dict], torch.Tensor]) -> None:
        super().__init__()
        self.on_call = on_call

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.on_call(args, kwargs)
        return func(*args, **kwargs)


def _declared_prefix(model: nn.Module) -> int | None:
    """The prefix tokens the model declares: ``num_prefix_tokens``, else its class / distillation / register
    token parameters (None when it declares none of them)."""
    n = getattr(model, "num_prefix_tokens", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    found = [getattr(model, a, None) for a in ("cls_token", "dist_token", "reg_token")]
    if not any(isinstance(t, torch.Tensor) for t in found):
        return None
    return sum(int(t.shape[1]) for t in found if isinstance(t, torch.Tensor) and t.dim() == 3)


def _conv_grid(proj: nn.Conv2d, hw: Sequence[int]) -> tuple[int, int]:
    """The output grid of the patch convolution for an input of ``hw`` pixels (PyTorch's conv arithmetic)."""
    out = []
    for i in range(2):
        pad = proj.padding[i] if isinstance(proj.padding, tuple) else 0
        out.append((int(hw[i]) + 2 * int(pad) - proj.dilation[i] * (proj.kernel_size[i] - 1) - 1) // proj.stride[i] + 1)
    return out[0], out[1]


def _table_grid(rows: int, grid: tuple[int, int], prefix: int) -> tuple[int, tuple[int, int]] | None:
    """(prefix rows, grid) of a ``pos_embed`` table of ``rows`` rows: the patch grid's cells after 0 or ``prefix``
    rows, else a square table (one the model resamples to the grid in its forward), else None (a layout
    vitlens does not know, so no position view rather than a wrong one)."""
    for lead in sorted({prefix, 0}, reverse=True):
        if rows - lead == grid[0] * grid[1]:
            return lead, grid
    for lead in sorted({prefix, 0}, reverse=True):
        side = int(round(max(rows - lead, 0) ** 0.5))
        if side > 0 and side * side == rows - lead:
            return lead, (side, side)
    return None


def install_call_capture(model: nn.Module, capture: CaptureRequest, handles: Handles, name: str | None = None,
                         check_tokens: bool = True) -> None:
    """Capture every block's attention at its ``F.scaled_dot_product_attention`` call (the module docstring).

    Each ``blocks[i].attn`` runs, for the session, inside a ``_CallMode`` that reads its one SDPA call;
    ``patch_embed``'s output gives the patch tokens of the forward, so the call's token count is verified
    against prefix + patches.

    Args:
        model: the model (``patch_embed``, ``blocks[i].attn``).
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
    state: dict[str, Any] = {}
    prefix = _PREFIX.get(model, _declared_prefix(model)) if check_tokens else None
    workspace: dict = {}

    def patches_hook(_mod: nn.Module, _inp: tuple, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dim() >= 3:
            state["patches"] = out.numel() // (out.shape[0] * out.shape[-1])

    handles.hook(model.patch_embed.register_forward_hook(patches_hook))
    handles.on_remove(state.clear)
    for layer, attn in enumerate(block.attn for block in model.blocks):
        original = attn.forward

        def forward(*args: Any, _layer: int = layer, _original: Callable = original, _attn: nn.Module = attn,
                    **kwargs: Any) -> Any:
            calls: list[int] = []

            def on_call(a: tuple, kw: dict) -> torch.Tensor:
                calls.append(1)
                if len(calls) > 1:
                    raise UnsupportedModelError(
                        f"{name!r}: block {_layer}'s attention ({type(_attn).__name__}) calls "
                        "scaled_dot_product_attention more than once, so no single attention map is the one it "
                        "applies; vitlens's generic call-level capture reads one call per block.")
                call = sdpa_arguments(a, kw)
                q, k, v = call["query"], call["key"], call["value"]
                _verify(name, _layer, _attn, q, k, call, state.get("patches"), prefix)
                scale = call["scale"] if call["scale"] is not None else q.shape[-1] ** -0.5
                mask, causal = call["attn_mask"], bool(call["is_causal"])
                if call["enable_gqa"] and k.shape[-3] != q.shape[-3]:
                    groups = q.shape[-3] // k.shape[-3]
                    k_rep = k.repeat_interleave(groups, dim=-3)
                    v_rep = v.repeat_interleave(groups, dim=-3)
                else:
                    k_rep, v_rep = k, v
                if capture.mode == "inline":
                    with torch.autocast(device_type=q.device.type, enabled=False):
                        probs = attention_probs(q, k_rep, scale, mask, causal)
                    capture(_layer, probs.detach() if capture.detach else probs)
                    return (probs.to(v_rep.dtype) @ v_rep)
                out = F.scaled_dot_product_attention(*a, **kw)
                with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
                    for item in attention_probs_in_rows(q, k_rep, scale, capture.query_rows, mask, causal,
                                                        workspace=workspace):
                        capture(_layer, *item)
                        del item
                return out

            with _CallMode(on_call):
                result = _original(*args, **kwargs)
            if not calls:
                raise UnsupportedModelError(
                    f"{name!r}: block {_layer}'s attention ({type(_attn).__name__}) made no "
                    "scaled_dot_product_attention call, so vitlens's generic call-level capture has nothing exact "
                    "to read (an explicit softmax is not read: what follows it is not visible). Enable the "
                    "module's fused path (timm: fused_attn=True) or write a family for it.")
            return result

        handles.set_attr(attn, "forward", forward)


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


class GenericCallCapture(Family):
    """The fallback family: timm-style ViTs whose attention ends in one ``scaled_dot_product_attention`` call."""

    name = "generic"
    #: how ``LoadedModel``'s repr says which path the blocks take
    path = "generic call-level capture"
    fallback = True
    # side capture computes by query rows (attention_probs_in_rows); inline replaces the fused kernel by a whole
    # map, while side leaves it and can go by rows
    capture = CaptureAbilities(view_mode="side", side_rows=True)
    attention_inputs = ("norm1",)
    reads = ("generic call-level capture (fallback): a timm-style ViT (patch_embed with a convolution, blocks[i].attn) "
             "whose attention no family names, read at its one scaled_dot_product_attention call per block: RoPE, "
             "relative-position bias (timm vit_relpos_*, vit_srelpos_*), learned biases or qk-norm included")
    names = ("timm names: vit_relpos_base_patch16_224, vit_srelpos_small_patch16_224; your own attention class in a "
             "timm-style model",)

    def matches(self, model: nn.Module) -> bool:
        pe = getattr(model, "patch_embed", None)
        blocks = getattr(model, "blocks", None)
        if not isinstance(getattr(pe, "proj", None), nn.Conv2d) or not isinstance(blocks, (nn.Sequential,
                                                                                              nn.ModuleList)):
            return False
        return len(blocks) > 0 and all(isinstance(getattr(b, "attn", None), nn.Module) for b in blocks)

    def check(self, model: nn.Module, name: str) -> None:
        if not self.matches(model):
            raise UnsupportedModelError(
                f"{name!r} has no patch_embed.proj convolution and blocks[i].attn modules, which vitlens's generic "
                "call-level capture needs.")
        if isinstance(getattr(model.patch_embed, "backbone", None), nn.Module):
            raise UnsupportedModelError(
                f"{name!r} embeds patches through a CNN backbone ({type(model.patch_embed).__name__}), whose pixel "
                "stride vitlens's generic call-level capture does not read from the projection; it reads a patch "
                "embedding that is one convolution of the pixels.")

    def _image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        built = getattr(model.patch_embed, "img_size", None)
        if built is not None and not getattr(model, "dynamic_img_size", False):
            refuse_other_size(name, self.name, built, input_size)
        size = input_size if input_size is not None else built
        if size is None:
            raise UnsupportedModelError(
                f"{name!r}: vitlens could not infer the input size (patch_embed has no img_size): pass "
                "data_config={'input_size': (3, H, W)}.")
        size = (int(size[0]), int(size[1])) if len(size) >= 2 else (int(size[0]), int(size[0]))
        return size

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe, proj = model.patch_embed, model.patch_embed.proj
        size = self._image_size(model, name, input_size)
        grid = _conv_grid(proj, size)
        declared_grid = getattr(pe, "grid_size", None)
        if declared_grid is not None and input_size is None and tuple(int(g) for g in declared_grid) != grid:
            raise UnsupportedModelError(
                f"{name!r}: patch_embed.grid_size {tuple(declared_grid)} is not the {grid[0]}x{grid[1]} grid its "
                f"convolution makes of {size[0]}x{size[1]} px, so vitlens could not infer the token grid.")
        tokens, heads = probe(model, name, size)
        prefix = tokens - grid[0] * grid[1]
        declared = _declared_prefix(model)
        if prefix < 0 or (declared is not None and declared != prefix):
            raise UnsupportedModelError(
                f"{name!r}: its blocks attend over {tokens} tokens, which is not the {grid[0]}x{grid[1]} patch grid "
                f"plus {declared if declared is not None else 'a number of'} prefix tokens, so vitlens could not "
                "infer the token geometry.")
        _PREFIX[model] = prefix
        cls = isinstance(getattr(model, "cls_token", None), torch.Tensor)
        dist = isinstance(getattr(model, "dist_token", None), torch.Tensor)
        reg = getattr(model, "reg_token", None)
        registers = int(reg.shape[1]) if isinstance(reg, torch.Tensor) and reg.dim() == 3 else \
            int(getattr(model, "num_reg_tokens", 0) or 0)
        labels = prefix_labels(cls, dist, registers) if int(cls) + int(dist) + registers == prefix else ()
        pos = getattr(model, "pos_embed", None)
        has_pos = isinstance(pos, torch.Tensor) and pos.dim() == 3 and _table_grid(int(pos.shape[1]), grid, prefix) \
            is not None
        return ModelSpec(
            name=name, kind="vit", image_size=size, grid=grid,
            stride_px=(int(proj.stride[0]), int(proj.stride[1])), num_prefix_tokens=prefix,
            num_layers=len(model.blocks), num_heads=heads,
            embed_dim=int(getattr(model, "embed_dim", proj.out_channels)), has_class_token=cls,
            has_pos_embed=has_pos,
            pos_embed_prefix=_table_grid(int(pos.shape[1]), grid, prefix)[0] if has_pos else 0,
            num_classes=int(getattr(model, "num_classes", 0) or 0),
            num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)), family=self.name, prefix_labels=labels)

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_call_capture(model, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_call_capture(model, capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return None  # the heads' outputs meet where the attention class decides; vitlens does not know where

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = getattr(model, "pos_embed", None)
        found = _table_grid(int(pos.shape[1]), spec.grid, spec.num_prefix_tokens) if spec.has_pos_embed else None
        if found is None:
            return None
        rows, table_grid = found
        return pos.detach()[:, rows:], table_grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("it has no learned absolute position table (pos_embed) vitlens can read; position may live in its "
                "attention (relative bias, rotary embeddings)")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        from timm.data import resolve_data_config

        cfg = dict(resolve_data_config({}, model=model))
        cfg["input_size"] = (int(model.patch_embed.proj.in_channels), *spec.image_size)
        names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
        if names:
            cfg["label_names"] = list(names)
        return cfg


def probe(model: nn.Module, name: str, size: tuple[int, int]) -> tuple[int, int]:
    """One forward of a zero image at ``size`` through the call-level capture: every block must make one
    SDPA self-attention call over the same tokens.

    Args:
        model: the model (in eval mode).
        name: its name, for messages.
        size: (H, W) input pixels.

    Returns:
        (tokens, heads) of the blocks' attention.

    Raises:
        UnsupportedModelError: a block makes no SDPA call or more than one, or the blocks disagree on tokens.
    """
    seen: dict[int, tuple[int, int]] = {}

    def record(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        seen[layer] = (int(probs.shape[-1]), int(probs.shape[1]))

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    x = torch.zeros(1, int(model.patch_embed.proj.in_channels), *size, device=device, dtype=dtype)
    handles = Handles()
    try:
        install_call_capture(model, CaptureRequest(record), handles, name=name, check_tokens=False)
        with torch.no_grad():
            model(x)
    finally:
        handles.remove()
    found = {seen[i] for i in seen}
    if len(seen) != len(model.blocks) or len(found) != 1:
        raise UnsupportedModelError(f"{name!r}: its blocks' attention calls attend over different token counts "
                                    f"({sorted(found)}), so vitlens could not infer one token geometry.")
    return found.pop()


register(GenericCallCapture())
