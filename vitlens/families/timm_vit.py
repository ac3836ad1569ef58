"""timm's ``VisionTransformer``: plain ViTs, DeiT (distillation token), register models, GAP/MAP
heads without a class token, R50 and other hybrids, non-square and dynamic input sizes, and
ViT-22B-style parallel blocks (``ParallelScalingBlock``, e.g. ``vit_base_patch16_xp_224``).

Attention of timm's ``Attention`` is ``softmax(q_norm(q) * scale @ k_norm(k)^T + mask)``. Side
capture hooks ``q_norm`` and ``k_norm``, whose outputs are the very queries and keys the fused
kernel receives; inline capture turns ``fused_attn`` off and reads the probabilities as they
enter ``attn_drop``.

A ``ParallelScalingBlock`` has no attention module: one fused ``in_proj`` makes the MLP input
and q, k, v together, and the block itself computes the same softmax(q_norm(q) * scale @
k_norm(k)^T + mask). Its ``q_norm`` / ``k_norm`` act on [B, T, heads, head_dim] before the
transpose to [B, heads, T, head_dim], so side capture hooks them there and transposes as the
block does; inline capture turns the block's ``fused_attn`` off and reads its ``attn_drop`` input.
The block's ``attn_drop`` stands for its attention module (its parent is the block), and the heads
meet at the input of ``attn_out_proj`` (none when the block fuses the attention and MLP output
projections into one ``out_proj``: head ablation is then refused).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.attention import attention_output_in_rows, attention_probs_in_rows, conv_filters
from ..core.spec import ModelSpec
from ..kinds import HYBRID, VIT, kind_of
from .base import (AttentionClassUnknown, CaptureAbilities, CaptureRequest, Emit, Family, Handles, prefix_labels,
                   refuse_other_size, register)


def inline_at_attn_drop(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> None:
    """Inline capture for timm attention modules with a ``fused_attn`` switch and ``attn_drop``:
    the non-fused path's probabilities, as they enter dropout."""
    for layer, attn in enumerate(modules):
        def drop_pre_hook(_mod: nn.Module, args: tuple, layer: int = layer) -> None:
            capture(layer, args[0].detach() if capture.detach else args[0])

        handles.set_attr(attn, "fused_attn", False)
        handles.hook(attn.attn_drop.register_forward_pre_hook(drop_pre_hook))


def inline_in_rows(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> None:
    """Inline capture by query rows for timm's standard ``Attention``: each module's forward is, for
    the session, timm's non-fused path computed ``capture.query_rows`` queries at a time
    (``attention_output_in_rows``), every block of probabilities emitted as it is made and then
    multiplied by v. No [B, heads, T, T] map exists and the probabilities are computed once (side
    capture computes them a second time beside the fused kernel). The output is the non-fused
    path's up to float rounding; under autocast the probabilities are float32 and the product
    with v runs in v's dtype."""
    rows, detach = capture.query_rows, capture.detach
    workspace: dict = {}  # the probabilities' buffer, shared by every block for the session
    for layer, attn in enumerate(modules):
        def forward(x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    attn: nn.Module = attn, layer: int = layer,
                    taps: Callable[[slice, tuple], Any] | None = capture.taps_for(layer)) -> torch.Tensor:
            def on_probs(probs: torch.Tensor, block: slice | None) -> None:
                capture(layer, probs.detach() if detach else probs, block)

            b, n, _ = x.shape
            gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
            qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            q, k = attn.q_norm(q), attn.k_norm(k)
            with torch.autocast(device_type=x.device.type, enabled=False):
                out = attention_output_in_rows(q, k, v, attn.scale, rows, on_probs, attn_mask, is_causal,
                                               attn.attn_drop, workspace, taps=taps)
            out = attn.norm(out.transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim))
            if gate is not None:
                out = out * gate
            return attn.proj_drop(attn.proj(out))

        handles.set_attr(attn, "forward", forward)


