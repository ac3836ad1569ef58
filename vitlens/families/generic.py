"""Generic call-level capture: the fallback for a global-attention ViT whose attention no family names.

A model is read this way when no family matches it (or when the family that matches refuses only its
attention class) and a layout (``vitlens.families.common.layouts``) finds its pieces: one convolution that cuts
the image into patches (its stride is the token stride) and, in every block, one attention module. The
layouts: a timm-style ViT (``patch_embed.proj``, ``blocks[i].attn``), a Hugging Face vision model run with
``attn_implementation="sdpa"`` (DINOv3, AIMv2, Data2Vec-Vision, BEiT, ...), and open_clip's
``VisionTransformer`` with open_clip's own ``Attention`` blocks. Whatever that
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

A block whose attention makes no SDPA call (eager-only: transformers' BLIP and GIT vision towers, a module written
with ``softmax(q k^T) v``) is read at its one softmax call instead: the model's own tensor, as returned, provided a
matrix product then takes that very tensor (same storage and shape; dropout in eval hands it on) as its left
operand, i.e. it is the map applied to the values; a softmax changed before the product (talking heads) or several
softmax calls (a differential pair) are refused. A block whose attention makes more than one SDPA call, or neither
one SDPA call nor one applied softmax, is refused when the model is read (a probe
forward at the built size) and again at capture, naming the block. So are queries and keys of different
lengths (pooled or cross attention) and a token count that is not the prefix tokens plus the patch grid.

Token geometry: the grid from the convolution's arithmetic at the input size (checked against the grid the
model declares, timm's ``patch_embed.grid_size``, a config's ``image_size // patch_size``), the prefix count
as the probe forward's tokens minus the grid's cells, checked against the prefix tokens the model declares
(timm's ``num_prefix_tokens`` or ``cls_token`` / ``dist_token`` / ``reg_token``; a transformers embedding's
class, distillation and register tokens; open_clip's class embedding). Windowed attention (Swin, SAM) and CaiT's class
attention have families of their own; XCiT's cross-covariance attention stays refused by name before this fallback is
tried.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.tokens import Cell, ImageTokens, TokenLayout, packed_images, packed_layout
from ..errors import InvalidParameterError, UnsupportedModelError, ViewNotAvailableError, VitlensError
from ..kinds import HYBRID, VIT
from .base import CaptureAbilities, CaptureRequest, Family, Handles, prefix_labels, register
from .common import layouts_hf  # noqa: F401  (registers the Hugging Face layout)
from .common.call_capture import (
    FOUND_PREFIX,
    FOUND_TOKENS,
    PACKING,
    STATED_LAYOUTS,
    install_call_capture,
    layout_or_refuse,
    pixel_channels,
)
from .common.hf import CLIP_MEAN, CLIP_STD, HALF, IMAGENET_MEAN, IMAGENET_STD, HfTypes, ProcessorDefaults
from .common.layouts import Layout, layout_of


def state_token_layout(model: nn.Module, layout: TokenLayout) -> None:
    """Record the token layout the user states for ``model`` (checked against its attention when its spec is read)."""
    if not isinstance(layout, TokenLayout):
        raise InvalidParameterError(f"token_layout= takes a vitlens TokenLayout (vitlens.core.tokens); got "
                                    f"{type(layout).__name__}.")
    STATED_LAYOUTS[model] = layout


def _declared_prefix(model: nn.Module) -> int | None:
    """The prefix tokens the model declares (its layout's ``declared_prefix``; None when it declares none)."""
    layout = layout_of(model)
    return layout.declared_prefix(model) if layout is not None else None


def _stem_grid(model: nn.Module, layout: Layout, proj: nn.Module, name: str,
               size: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """A hybrid's token grid and stride in input pixels: the patch convolution's output grid in a forward of a zero
    image at ``size`` (after the CNN stem), and ``size`` / grid, which must divide exactly.

    Raises:
        UnsupportedModelError: the grid does not divide the input size (no one pixel stride per token).
    """
    seen: list[tuple[int, int]] = []
    handle = proj.register_forward_hook(lambda _m, _i, out: seen.append((int(out.shape[-2]), int(out.shape[-1]))))
    param = next(model.parameters(), None)
    x = torch.zeros(1, pixel_channels(layout, model), *size, device=param.device if param is not None else "cpu",
                    dtype=param.dtype if param is not None and param.is_floating_point() else torch.float32)
    try:
        with torch.no_grad():
            layout.forward(model, x)
    finally:
        handle.remove()
    grid = seen[0]
    if any(int(s) % g for s, g in zip(size, grid)):
        raise UnsupportedModelError(f"{name!r}: its CNN stem makes a {grid[0]}x{grid[1]} grid of {size[0]}x{size[1]} "
                                    "px, which is no whole pixel stride per token.")
    return grid, (int(size[0]) // grid[0], int(size[1]) // grid[1])


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


class GenericCallCapture(Family):
    """The fallback family: global-attention ViTs whose attention ends in one ``scaled_dot_product_attention`` call
    per block, found by a layout (``vitlens.families.common.layouts``: timm-style, Hugging Face, OpenCLIP)."""

    name = "generic"
    summary = ("global-attention ViTs whose attention ends in one scaled_dot_product_attention call per block "
               "(generic call-level capture: timm-style models, Hugging Face DINOv3/AIMv2/Data2Vec/BEiT on sdpa, "
               "OpenCLIP towers of open_clip's own Attention)")
    #: how ``LoadedModel``'s repr says which path the blocks take
    path = "generic call-level capture"
    fallback = True
    # side capture computes by query rows (attention_probs_in_rows); inline replaces the fused kernel by a whole
    # map, while side leaves it and can go by rows
    capture = CaptureAbilities(view_mode="side", side_rows=True)
    attention_inputs = ("norm1", "layernorm_before", "layer_norm1", "ln_1")  # timm-style, Hugging Face, OpenCLIP
    reads = ("generic call-level capture (fallback): a global-attention ViT whose attention no family names, read at "
             "its one scaled_dot_product_attention call per block (RoPE, relative-position bias, learned biases, "
             "qk-norm included): a timm-style ViT (patch_embed with a convolution, blocks[i].attn), a Hugging Face "
             "vision model on attn_implementation='sdpa' (DINOv3, AIMv2, Data2Vec-Vision, BEiT), an OpenCLIP tower "
             "of open_clip's own Attention blocks (qk-norm, head scale)")
    names = ("timm names: vit_relpos_base_patch16_224, vit_srelpos_small_patch16_224; hf:ORG/NAME of DINOv3, AIMv2, "
             "Data2Vec-Vision, BEiT; your own attention class in a timm-style model",)
    #: the transformers model types whose image processors it knows (read at their SDPA calls, so loaded on sdpa);
    #: another type the Hugging Face layout finds is read too, preprocessed as ``HuggingFaceLayout`` says
    hf_types = HfTypes(processors={
        "dinov3_vit": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bilinear"),
        "aimv2_vision_model": ProcessorDefaults("center", 1.0, CLIP_MEAN, CLIP_STD, "bicubic"),
        "data2vec-vision": ProcessorDefaults("squash", 1.0, HALF, HALF, "bicubic"),
        "beit": ProcessorDefaults("squash", 1.0, HALF, HALF, "bicubic")})

    def matches(self, model: nn.Module) -> bool:
        return layout_of(model) is not None

    def check(self, model: nn.Module, name: str) -> None:
        layout_or_refuse(model, name).check(model, name)

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        layout = layout_or_refuse(model, name)
        patches = layout.patch_embedding(model)
        size = layout.image_size(model, name, input_size)
        grid, stride = patches.grid(size), patches.stride
        # a hybrid: the CNN stem's stride (times the projection's) is the token stride
        if layout.stem(model) is not None:
            grid, stride = _stem_grid(model, layout, patches.module, name, size)
        declared_grid = layout.declared_grid(model)
        if declared_grid is not None and input_size is None and tuple(declared_grid) != grid:
            raise UnsupportedModelError(
                f"{name!r}: the {declared_grid[0]}x{declared_grid[1]} patch grid it declares is not the "
                f"{grid[0]}x{grid[1]} grid its convolution makes of {size[0]}x{size[1]} px, so vitlens could not infer "
                "the token grid.")
        tokens, heads = probe(model, name, size)
        prefix = tokens - grid[0] * grid[1]
        declared = layout.declared_prefix(model)
        order = STATED_LAYOUTS.get(model) or layout.token_layout(model, grid)
        if model in STATED_LAYOUTS:
            stated = STATED_LAYOUTS[model]
            stated.check_count(tokens)
            if stated.grids != (grid,):
                raise InvalidParameterError(
                    f"{name!r}: the stated token layout's grids {list(stated.grids)} are not the {grid[0]}x{grid[1]} "
                    "grid of its patch embedding; state one image's layout on that grid.")
            declared = prefix = stated.num_prefix
        if prefix < 0 or (declared is not None and declared != prefix):
            raise UnsupportedModelError(
                f"{name!r}: its blocks attend over {tokens} tokens, which is not the {grid[0]}x{grid[1]} patch grid "
                f"plus {declared if declared is not None else 'a number of'} prefix tokens, so vitlens could not "
                "infer the token geometry.")
        verify_patch_order(model, name, size, prefix, grid, order)
        FOUND_PREFIX[model] = prefix
        if order is not None and not order.is_standard:
            order.check_count(tokens)
            FOUND_TOKENS[model] = order
        cls, dist, registers = layout.prefix_parts(model)
        labels = prefix_labels(cls, dist, registers) if int(cls) + int(dist) + registers == prefix else ()
        if order is not None:
            labels = order.prefix_labels()
        pos = layout.position_rows(model)
        table = _table_grid(int(pos.shape[1]), grid, prefix) if pos is not None else None
        return ModelSpec(
            name=name, kind=(VIT if layout.stem(model) is None else HYBRID).name, image_size=size, grid=grid,
            stride_px=stride, num_prefix_tokens=prefix,
            num_layers=len(layout.attention_modules(model)), num_heads=heads,
            embed_dim=layout.embed_dim(model), has_class_token=cls and prefix > 0,
            has_pos_embed=table is not None, pos_embed_prefix=table[0] if table is not None else 0,
            num_classes=layout.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=layout.dynamic(model), family=self.name, prefix_labels=labels,
            token_order=order.describe() if order is not None and not order.is_standard else "")

    def packed_forward(self, model: nn.Module, images: Sequence[torch.Tensor]) -> list[ImageTokens] | None:
        """One forward of preprocessed images [C, H_i, W_i] of different sizes packed in one sequence, as the model
        packs them (Pixtral: padded to the largest, with their sizes; a block-diagonal mask keeps each image's
        attention to itself), under whatever capture is installed; None for a model that does not pack.

        Returns:
            Where each image's tokens stand in the captured [1, heads, T, T] maps (``core.tokens.packed_layout``: each
                image's cells row-major, images in order).

        Raises:
            InvalidParameterError: an image whose sides are not whole multiples of the patch stride.
        """
        layout = layout_or_refuse(model)
        if not layout.packs(model):
            return None
        patches = layout.patch_embedding(model)
        for i, img in enumerate(images):
            if img.dim() != 3 or int(img.shape[0]) != patches.in_channels or \
                    any(int(s) % st for s, st in zip(img.shape[-2:], patches.stride)):
                raise InvalidParameterError(
                    f"image {i} is of shape {tuple(img.shape)}; packed images are preprocessed tensors "
                    f"[{patches.in_channels}, H, W] whose sides are multiples of the patch stride {patches.stride}.")
        pack = packed_layout(tuple(patches.grid(img.shape[-2:]) for img in images))
        PACKING[model] = pack
        try:
            with torch.no_grad():
                layout.packed_forward(model, images)
        finally:
            PACKING.pop(model, None)
        return packed_images(pack)

    def tower(self, model: nn.Module) -> nn.Module:
        """The submodule the layout reads (a transformers model's vision tower, open_clip's ``visual``)."""
        return layout_or_refuse(model).tower(model)

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(layout_or_refuse(model).attention_modules(model))

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_call_capture(model, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_call_capture(model, capture, handles)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        layout_or_refuse(model).install_pool(model, capture, handles, type(model).__name__)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return None  # the heads' outputs meet where the attention class decides; vitlens does not know where

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        layout = layout_or_refuse(model)
        stem = layout.stem(model)
        if stem is not None:
            conv = next((m for m in stem.modules() if isinstance(m, nn.Conv2d)), None)
            if conv is None:
                raise ViewNotAvailableError(f"{spec.name}: the hybrid's CNN stem has no convolution to show.")
            return conv_filters(conv, layout.module_name(model, conv), "the CNN stem's first convolution; the "
                                "hybrid's own patch embedding acts on CNN channels, not pixels", spec.name)
        patches = layout.patch_embedding(model)
        if patches.kind == "conv2d":
            return conv_filters(patches.module, layout.module_name(model, patches.module), "the patch embedding E",
                                spec.name)
        w = patches.filters()
        where = layout.module_name(model, patches.weight_module)
        d, c, kh, kw = w.shape
        return w, where, (f"{where}: {d} filters of {kh}x{kw}x{c}, the patch embedding E (a linear layer over "
                          "unfolded patches, its rows read as filters of the pixels)")

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = layout_or_refuse(model).position_rows(model) if spec.has_pos_embed else None
        found = _table_grid(int(pos.shape[1]), spec.grid, spec.num_prefix_tokens) if pos is not None else None
        if pos is None or found is None:
            return None
        rows, table_grid = found
        return pos.detach()[:, rows:], table_grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("it has no learned absolute position table vitlens can read; position may live in its attention "
                "(relative bias, rotary embeddings) or in a fixed sin-cos table")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return layout_or_refuse(model).data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layout_or_refuse(model).logits(model, x)


def verify_patch_order(model: nn.Module, name: str, size: tuple[int, int], prefix: int,
                       grid: tuple[int, int], order: TokenLayout | None = None) -> None:
    """Check that the first block attends over the prefix tokens and then the patch tokens in row-major order:
    light up one patch at a time (the top-right and the bottom-left cell, which a transposed or reversed order would
    swap) and see which token of the first attention module's input changes. Only that cell's token may, at
    ``prefix + row * gw + column`` (or where ``order``, the model's declared token layout, puts it): a model that
    appends its class token, orders patches otherwise or mixes tokens
    before the first block is refused rather than have its maps read on the wrong grid cells.

    Skipped for a patch convolution whose kernel is not its stride or that pads (a cell's pixels then reach
    neighbouring tokens too), and when the first attention module is not called with a [B, T, D] tensor.

    Raises:
        UnsupportedModelError: another token than the cell's changes.
    """
    layout = layout_or_refuse(model, name)
    patches = layout.patch_embedding(model)
    if not patches.one_pixel_per_token or layout.stem(model) is not None:
        return  # (a hybrid's CNN stem spreads a cell's pixels to its neighbours' tokens)
    tokens = prefix + grid[0] * grid[1]
    seen: list[torch.Tensor] = []

    def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        named = next((kwargs[k] for k in ("hidden_states", "hidden_state", "x") if k in kwargs), None)
        first = args[0] if args else named if named is not None else \
            next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(_mod, nn.MultiheadAttention) and not _mod.batch_first and isinstance(first, torch.Tensor):
            first = first.transpose(0, 1)  # (sequence-first: BridgeTower's [T, B, D])
        if not seen and isinstance(first, torch.Tensor):
            seen.append(first.detach().float().clone())

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    sy, sx = patches.stride
    cells = [(0, grid[1] - 1), (grid[0] - 1, 0)] if grid[0] * grid[1] > 1 else [(0, 0)]
    hidden = []
    handle = layout.attention_modules(model)[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for cell in [None, *cells]:
            x = torch.zeros(1, patches.in_channels, *size, device=device, dtype=dtype)
            if cell is not None:
                x[..., cell[0] * sy:(cell[0] + 1) * sy, cell[1] * sx:(cell[1] + 1) * sx] = 1.0
            seen.clear()
            with torch.no_grad():
                layout.forward(model, x)
            hidden.append(seen[0] if seen else None)
    finally:
        handle.remove()
    hidden = [h[None] if h is not None and h.dim() == 2 else h for h in hidden]  # ([T, D]: Qwen3-VL's one sequence)
    if any(h is None or h.dim() != 3 or h.shape[:2] != (1, tokens) for h in hidden):
        return
    read = [h for h in hidden if h is not None]  # every one of them (just checked)
    for cell, h in zip(cells, read[1:]):
        changed = ((h - read[0]).abs().amax(-1)[0] > 0).nonzero().flatten().tolist()
        want = prefix + cell[0] * grid[1] + cell[1] if order is None else order.tokens.index(Cell(0, *cell))
        if changed != [want]:
            raise UnsupportedModelError(
                f"{name!r}: lighting up patch (row {cell[0]}, column {cell[1]}) changed token(s) {changed[:8]} of its "
                f"first block's input, not token {want} ({prefix} prefix tokens, then the {grid[0]}x{grid[1]} patches "
                "in row-major order), so vitlens would read its maps on the wrong grid cells.")


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

    layout = layout_or_refuse(model, name)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    x = torch.zeros(1, pixel_channels(layout, model), *size, device=device, dtype=dtype)
    handles = Handles()
    try:
        install_call_capture(model, CaptureRequest(record), handles, name=name, check_tokens=False)
        with torch.no_grad():
            layout.forward(model, x)
    except VitlensError:
        raise
    except ValueError as refusal:  # the model's own: it asks for more than pixels (text, a dataset index, ...)
        raise UnsupportedModelError(
            f"{name!r}: its forward refuses a {size[0]}x{size[1]} px image alone ({' '.join(str(refusal).split())}); "
            "vitlens runs a vision model on pixels only and cannot know other forward arguments.") from refusal
    finally:
        handles.remove()
    found = {seen[i] for i in seen}
    if len(seen) != len(layout.attention_modules(model)) or len(found) != 1:
        raise UnsupportedModelError(f"{name!r}: its blocks' attention calls attend over different token counts "
                                    f"({sorted(found)}), so vitlens could not infer one token geometry.")
    return found.pop()


register(GenericCallCapture())
