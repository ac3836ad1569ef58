"""Hugging Face transformers ViTs: ``ViT*``, ``DeiT*`` (distillation token), ``Dinov2*`` and
``Dinov2WithRegisters*`` (register tokens).

Their attention is softmax((q @ k^T) * scaling + mask), whatever ``attn_implementation`` the model
runs (eager, sdpa, ...). Side capture hooks ``q_proj`` and ``k_proj`` and computes the
probabilities from their outputs, so a model on sdpa keeps its own outputs bit for bit and the
maps equal what the ``eager`` implementation returns with ``output_attentions``. Inline capture
switches the blocks to an attention function registered with transformers' own
``AttentionInterface``: transformers' eager computation, whose probabilities are the ones the
output uses (what gradient methods need), handed to vitlens as they are made.

transformers is an optional dependency (``pip install 'vitlens[hf]'``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..loading.spec import ModelSpec
from .base import Emit, Family, Handles, prefix_labels, register
from .timm_vit import attention_probs, conv_filters

#: model types (``config.model_type``) whose attention vitlens reproduces
MODEL_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers")
INLINE_KEY = "vitlens_inline"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: each model type's image-processor defaults: (resize, crop_pct, mean, std, interpolation)
PROCESSOR_DEFAULTS = {
    "vit": ("squash", 1.0, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bilinear"),
    "deit": ("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
    "dinov2": ("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
    "dinov2_with_registers": ("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
}
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}

# the captures whose inline hooks are active: (id(attention module) -> layer, emit, detach)
_ACTIVE: list[tuple[dict[int, int], Emit, bool]] = []
_REGISTERED = False


def _inline_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention, handing its probabilities to the active vitlens capture."""
    from transformers.models.vit.modeling_vit import eager_attention_forward

    out, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for layers, emit, detach in _ACTIVE:
        if id(module) in layers:
            emit(layers[id(module)], weights.detach() if detach else weights)
    return out, weights


def _register_inline() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(INLINE_KEY, _inline_attention)
        _REGISTERED = True


def is_hf_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def embeddings_of(model: nn.Module) -> nn.Module:
    for _name, mod in model.named_modules():
        if hasattr(mod, "patch_embeddings") and hasattr(mod.patch_embeddings, "projection"):
            return mod
    raise UnsupportedModelError(f"{type(model).__name__} has no patch embeddings vitlens recognises.")


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