def timm_data_config(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """timm's resolved data config at the spec's input size, with class names when known."""
    from timm.data import resolve_data_config

    cfg = dict(resolve_data_config({}, model=model))
    cfg["input_size"] = (3, *spec.image_size)
    names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
    if names:
        cfg["label_names"] = list(names)
    return cfg


def timm_position_table(model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """A timm model's ``pos_embed`` patch rows on its patch grid (None when it has no table)."""
    pos = getattr(model, "pos_embed", None)
    if pos is None:
        return None
    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    return pos.detach()[:, pos.shape[1] - grid[0] * grid[1]:], grid  # type: ignore[return-value]


def first_conv(module: nn.Module, prefix: str) -> tuple[str, nn.Conv2d] | None:
    found = next(((n, mod) for n, mod in module.named_modules() if isinstance(mod, nn.Conv2d)), None)
    return (f"{prefix}.{found[0]}", found[1]) if found else None


class TimmFamily(Family):
    """What timm's ViT-like models share: ``patch_embed``, ``blocks[i].attn`` with ``fused_attn`` and
    ``attn_drop``, a ``pos_embed`` table, prefix tokens, and timm's data config. Subclasses say how
    their attention is computed (``check``, ``install_side``) and what else differs."""

    attention_inputs = ("norm1", "in_norm")  # a Block's pre-attention norm; a ParallelScalingBlock's shared one

    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        if not getattr(model, "dynamic_img_size", False):  # a dynamic model is read at any size (grid_for)
            refuse_other_size(name, self.name, pe.img_size, input_size)
        grid = tuple(int(g) for g in pe.grid_size)
        pos = getattr(model, "pos_embed", None)
        pos_prefix = 0 if (pos is None or getattr(model, "no_embed_class", False)) else \
            int(pos.shape[1]) - grid[0] * grid[1]
        return ModelSpec(
            name=name, kind=self.kind(model),
            image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            grid=grid,  # type: ignore[arg-type]
            stride_px=self.stride(model),
            num_prefix_tokens=int(model.num_prefix_tokens), num_layers=len(model.blocks),
            num_heads=int(getattr(model.blocks[0], "attn", model.blocks[0]).num_heads),
            embed_dim=int(model.embed_dim),
            has_class_token=getattr(model, "cls_token", None) is not None, has_pos_embed=pos is not None,
            pos_embed_prefix=pos_prefix, num_classes=int(getattr(model, "num_classes", 0)),
            num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)), family=self.name,
            prefix_labels=prefix_labels(getattr(model, "cls_token", None) is not None,
                                        getattr(model, "dist_token", None) is not None,
                                        _registers(model)))

    def kind(self, model: nn.Module) -> str:
        return VIT.name

    def stride(self, model: nn.Module) -> tuple[int, int]:
        return tuple(int(s) for s in model.patch_embed.patch_size)  # type: ignore[return-value]

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks]

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        inline_at_attn_drop(self.attention_modules(model), capture, handles)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """timm's MAP head (``AttentionPoolLatent``): softmax(q_norm(q(latent)) * scale @ k_norm(k(x))^T + mask),
        its latent queries over every token, read from its q_norm / k_norm as a block's."""
        from timm.layers import AttentionPoolLatent

        from ..errors import ViewNotAvailableError

        pool = getattr(model, "attn_pool", None)
        if type(pool) is not AttentionPoolLatent or pool.q_norm is pool.k_norm:
            what = f"its {type(pool).__name__}" if pool is not None else \
                f"global_pool={getattr(model, 'global_pool', '')!r}"
            raise ViewNotAvailableError(f"{type(model).__name__} pools with {what}, not timm's MAP head "
                                        "(AttentionPoolLatent), so there is no pool attention to show.")
        # VisionTransformer's pool reads the patch tokens only unless pool_include_prefix (Eva's reads every token):
        # the prefix tokens (registers, a class token) then get exactly zero weight
        prefix = 0 if getattr(model, "pool_include_prefix", True) else int(model.num_prefix_tokens)
        if prefix:
            capture = capture.sending_to(_prefix_columns(capture, prefix))
        install_qk_norm_hooks([pool], capture, handles, {"attn_mask": 1})

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.norm  # timm's scale norm (Identity unless scale_norm), before the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return timm_position_table(model, spec)

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        if tuple(input_hw) == spec.image_size:
            return spec.grid
        check_input_size(model, input_hw)
        gh, gw = model.patch_embed.dynamic_feat_size(tuple(int(s) for s in input_hw))
        return int(gh), int(gw)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        check_input_size(model, x.shape[-2:])
        return model(x)


def check_input_size(model: nn.Module, input_hw: Sequence[int]) -> None:
    """Refuse, in one line, an input size the timm model's patch embedding asserts against (a fixed size,
    or a size its patches do not divide without padding), before the model's own assertion would.

    Raises:
        InvalidParameterError: naming the size, what the model takes, and what to do.
    """
    from ..errors import InvalidParameterError

    pe = model.patch_embed
    size = getattr(pe, "img_size", None)
    hw = (int(input_hw[0]), int(input_hw[1]))
    if size is None:
        return
    size = tuple(int(s) for s in size)
    if getattr(pe, "strict_img_size", False) and hw != size:
        raise InvalidParameterError(
            f"{type(model).__name__} takes {size[0]}x{size[1]} px inputs only (no dynamic_img_size); got {hw[0]}x{hw[1]} "
            f"px: feed that size, or build the model with dynamic_img_size=True (or img_size={hw}).")
    patch = tuple(int(p) for p in getattr(pe, "patch_size", (1, 1)))
    if not getattr(pe, "dynamic_img_pad", False) and (hw[0] % patch[0] or hw[1] % patch[1]):
        raise InvalidParameterError(
            f"{type(model).__name__}: an input of {hw[0]}x{hw[1]} px is not a whole number of {patch[0]}x{patch[1]} px "
            "patches: feed a multiple of the patch size, or build the model with dynamic_img_pad=True.")


