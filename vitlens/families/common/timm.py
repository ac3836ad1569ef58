"""What timm's ViT-like families share (timm's VisionTransformer, BEiT, EVA) and what timm families of other shapes use
(Swin, Hiera, MViT v2, SAM, CaiT): ``TimmFamily`` (``patch_embed``, ``blocks[i].attn`` with ``fused_attn`` and
``attn_drop``, a ``pos_embed`` table, prefix tokens), side capture through ``q_norm`` / ``k_norm`` hooks with the
block's own mask arguments (``install_qk_norm_hooks``), inline capture at ``attn_drop``, the input-size checks of a
timm patch embedding, and timm's resolved data config and position table.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...core.attention import attention_probs_in_rows, conv_filters
from ...core.spec import ModelSpec
from ...errors import InvalidParameterError, UnsupportedModelError, ViewNotAvailableError
from ...kinds import VIT
from ..base import CaptureRequest, Emit, Family, Handles, prefix_labels, refuse_other_size


def inline_at_attn_drop(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> None:
    """Inline capture for timm attention modules with a ``fused_attn`` switch and ``attn_drop``:
    the non-fused path's probabilities, as they enter dropout."""
    for layer, attn in enumerate(modules):
        def drop_pre_hook(_mod: nn.Module, args: tuple, layer: int = layer) -> None:
            capture(layer, args[0].detach() if capture.detach else args[0])

        handles.set_attr(attn, "fused_attn", False)
        handles.hook(attn.attn_drop.register_forward_pre_hook(drop_pre_hook))


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
    # the ignore below: 2 ints (mypy: tuple[int, ...])
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
            image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            grid=grid,  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
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
                                        register_tokens(model)))

    def kind(self, model: nn.Module) -> str:
        return VIT.name

    def stride(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(s) for s in model.patch_embed.patch_size)  # type: ignore[return-value]

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks]

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        inline_at_attn_drop(self.attention_modules(model), capture, handles)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """timm's MAP head (``AttentionPoolLatent``): softmax(q_norm(q(latent)) * scale @ k_norm(k(x))^T + mask),
        its latent queries over every token, read from its q_norm / k_norm as a block's."""
        from timm.layers import AttentionPoolLatent


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
            capture = capture.sending_to(prefix_columns(capture, prefix))
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
    pe = model.patch_embed
    size = getattr(pe, "img_size", None)
    hw = (int(input_hw[0]), int(input_hw[1]))
    if size is None:
        return
    size = tuple(int(s) for s in size)
    if getattr(pe, "strict_img_size", False) and hw != size:
        raise InvalidParameterError(
            f"{type(model).__name__} takes {size[0]}x{size[1]} px inputs only (no dynamic_img_size); got "
            f"{hw[0]}x{hw[1]} px: feed that size, or build the model with dynamic_img_size=True (or img_size={hw}).")
    patch = tuple(int(p) for p in getattr(pe, "patch_size", (1, 1)))
    if not getattr(pe, "dynamic_img_pad", False) and (hw[0] % patch[0] or hw[1] % patch[1]):
        raise InvalidParameterError(
            f"{type(model).__name__}: an input of {hw[0]}x{hw[1]} px is not a whole number of {patch[0]}x{patch[1]} px "
            "patches: feed a multiple of the patch size, or build the model with dynamic_img_pad=True.")


def prefix_columns(emit: Emit, prefix: int) -> Emit:
    """``emit`` for a pool that attends the patch tokens only (``pool_include_prefix=False``): its map over
    them, [B, heads, queries, N], handed on over every token, [B, heads, queries, prefix + N], with zero
    weight on the prefix tokens it does not read (so the pool's map lines up with the blocks' tokens)."""
    import torch.nn.functional as F

    def padded(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        probs = F.pad(probs, (prefix, 0))
        emit(layer, probs) if rows is None else emit(layer, probs, rows)

    return padded


def register_tokens(model: nn.Module) -> int:
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


__all__ = ["TIMM_ARGS", "TimmFamily", "call_argument", "check_input_size", "check_patch_embed", "first_conv",
           "inline_at_attn_drop", "install_qk_norm_hooks", "prefix_columns", "register_tokens", "timm_data_config",
           "timm_position_table"]
