"""Hugging Face transformers ViTs: ``ViT*``, ``DeiT*`` (distillation token), ``Dinov2*`` and
``Dinov2WithRegisters*`` (register tokens), ``IJepa*`` (no class token), ``ViTMAE*`` (the encoder, on
every patch), and the vision towers of ``CLIP*``, ``MetaClip2*`` (MetaCLIP 2: the CLIP architecture
under its own model type) and ``Siglip*`` / ``Siglip2*`` (``CLIPVisionModel``, or ``CLIPModel`` /
``SiglipModel`` with their text tower left as it is: only ``vision_model`` is read, and a feature
model's output is ``get_image_features``, the projected image embedding).

Other transformers vision models (DINOv3, AIMv2, Data2Vec-Vision, BEiT, ...) are refused here with
``AttentionClassUnknown``, so the generic call-level capture (``vitlens.families.common.layouts``'s
``HuggingFaceLayout``) may read them at their SDPA calls; windowed and hierarchical ones it cannot (DiNAT,
NAT, ...) are refused by name (``REFUSED_MODEL_TYPES``) before it is tried; the types another family declares
(``Family.hf_types``: Swin, Hiera, ViTDet, SAM, PVT, ...) are that family's (``common.hf.types_read_elsewhere``).

Their attention is softmax((q @ k^T) * scaling + mask), whatever ``attn_implementation`` the model
runs (eager, sdpa, ...). Side capture hooks ``q_proj`` and ``k_proj`` and computes the
probabilities from their outputs, so a model on sdpa keeps its own outputs bit for bit and the
maps equal what the ``eager`` implementation returns with ``output_attentions``. Inline capture
switches the blocks to an attention function registered with transformers' own
``AttentionInterface``: transformers' eager computation, whose probabilities are the ones the
output uses (what gradient methods need), handed to vitlens as they are made.

Two models need their inputs fixed for the maps to be those of an image:

- ``ViTMAE`` drops a random ``mask_ratio`` of the patches and shuffles the rest. vitlens reads it
  with ``mask_ratio == 0`` only (``hf:`` names load that way; a module with another ratio is
  refused with the fix), and hands it ``noise = arange(T)``, so the kept order is the image's own
  row-major order: every patch, in place, behind the class token.
- ``Siglip2`` takes pre-cut patches, their grid (``spatial_shapes``) and a padding mask
  (NaFlex-style packing). vitlens feeds one fixed size, the position table's own square grid
  (``sqrt(num_patches) * patch_size`` pixels, squashed), cut into patches as Siglip2's image
  processor cuts them, with no padding: the mask is all ones, the maps are exact. Aspect-preserving
  variable-resolution packing itself is not reproduced by the views, which refuse in one line a
  batch with padding or with images of other grids (``refuse_packing_in_views``,
  ``refuse_padding_in_views``); ``vl.capture_attention`` of a user's own packed inputs is exact,
  padding keys at zero: the mask is taken as the attention gets it (``scores_mask``), boolean
  (True = attend) under sdpa, additive under eager, a [B, T] padding mask under flash attention;
  side capture refuses flex attention's ``BlockMask`` in one line (inline capture runs transformers'
  eager attention with its own mask, whatever the model's implementation).

Another input size than the config's: ``interpolate_pos_encoding=True`` where the call takes it
(``size_inputs``), a one-line refusal where it does not (Dinov2 and Siglip2 resample by themselves).

transformers is an optional dependency (``pip install 'vitlens[hf]'``).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Sequence, cast

import torch
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError, ViewNotAvailableError
from ..core.spec import ModelSpec
from ..core.tokens import ImageTokens
from ..kinds import VIT
from .base import AttentionClassUnknown, CaptureRequest, Family, Handles, prefix_labels, register
from ..core.attention import attention_probs, conv_filters
from .common.hf_inputs import (embeddings_of, model_inputs, position_rows, refuse_packing_in_views,
                               refuse_padding_in_views, scores_mask, siglip2_inputs)
from .common.hf import (CLIP_MEAN, CLIP_STD, HALF, IMAGENET_MEAN, IMAGENET_STD, VIT_PROCESSOR, HfTypes,
                        ProcessorDefaults, config_image_size, default_data_config, is_hf_model, tower_type,
                        types_read_elsewhere, vision_tower)
from .common.diagnose import hf_refusal
from .common.mha import install_probe_pool, probe_attention
from .common.windows import pair

#: the model types (``config.model_type`` of the vision tower) whose attention this family reproduces, with their
#: image processors' defaults; the whole models whose vision tower it reads (CLIP's, SigLIP's: their text tower kept);
#: any attention implementation is read, so ``hf:`` names load with the checkpoint's own (``HfTypes``)
HF_TYPES = HfTypes(
    processors={
        "vit": VIT_PROCESSOR,
        "deit": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "dinov2": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "dinov2_with_registers": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "ijepa": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "vit_mae": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "clip_vision_model": ProcessorDefaults("center", 1.0, CLIP_MEAN, CLIP_STD, "bicubic"),
        "metaclip_2_vision_model": ProcessorDefaults("center", 1.0, CLIP_MEAN, CLIP_STD, "bicubic"),
        "siglip_vision_model": ProcessorDefaults("squash", 1.0, HALF, HALF, "bicubic"),
        # NaFlex: the size is the model's (its position table's grid), not the processor's
        "siglip2_vision_model": ProcessorDefaults("squash", 1.0, HALF, HALF, "bilinear", size_from_model=True),
    },
    towers={"clip": "clip_vision_model", "metaclip_2": "metaclip_2_vision_model", "siglip": "siglip_vision_model",
            "siglip2": "siglip2_vision_model"},
    attn_implementation=None)
#: model types (``config.model_type`` of the vision tower) whose attention vitlens reproduces
MODEL_TYPES = HF_TYPES.model_types
#: model types without a class token
NO_CLASS_TOKEN = ("ijepa", "siglip_vision_model", "siglip2_vision_model")
#: model types refused by name (windowed or hierarchical attention, out of the generic capture's reach), with what
#: a reading of them as one global attention over the image's tokens would get wrong (the windowed and hierarchical
#: types other families read are theirs: ``common.hf.types_read_elsewhere``)
REFUSED_MODEL_TYPES = {
    "donut-swin": "windowed attention and patch merging (Donut's Swin encoder)",
    "maskformer-swin": "windowed attention and patch merging (MaskFormer's Swin backbone)",
    "dinat": "dilated neighbourhood attention (DiNAT)",
    "nat": "neighbourhood attention (NAT)",
}
INLINE_KEY = "vitlens_inline"


class _Active(threading.local):
    """Per thread, the captures whose inline hooks are active: (id(attention module) -> layer, the request).
    Thread-local, so an attention call routes to the captures its own thread opened (the model's lock keeps
    two threads' captures of one model apart; this keeps a forward of another thread out of them)."""

    def __init__(self) -> None:
        self.entries: list[tuple[dict[int, int], CaptureRequest]] = []


_ACTIVE = _Active()
_REGISTERED = False


def _inline_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention, handing its probabilities to the active vitlens capture."""
    from transformers.models.vit.modeling_vit import eager_attention_forward

    out, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for layers, capture in _ACTIVE.entries:
        if id(module) in layers:
            refuse_padding_in_views(capture, attention_mask if isinstance(attention_mask, torch.Tensor) else None)
            capture(layers[id(module)], weights.detach() if capture.detach else weights)
    return out, weights


def _register_inline() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(INLINE_KEY, _inline_attention)
        # masks for it are made as for eager (an additive float mask; Siglip2 makes one)
        AttentionMaskInterface.register(INLINE_KEY, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        _REGISTERED = True


class HuggingFaceViT(Family):
    name = "hf-vit"
    summary = ("Hugging Face ViT/DeiT/Dinov2/IJepa/ViTMAE and CLIP/MetaCLIP 2/SigLIP/SigLIP2 vision towers")
    reads = ("Hugging Face transformers ViT, DeiT, Dinov2 (with registers), CLIP, MetaCLIP 2 and SigLIP / SigLIP2 "
             "vision towers "
             "(text towers kept), I-JEPA, ViTMAE (every patch kept); needs transformers")
    names = ("hf:ORG/NAME (the Hub, e.g. hf:google/vit-base-patch16-224) or hf:FOLDER (a saved model)",)
    attention_inputs = ("layernorm_before", "layer_norm1", "norm1")  # ViT/DeiT/MAE/IJepa, CLIP/SigLIP, Dinov2
    hf_types = HF_TYPES

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model) and tower_type(model) not in types_read_elsewhere(self)

    def check(self, model: nn.Module, name: str) -> None:
        model_type = tower_type(model)
        if model_type in REFUSED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{name!r} is a Hugging Face {type(model).__name__} (model type {model_type!r}), which uses "
                f"{REFUSED_MODEL_TYPES[model_type]}; vitlens does not reproduce it exactly, so its attention maps are "
                "refused rather than shown wrong.")
        if model_type not in MODEL_TYPES:
            # the generic call-level capture (a fallback family) may still read it at its SDPA calls
            raise AttentionClassUnknown(
                f"{name!r} is a Hugging Face {type(model).__name__} (model type {model_type!r}); vitlens reads "
                f"{', '.join(MODEL_TYPES)} models from transformers (ViT*, DeiT*, Dinov2*, IJepa*, ViTMAE*, and "
                "the vision towers of CLIP*, MetaClip2*, Siglip*, Siglip2*), and other vision models with one patch "
                "convolution and one attention module per layer run with attn_implementation='sdpa' (the generic "
                "call-level capture); this one has neither.",
                diagnose=lambda: hf_refusal(model, vision_tower(model), name, model_type))
        if model_type == "vit_mae" and float(getattr(vision_tower(model).config, "mask_ratio", 0.0)) != 0.0:
            raise UnsupportedModelError(
                f"{name!r} is a ViTMAE with mask_ratio={vision_tower(model).config.mask_ratio}: it drops that share of "
                "the patches at random on every forward, so its attention maps are of a random subset of the image. "
                "vitlens reads the encoder on every patch: build it with ViTMAEConfig(mask_ratio=0.0), or set "
                "model.config.mask_ratio = 0.0 before loading it (hf: names load that way).")
        attns = self.attention_modules(model)
        if not attns:
            raise UnsupportedModelError(f"{name!r}: no attention module with q_proj/k_proj found in "
                                        f"{type(model).__name__}; this transformers version is not supported.")
        for i, attn in enumerate(attns):
            if not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj") and _scale_of(attn) is not None):
                raise UnsupportedModelError(f"{name!r}: attention module {i} ({type(attn).__name__}) has no "
                                            "q_proj/k_proj/scaling; this transformers version is not supported.")

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The self-attention of every block of the vision tower (not a text tower, decoder or pooling head)."""
        return [mod for _n, mod in vision_tower(model).named_modules()
                if type(mod).__name__.endswith("Attention") and hasattr(mod, "q_proj")]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = vision_tower(model).config
        kind = tower_type(model)
        emb = embeddings_of(model)
        patch = pair(cfg.patch_size)
        size = pair(input_size or config_image_size(cfg))
        registers = int(emb.register_tokens.shape[1]) if getattr(emb, "register_tokens", None) is not None else 0
        cls = kind not in NO_CLASS_TOKEN
        labels = prefix_labels(cls, hasattr(emb, "distillation_token"), registers)
        prefix = len(labels)
        table_grid = self._table_grid(model)
        attns = self.attention_modules(model)
        head = "ForImageClassification" in type(model).__name__
        return ModelSpec(
            name=name, kind=VIT.name, image_size=size, grid=(size[0] // patch[0], size[1] // patch[1]), stride_px=patch,
            num_prefix_tokens=prefix, num_layers=len(attns), num_heads=int(cfg.num_attention_heads),
            embed_dim=int(cfg.hidden_size), has_class_token=cls, has_pos_embed=kind != "vit_mae",
            pos_embed_prefix=int(position_rows(emb).shape[1]) - table_grid[0] * table_grid[1],
            num_classes=int(model.config.num_labels) if head else 0,
            num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=(kind or "").startswith("dinov2"), family=self.name, prefix_labels=labels)

    def _table_grid(self, model: nn.Module) -> tuple[int, int]:
        emb = embeddings_of(model)
        cfg = vision_tower(model).config
        n = int(position_rows(emb).shape[1])
        cfg_grid = tuple(s // p for s, p in zip(pair(config_image_size(cfg)), pair(cfg.patch_size)))
        # DeiT keeps rows for the class and distillation tokens, ViT/CLIP/MAE for the class, SigLIP/IJepa none
        for prefix in (2, 1, 0):
            if (n - prefix) == cfg_grid[0] * cfg_grid[1]:
                return cfg_grid  # type: ignore[return-value]  # 2 ints (mypy: tuple[int, ...])
        for prefix in (2, 1, 0):
            side = math.isqrt(max(n - prefix, 0))
            if side * side == n - prefix:
                return side, side
        raise UnsupportedModelError(f"{type(model).__name__}: a position table of {n} rows fits no square grid.")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        refuse_packing_in_views(model, capture, handles)
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
                d = getattr(attn, "head_dim", None) or q.shape[-1] // attn.config.num_attention_heads
                q = q.view(b, t, -1, d).transpose(1, 2)
                k = k.view(b, t, -1, d).transpose(1, 2)
                # the mask as the attention function gets it: boolean (True = attend) under sdpa, additive
                # under eager, [B, T] padding under flash attention; attention_probs takes the first two (a
                # boolean added as a bias would mask nothing), scores_mask turns the third into the first
                mask = scores_mask(state.get("mask"))
                refuse_padding_in_views(capture, mask)
                with torch.no_grad(), torch.autocast(device_type=k.device.type, enabled=False):
                    # not None: the model was checked for each attention's scaling when it was read
                    probs = attention_probs(q, k, cast(float, _scale_of(attn)), mask, scale_after=True)
                capture(layer, probs)

            handles.hook(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.hook(attn.q_proj.register_forward_hook(q_hook))
            handles.hook(attn.k_proj.register_forward_hook(k_hook))

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        _register_inline()
        refuse_packing_in_views(model, capture, handles)
        attns = self.attention_modules(model)
        entry = ({id(a): i for i, a in enumerate(attns)}, capture)
        active = _ACTIVE.entries  # this thread's list (removal may run after an exception, still on it)
        active.append(entry)
        handles.on_remove(lambda: active.remove(entry))
        for config in {id(a.config): a.config for a in attns}.values():
            handles.set_attr(config, "_attn_implementation", INLINE_KEY)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """SigLIP's / Siglip2's MAP head: its probe's nn.MultiheadAttention over the tokens, softmax(q / sqrt(d) @ k^T
        + mask) per head (what the module returns with ``average_attn_weights=False``), from its own in-projection
        (``common.mha.install_probe_pool``)."""
        mha = probe_attention(getattr(vision_tower(model), "head", None))
        if mha is None:
            raise ViewNotAvailableError(f"{type(model).__name__} has no MAP head (SigLIP's probe attention), so "
                                        "there is no pool attention to show.")
        install_probe_pool(mha, capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        proj = getattr(attn, "o_proj", None)  # ViT, DeiT, Dinov2, IJepa, MAE; CLIP and SigLIP call it out_proj
        return proj if proj is not None else getattr(attn, "out_proj", None)

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        emb = embeddings_of(model)
        where = {id(mod): n for n, mod in model.named_modules()}
        if hasattr(emb, "patch_embeddings"):
            conv = emb.patch_embeddings.projection
            return conv_filters(conv, where[id(conv)], "the patch embedding E", spec.name)
        proj = emb.patch_embedding
        if isinstance(proj, nn.Linear):  # Siglip2: a linear map of patches flattened as (py, px, channel)
            p = pair(vision_tower(model).config.patch_size)
            w = proj.weight.detach().to(torch.float64).cpu()
            w = w.reshape(w.shape[0], p[0], p[1], -1).permute(0, 3, 1, 2).contiguous()
            d, c, kh, kw = w.shape
            return w, where[id(proj)], (f"{where[id(proj)]}: {d} filters of {kh}x{kw}x{c}, the patch embedding E "
                                        "(a linear map of the cut patches)")
        return conv_filters(proj, where[id(proj)], "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        if tower_type(model) == "vit_mae":
            return None
        grid = self._table_grid(model)
        pos = position_rows(embeddings_of(model))
        return pos[:, pos.shape[1] - grid[0] * grid[1]:], grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        if tower_type(model) == "vit_mae":
            return ("ViTMAE adds a fixed 2-D sin-cos position table, not a learned one (its similarities show the "
                    "formula, not what the model learned)")
        return super().no_position_reason(model, spec)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return default_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else the image embedding: ``get_image_features`` of a CLIP/SigLIP model
        (projected), the pooled output, a backbone's last feature map (as the ViTDet and generic families give), or
        the class token (the mean token without one)."""
        if "ForImageClassification" not in type(model).__name__ and hasattr(model, "get_image_features"):
            out = model.get_image_features(**model_inputs(model, x, model.get_image_features))
            return out if isinstance(out, torch.Tensor) else out.pooler_output
        if "ForImageClassification" not in type(model).__name__:
            model = vision_tower(model)
        out = model(**model_inputs(model, x, model.forward))
        if getattr(out, "logits", None) is not None:
            return out.logits
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            return pooled
        if getattr(out, "feature_maps", None):  # a backbone (Dinov2Backbone, Depth Anything's): its last feature map
            return out.feature_maps[-1]
        return out.last_hidden_state[:, 0] if tower_type(model) not in NO_CLASS_TOKEN else out.last_hidden_state.mean(1)

    def tower(self, model: nn.Module) -> nn.Module:
        """The module read: a CLIP/SigLIP model's ``vision_model``, ViTMAE's encoder ``vit``, else the model."""
        return vision_tower(model)

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        sy, sx = spec.stride_px
        return input_hw[0] // sy, input_hw[1] // sx

    def packed_forward(self, model: nn.Module, images: Sequence[torch.Tensor]) -> list[ImageTokens] | None:
        """Siglip2 (NaFlex): images [C, H_i, W_i] of different sizes in one padded batch, as its processor makes it:
        each image's patches (``siglip2_inputs``) then zero padding to the longest, ``pixel_attention_mask`` 1 on its
        own patches, ``spatial_shapes`` its grid; the model gives the padding keys exactly zero probability, so image
        i's rows and columns of batch row i are its own attention. None for any other model type.

        Raises:
            InvalidParameterError: an image whose sides are not whole multiples of the patch size.
        """
        if tower_type(model) != "siglip2_vision_model":
            return None
        tower = vision_tower(model)
        patch = int(tower.config.patch_size)
        cut = []
        for i, img in enumerate(images):
            if img.dim() != 3 or img.shape[-2] % patch or img.shape[-1] % patch:
                raise InvalidParameterError(f"image {i} is of shape {tuple(img.shape)}; Siglip2 takes preprocessed "
                                            f"tensors [C, H, W] whose sides are multiples of its patch size {patch}.")
            cut.append(siglip2_inputs(img[None], patch))
        longest = max(int(c["pixel_values"].shape[1]) for c in cut)
        pixels = cut[0]["pixel_values"].new_zeros(len(cut), longest, int(cut[0]["pixel_values"].shape[-1]))
        mask = torch.zeros(len(cut), longest, dtype=torch.long, device=pixels.device)
        for i, c in enumerate(cut):
            n = int(c["pixel_values"].shape[1])
            pixels[i, :n], mask[i, :n] = c["pixel_values"][0], 1
        shapes = torch.cat([c["spatial_shapes"] for c in cut])
        with torch.no_grad():
            tower(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)
        grids = [(int(h), int(w)) for h, w in shapes.tolist()]
        return [ImageTokens(i, slice(0, gh * gw), (gh, gw)) for i, (gh, gw) in enumerate(grids)]


def _scale_of(attn: nn.Module) -> float | None:
    """The score scale an attention module hands the attention function (``scaling``; CLIP/SigLIP: ``scale``)."""
    scale = getattr(attn, "scaling", None)
    return getattr(attn, "scale", None) if scale is None else scale


register(HuggingFaceViT())