class HuggingFaceViT(Family):
    name = "hf-vit"
    reads = "Hugging Face transformers ViT, DeiT, Dinov2 (with registers); needs transformers"
    names = ("hf:ORG/NAME (the Hub, e.g. hf:google/vit-base-patch16-224) or hf:FOLDER (a saved model)",)

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model)

    def check(self, model: nn.Module, name: str) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"{name!r} is a Hugging Face {type(model).__name__} (model type {model_type!r}); vitlens reads "
                f"{', '.join(MODEL_TYPES)} models from transformers (ViT*, DeiT*, Dinov2*).")
        for i, attn in enumerate(self.attention_modules(model)):
            if not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj") and hasattr(attn, "scaling")):
                raise UnsupportedModelError(f"{name!r}: attention module {i} ({type(attn).__name__}) has no "
                                            "q_proj/k_proj/scaling; this transformers version is not supported.")

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [mod for _n, mod in model.named_modules()
                if type(mod).__name__.endswith("Attention") and hasattr(mod, "q_proj")]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = model.config
        emb = embeddings_of(model)
        patch = _pair(cfg.patch_size)
        size = _pair(input_size or cfg.image_size)
        registers = int(emb.register_tokens.shape[1]) if getattr(emb, "register_tokens", None) is not None else 0
        labels = prefix_labels(True, hasattr(emb, "distillation_token"), registers)
        prefix = len(labels)
        table_grid = self._table_grid(model)
        attns = self.attention_modules(model)
        head = "ForImageClassification" in type(model).__name__
        return ModelSpec(
            name=name, kind="vit", image_size=size, grid=(size[0] // patch[0], size[1] // patch[1]), stride_px=patch,
            num_prefix_tokens=prefix, num_layers=len(attns), num_heads=int(cfg.num_attention_heads),
            embed_dim=int(cfg.hidden_size), has_class_token=True, has_pos_embed=True,
            pos_embed_prefix=int(emb.position_embeddings.shape[1]) - table_grid[0] * table_grid[1],
            num_classes=int(cfg.num_labels) if head else 0,
            num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=cfg.model_type.startswith("dinov2"), family=self.name, prefix_labels=labels)

    def _table_grid(self, model: nn.Module) -> tuple[int, int]:
        emb = embeddings_of(model)
        n = int(emb.position_embeddings.shape[1])
        cfg_grid = tuple(s // p for s, p in zip(_pair(model.config.image_size), _pair(model.config.patch_size)))
        for prefix in (2, 1):  # DeiT keeps rows for the class and distillation tokens, the others for the class
            side = math.isqrt(max(n - prefix, 0))
            if (n - prefix) == cfg_grid[0] * cfg_grid[1]:
                return cfg_grid  # type: ignore[return-value]
            if side * side == n - prefix:
                return side, side
        raise UnsupportedModelError(f"{type(model).__name__}: a position table of {n} rows fits no square grid.")

    def install_side(self, model: nn.Module, emit: Emit, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            state: dict[str, Any] = {}

            def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict, state: dict = state) -> None:
                state.clear()
                state["mask"] = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)

            def q_hook(_mod: nn.Module, _inp: tuple, q: torch.Tensor, state: dict = state) -> None:
                state["q"] = q

            def k_hook(_mod: nn.Module, _inp: tuple, k: torch.Tensor, state: dict = state, layer: int = layer,
                       attn: nn.Module = attn) -> None:
                q = state.pop("q")
                b, t = k.shape[:2]
                d = getattr(attn, "head_dim", q.shape[-1] // attn.config.num_attention_heads)
                q = q.view(b, t, -1, d).transpose(1, 2)
                k = k.view(b, t, -1, d).transpose(1, 2)
                with torch.no_grad(), torch.autocast(device_type=k.device.type, enabled=False):
                    mask = state.get("mask")
                    probs = attention_probs(q, k, attn.scaling, biases=() if mask is None else (mask,),
                                            scale_after=True)
                emit(layer, probs)

            handles.hook(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.hook(attn.q_proj.register_forward_hook(q_hook))
            handles.hook(attn.k_proj.register_forward_hook(k_hook))

    def install_inline(self, model: nn.Module, emit: Emit, handles: Handles, detach: bool) -> None:
        _register_inline()
        attns = self.attention_modules(model)
        entry = ({id(a): i for i, a in enumerate(attns)}, emit, detach)
        _ACTIVE.append(entry)
        handles.on_remove(lambda: _ACTIVE.remove(entry))
        for config in {id(a.config): a.config for a in attns}.values():
            old = config._attn_implementation
            config._attn_implementation = INLINE_KEY
            handles.on_remove(lambda config=config, old=old: setattr(config, "_attn_implementation", old))

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.o_proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = embeddings_of(model).patch_embeddings.projection
        return conv_filters(conv, "embeddings.patch_embeddings.projection", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        grid = self._table_grid(model)
        pos = embeddings_of(model).position_embeddings.detach()
        return pos[:, pos.shape[1] - grid[0] * grid[1]:], grid

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        mode, crop_pct, mean, std, interpolation = PROCESSOR_DEFAULTS[model.config.model_type]
        out = {"input_size": (3, *spec.image_size), "interpolation": interpolation, "mean": mean, "std": std,
               "crop_pct": crop_pct, "crop_mode": mode}
        names = _label_names(model)
        if names:
            out["label_names"] = names
        return out

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(pixel_values=x)
        if getattr(out, "logits", None) is not None:
            return out.logits
        pooled = getattr(out, "pooler_output", None)
        return pooled if pooled is not None else out.last_hidden_state[:, 0]

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        sy, sx = spec.stride_px
        return input_hw[0] // sy, input_hw[1] // sx


def _label_names(model: nn.Module) -> list[str] | None:
    id2label = getattr(model.config, "id2label", None) or {}
    n = int(getattr(model.config, "num_labels", 0) or 0)
    names = [id2label.get(i, id2label.get(str(i))) for i in range(n)]
    if not names or any(v is None for v in names) or all(str(v).startswith("LABEL_") for v in names):
        return None
    return [str(v) for v in names]


def processor_data_config(processor: dict[str, Any], model_type: str) -> dict[str, Any]:
    """timm-style preprocessing from a Hugging Face ``preprocessor_config.json``."""
    mode, crop_pct, mean, std, interpolation = PROCESSOR_DEFAULTS.get(model_type, PROCESSOR_DEFAULTS["vit"])
    size = processor.get("size") or {}
    crop = processor.get("crop_size") or {}
    if processor.get("do_center_crop") and crop:
        h, w = int(crop.get("height", crop.get("shortest_edge", 224))), int(crop.get("width", crop.get("shortest_edge", 224)))
        short = int(size.get("shortest_edge", size.get("height", h)))
        mode, crop_pct = "center", min(h, w) / short
    elif "height" in size:
        h, w = int(size["height"]), int(size["width"])
        mode, crop_pct = "squash", 1.0
    else:
        h = w = int(size.get("shortest_edge", 224))
        mode, crop_pct = "center", 1.0
    return {"input_size": (3, h, w), "interpolation": _RESAMPLE.get(processor.get("resample"), interpolation),
            "mean": tuple(processor.get("image_mean", mean)), "std": tuple(processor.get("image_std", std)),
            "crop_pct": crop_pct, "crop_mode": mode}


register(HuggingFaceViT())