def _prefix_columns(emit: Emit, prefix: int) -> Emit:
    """``emit`` for a pool that attends the patch tokens only (``pool_include_prefix=False``): its map over
    them, [B, heads, queries, N], handed on over every token, [B, heads, queries, prefix + N], with zero
    weight on the prefix tokens it does not read (so the pool's map lines up with the blocks' tokens)."""
    import torch.nn.functional as F

    def padded(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        probs = F.pad(probs, (prefix, 0))
        emit(layer, probs) if rows is None else emit(layer, probs, rows)

    return padded


def _registers(model: nn.Module) -> int:
    """Register tokens: ``num_reg_tokens`` (VisionTransformer), else the rows of ``reg_token`` (Eva)."""
    n = getattr(model, "num_reg_tokens", None)
    if n is None:
        reg = getattr(model, "reg_token", None)
        n = int(reg.shape[1]) if isinstance(reg, torch.Tensor) else 0
    return int(n or 0)


def check_patch_embed(model: nn.Module, name: str, allowed: tuple) -> None:
    if not isinstance(model.patch_embed, allowed):
        raise UnsupportedModelError(
            f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens supports "
            f"{' and '.join(a.__name__ for a in allowed)}, whose token grid and pixel stride it knows.")


def call_argument(call: dict[str, Any], name: str, positions: dict[str, int], default: Any = None) -> Any:
    """An argument of the attention module's call (keyword, or at its position), as a pre-hook saw it."""
    kwargs, args = call.get("kwargs", {}), call.get("args", ())
    if name in kwargs:
        return kwargs[name]
    i = positions.get(name)
    return args[i] if i is not None and len(args) > i else default


#: where timm's ``Attention.forward(x, attn_mask, is_causal)`` takes its arguments
TIMM_ARGS = {"attn_mask": 1, "is_causal": 2}


def install_qk_norm_hooks(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles,
                          positions: dict[str, int],
                          queries_keys: Any = None) -> None:
    """Side capture through ``q_norm`` / ``k_norm`` hooks, with the block's own mask arguments.

    ``queries_keys(attn, q, k, call)`` may turn the normalised q and k into the ones the block
    multiplies (e.g. apply rotary embeddings); ``call`` holds the block call's arguments
    (``call_argument``) and the projection's dtype (``call["dtype"]``).
    """
    workspace: dict = {}  # the probabilities' buffer, shared by every block for the session
    for layer, attn in enumerate(modules):
        state: dict[str, Any] = {}

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict, state: dict = state) -> None:
            state.clear()
            state["args"], state["kwargs"] = args, kwargs

        def q_hook(_mod: nn.Module, inp: tuple, q: torch.Tensor, state: dict = state) -> None:
            state["q"], state["dtype"] = q, inp[0].dtype

        def k_hook(_mod: nn.Module, _inp: tuple, k: torch.Tensor, state: dict = state, layer: int = layer,
                   attn: nn.Module = attn, workspace: dict = workspace) -> None:
            q = state.pop("q")
            with torch.no_grad():
                if queries_keys is not None:
                    q, k = queries_keys(attn, q, k, state)
                mask = call_argument(state, "attn_mask", positions)
                causal = bool(call_argument(state, "is_causal", positions, False))
                # the block's call arguments (its input, B x T x dim) must not outlive the block: a forward
                # would otherwise hold every block's input at once (12 x 28 MB at 768 px, batch 4)
                state.clear()
                with torch.autocast(device_type=k.device.type, enabled=False):
                    for item in attention_probs_in_rows(q, k, attn.scale, capture.query_rows, mask, causal,
                                                        workspace=workspace, taps=capture.taps_for(layer)):
                        capture(layer, *item)
                        del item  # let the next row block's probabilities take this one's memory

        handles.hook(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.hook(attn.q_norm.register_forward_hook(q_hook))
        handles.hook(attn.k_norm.register_forward_hook(k_hook))


#: a parallel block's ``attn_drop`` (its stand-in attention module) -> where its heads meet (or None)
_PARALLEL_HEADS: "weakref.WeakKeyDictionary[nn.Module, nn.Module | None]" = weakref.WeakKeyDictionary()


def _is_parallel(block: nn.Module) -> bool:
    from timm.models.vision_transformer import ParallelScalingBlock

    return type(block) is ParallelScalingBlock


def _parallel_heads_first(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, _call: dict) -> tuple:
    """A parallel block's normalised q and k are [B, T, heads, d]: transpose them as the block does."""
    if _is_parallel(attn):
        return q.transpose(1, 2), k.transpose(1, 2)
    return q, k


class TimmViT(TimmFamily):
    name = "timm-vit"
    capture = CaptureAbilities(side_rows=True)  # install_qk_norm_hooks
    reads = ("timm VisionTransformer: plain ViTs, DeiT (distillation token), register tokens, GAP/MAP heads, "
             "R50 and other hybrids, parallel blocks (vit_*_xp_*), DINOv3, SigLIP and CLIP towers")
    names = ("timm names: vit_base_patch16_224, vit_base_patch16_224.augreg2_in21k_ft_in1k (a pretrained tag), "
             "deit_small_patch16_224, vit_base_r50_s16_224 (hybrid), vit_small_patch14_reg4_dinov2 (registers); "
             "timm.list_models('vit_*')",
             "the embedded pair: ref-vit, ref-hybrid (offline, trained on shapes)")

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import HybridEmbed, PatchEmbed
        from timm.layers.attention import Attention
        from timm.models.vision_transformer import Block, ParallelScalingBlock, ResPostBlock

        check_patch_embed(model, name, (PatchEmbed, HybridEmbed))
        for i, block in enumerate(model.blocks):
            if type(block) is ParallelScalingBlock:
                if block.q_norm is block.k_norm:
                    raise UnsupportedModelError(f"{name!r}: block {i} shares one module as q_norm and k_norm.")
                continue
            if type(block) not in (Block, ResPostBlock):
                raise UnsupportedModelError(
                    f"{name!r}: block {i} is a {type(block).__name__}, which computes attention its own way; "
                    "vitlens captures the attention of timm's Block/ResPostBlock/ParallelScalingBlock only.")
            if type(block.attn) is not Attention:
                raise AttentionClassUnknown(
                    f"{name!r}: block {i} uses {type(block.attn).__name__}; vitlens reproduces timm's standard "
                    "Attention (softmax(q k^T * scale + mask)) exactly and refuses other attention variants.")
            if block.attn.q_norm is block.attn.k_norm:
                raise UnsupportedModelError(
                    f"{name!r}: block {i} shares one module as q_norm and k_norm, so queries cannot be told from "
                    "keys.")

    def kind(self, model: nn.Module) -> str:
        from timm.layers import HybridEmbed

        return HYBRID.name if isinstance(model.patch_embed, HybridEmbed) else VIT.name

    def stride(self, model: nn.Module) -> tuple[int, int]:
        return tuple(int(s) for s in model.patch_embed.feat_ratio(as_scalar=False))  # type: ignore[return-value]

    @staticmethod
    def _computing(model: nn.Module) -> list[nn.Module]:
        """Per block, the module that computes its attention: ``block.attn``, or the parallel block itself."""
        return [block if _is_parallel(block) else block.attn for block in model.blocks]

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        out = []
        for block in model.blocks:
            if _is_parallel(block):
                _PARALLEL_HEADS[block.attn_drop] = block.attn_out_proj  # None when out_proj is fused
                out.append(block.attn_drop)
            else:
                out.append(block.attn)
        return out

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        if attn in _PARALLEL_HEADS:
            return _PARALLEL_HEADS[attn]
        return super().head_outputs(attn)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_qk_norm_hooks(self._computing(model), capture, handles, TIMM_ARGS, _parallel_heads_first)

    def abilities(self, model: nn.Module) -> CaptureAbilities:
        # inline by query rows: timm's standard Attention only (a parallel block computes its own way)
        return CaptureAbilities(side_rows=True, inline_rows=not any(_is_parallel(b) for b in model.blocks))

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        if capture.query_rows and self.abilities(model).inline_rows:
            inline_in_rows(self._computing(model), capture, handles)
        else:
            inline_at_attn_drop(self._computing(model), capture, handles)

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        from ..errors import ViewNotAvailableError

        if not kind_of(spec).cnn_stem:
            return super().pixel_filters(model, spec)
        found = first_conv(model.patch_embed.backbone, "patch_embed.backbone")
        if found is None:
            raise ViewNotAvailableError(f"{spec.name}: the hybrid's CNN has no convolution to show.")
        return conv_filters(found[1], found[0], "the CNN's first convolution; the hybrid's own patch embedding "
                            "acts on CNN channels, not pixels", spec.name)


register(TimmViT())
