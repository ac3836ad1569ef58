"""Hugging Face plumbing shared by the families that read transformers models (``hf-vit``, ``hf-swin``, ``hf-pvt``,
``hf-hiera``, ``hf-vitdet``, ``hf-sam``, and the generic capture's Hugging Face layout).

Each of those families declares, in its own module, the transformers model types it reads (``Family.hf_types``, an
``HfTypes``): their image processors' defaults, the whole-model types whose vision tower is one of them (CLIP's
``clip`` -> ``clip_vision_model``) and the attention implementation a loader asks for. What used to be hand-kept
lists beside the ``hf-vit`` family is derived here from the registered families: which family reads a model type
(``reader_of``), the types other families read (``types_read_elsewhere``), a whole model's tower type
(``tower_type``), a type's processor defaults (``processor_defaults``, ``processor_data_config``) and the
implementation ``hf:`` names are loaded with (``implementation_request``). A new Hugging Face family is its module:
nothing here names it.

The rest is how vitlens meets any transformers vision model: its vision tower, its inputs at another size
(``interpolate_pos_encoding``), its class names and its output.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ...core.spec import ModelSpec
from ...errors import InvalidParameterError, UnsupportedModelError
from ..base import FAMILIES, Family
from .windows import pair

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
#: transformers' image-processor resample codes -> interpolation names
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}


@dataclass(frozen=True)
class ProcessorDefaults:
    """A model type's image-processor defaults, in the processor's own arithmetic: a pixel ``x`` in 0..255 becomes
    ``(x * rescale - offset - mean) / std``. timm's data config reads them on [0, 1] pixels (``unit_mean``,
    ``unit_std``); a video model's clips read them as they are (``vitlens.clips.processing``).

    Attributes:
        crop_mode: "squash" (resize to the size) or "center" (resize the short side, centre crop).
        crop_pct: the crop's share of the resized short side.
        mean: per-channel mean, after the rescale and the offset (the processor's ``image_mean``).
        std: per-channel standard deviation, likewise (``image_std``).
        interpolation: the resize's interpolation.
        size_from_model: the input size is the model's (its position table's grid), not the processor's
            (Siglip2's NaFlex processor, which resizes each image to its own grid).
        rescale: the factor on 0..255 values (the processor's ``rescale_factor``).
        offset: subtracted after the rescale (ViViT's processor: 1, so that values start in [-1, 1]).
    """

    crop_mode: str
    crop_pct: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str
    size_from_model: bool = False
    rescale: float = 1 / 255
    offset: float = 0.0

    @property
    def unit_mean(self) -> tuple[float, ...]:
        """The mean on [0, 1] pixels ``u = x / 255``: ``(mean + offset) / (255 * rescale)`` (the same output)."""
        return tuple((m + self.offset) / (255 * self.rescale) for m in self.mean)

    @property
    def unit_std(self) -> tuple[float, ...]:
        """The standard deviation on [0, 1] pixels: ``std / (255 * rescale)``."""
        return tuple(s / (255 * self.rescale) for s in self.std)


#: ViT's image processor (transformers' defaults): squash to the size, mean and std 0.5, bilinear; also what a model
#: type no family declares is preprocessed with
VIT_PROCESSOR = ProcessorDefaults("squash", 1.0, HALF, HALF, "bilinear")


@dataclass(frozen=True)
class HfTypes:
    """What a family declares about the transformers models it reads (``Family.hf_types``).

    Attributes:
        processors: each model type it reads (the vision tower's ``config.model_type``) -> its image processor's
            defaults (what an ``hf:`` checkpoint without a ``preprocessor_config.json`` is preprocessed with).
        towers: a whole model's type -> its vision tower's type, for models whose tower it reads (CLIP's ``clip``
            -> ``clip_vision_model``; SAM's ``sam`` -> ``sam_vision_model``).
        attn_implementation: the attention implementation ``hf:`` names are loaded with (``implementation_request``;
            a class without it is built on its default), or None to keep the checkpoint's own (a family that reads
            every implementation, or the one a model has).
        clips: its types are video models, whose video processors apply ``processors`` to every sampled frame of a
            clip (``video_processor_defaults``; ``vitlens.clips.processing`` reads them).
    """

    processors: Mapping[str, ProcessorDefaults]
    towers: Mapping[str, str] = field(default_factory=dict)
    attn_implementation: str | None = "sdpa"
    clips: bool = False

    @property
    def model_types(self) -> tuple[str, ...]:
        """The model types the family reads."""
        return tuple(self.processors)


def declarations() -> list[tuple[Family, HfTypes]]:
    """(family, its ``HfTypes``) of every registered family that reads transformers models, in ``FAMILIES`` order."""
    return [(f, f.hf_types) for f in FAMILIES if f.hf_types is not None]


def reader_of(model_type: str | None) -> Family | None:
    """The family that declares ``model_type`` (a vision tower's type), a family of its own before a fallback one;
    None when no family declares it."""
    found = [f for f, types in declarations() if model_type in types.processors]
    return min(found, key=lambda f: f.fallback) if found else None


def types_read_elsewhere(family: Family) -> set[str]:
    """The model types a family other than ``family`` declares and reads itself (fallback families excluded: they
    are tried only after every other family)."""
    return {t for f, types in declarations() if f is not family and not f.fallback for t in types.processors}


def tower_types() -> dict[str, str]:
    """Every declared whole-model type -> its vision tower's type."""
    return {whole: tower for _f, types in declarations() for whole, tower in types.towers.items()}


def processor_defaults(model_type: str | None) -> ProcessorDefaults | None:
    """The declared image-processor defaults of a (tower or whole-model) type, or None when no family declares it."""
    model_type = tower_types().get(model_type or "", model_type)
    family = reader_of(model_type)
    return None if family is None else family.hf_types.processors[model_type]


def video_model_types() -> tuple[str, ...]:
    """Every declared type of video model (a family whose ``HfTypes.clips`` is set), in ``FAMILIES`` order."""
    return tuple(t for _f, types in declarations() if types.clips for t in types.processors)


def video_processor_defaults(model_type: str | None) -> ProcessorDefaults | None:
    """The declared per-frame defaults of a video model type's video processor, or None when it is not one."""
    return processor_defaults(model_type) if model_type in video_model_types() else None


def implementation_request(model_type: str | None) -> dict[str, str]:
    """The ``attn_implementation`` keyword an ``hf:`` model of ``model_type`` is built with: the declaring family's
    (``HfTypes.attn_implementation``; {} where it keeps the checkpoint's own), "sdpa" for a type no family declares
    (the generic call-level capture reads it at its scaled_dot_product_attention calls)."""
    family = reader_of(tower_types().get(model_type or "", model_type))
    impl = "sdpa" if family is None else family.hf_types.attn_implementation
    return {} if impl is None else {"attn_implementation": impl}


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model."""
    return type(model).__module__.startswith("transformers.")


def is_image_classifier(model: nn.Module) -> bool:
    """Whether a transformers model is its ``*ForImageClassification`` class (it has class logits), not the bare
    ``*Model`` (the hierarchical families' ``spec.num_classes`` and ``logits``)."""
    return type(model).__name__.endswith("ForImageClassification")


def stage_model_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A hierarchical transformers model's output the views score: a classifier's class logits; else its pooled
    output (the mean of the last stage's tokens), or that mean taken here."""
    out = model(pixel_values=x)
    if is_image_classifier(model):
        return out.logits
    pooled = getattr(out, "pooler_output", None)
    return pooled if pooled is not None else out.last_hidden_state.mean(1)


def vision_tower(model: nn.Module) -> nn.Module:
    """The module vitlens reads: ``vision_model`` of CLIP/SigLIP models (their text tower untouched), the
    encoder ``vit`` of ``ViTMAEForPreTraining`` (not its decoder), else the model itself."""
    for attr in ("vision_model", "vit"):
        sub = getattr(model, attr, None)
        if isinstance(sub, nn.Module) and hasattr(sub, "embeddings") and hasattr(sub, "config"):
            return sub
    return model


def tower_type(model: nn.Module) -> str | None:
    """The model type of the vision tower vitlens reads (a whole model's type mapped by ``tower_types``)."""
    model_type = getattr(getattr(vision_tower(model), "config", None), "model_type", None)
    return tower_types().get(model_type or "", model_type)


def base_model(model: nn.Module, attrs: tuple[str, ...]) -> nn.Module:
    """The bare model a classifier wraps (its child named one of ``attrs``: ``swin``, ``pvt``, ...), else itself."""
    for attr in attrs:
        sub = getattr(model, attr, None)
        if isinstance(sub, nn.Module):
            return sub
    return model


def module_path(model: nn.Module, module: nn.Module) -> str:
    """The name of ``module`` inside ``model`` ("" for the model itself)."""
    return next(n for n, mod in model.named_modules() if mod is module)


def config_image_size(cfg: Any) -> Any:
    """The input size a vision config was built for (Siglip2: the position table's square grid)."""
    if getattr(cfg, "image_size", None) is not None:
        return cfg.image_size
    return math.isqrt(int(cfg.num_patches)) * pair(cfg.patch_size)[0]


def resize_inputs(model: nn.Module, x: torch.Tensor, fn: Any = None) -> dict[str, Any]:
    """``interpolate_pos_encoding=True`` for an input of another size than the config's, where ``fn`` (the call
    vitlens makes) takes it; nothing at the config's size (the outputs those of a plain call).

    Raises:
        InvalidParameterError: another size, and a model that cannot take one.
    """
    import inspect

    size, hw = pair(config_image_size(vision_tower(model).config)), (int(x.shape[-2]), int(x.shape[-1]))
    if hw == size:
        return {}
    try:
        takes = "interpolate_pos_encoding" in inspect.signature(fn or model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        return {"interpolate_pos_encoding": True}
    raise InvalidParameterError(
        f"{type(model).__name__} was built for {size[0]}x{size[1]} px inputs and cannot resample its position table "
        f"(no interpolate_pos_encoding); got {hw[0]}x{hw[1]} px: load it without another input_size.")


def label_names(model: nn.Module) -> list[str] | None:
    """The class names of a classifier's config (``id2label``), or None when it has none but LABEL_i."""
    id2label = getattr(model.config, "id2label", None) or {}
    n = int(getattr(model.config, "num_labels", 0) or 0)
    names = [id2label.get(i, id2label.get(str(i))) for i in range(n)]
    if not names or any(v is None for v in names) or all(str(v).startswith("LABEL_") for v in names):
        return None
    return [str(v) for v in names]


def data_config_of(model: nn.Module, spec: ModelSpec, defaults: ProcessorDefaults,
                   channels: int = 3) -> dict[str, Any]:
    """timm-style preprocessing of a transformers model from its image processor's ``defaults`` at the spec's
    input size, with its class names when it has them."""
    out = {"input_size": (channels, *spec.image_size), "interpolation": defaults.interpolation,
           "mean": defaults.unit_mean, "std": defaults.unit_std, "crop_pct": defaults.crop_pct,
           "crop_mode": defaults.crop_mode}
    names = label_names(model)
    if names:
        out["label_names"] = names
    return out


def default_data_config(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """timm-style preprocessing of a Hugging Face model from its type's declared image-processor defaults
    (``processor_defaults``) at the spec's input size, with its class names when it has them."""
    defaults = processor_defaults(tower_type(model))
    if defaults is None:
        raise KeyError(tower_type(model))  # a family reads only the types it declares
    return data_config_of(model, spec, defaults)


def processor_data_config(processor: dict[str, Any], model_type: str) -> dict[str, Any]:
    """timm-style preprocessing from a Hugging Face ``preprocessor_config.json`` (its type's declared defaults where
    the file says nothing; ViT's for a type no family declares)."""
    defaults = processor_defaults(model_type) or VIT_PROCESSOR
    interpolation = RESAMPLE.get(processor.get("resample", -1), defaults.interpolation)  # -1: no PIL filter
    # the file's own arithmetic (ViViT's: rescale_factor 1 / 127.5 and offset, then mean and std 0.5) on [0, 1] pixels
    read = ProcessorDefaults(defaults.crop_mode, defaults.crop_pct, tuple(processor.get("image_mean", defaults.mean)),
                             tuple(processor.get("image_std", defaults.std)), defaults.interpolation,
                             rescale=float(processor.get("rescale_factor", defaults.rescale)),
                             offset=(1.0 if processor["offset"] else 0.0) if "offset" in processor else defaults.offset)
    mean, std = read.unit_mean, read.unit_std
    if defaults.size_from_model:  # NaFlex: the size is the model's (its table's grid), not the processor's
        return {"interpolation": interpolation, "mean": mean, "std": std, "crop_pct": 1.0, "crop_mode": "squash"}
    size = processor.get("size") or {}
    crop = processor.get("crop_size") or {}
    if processor.get("do_center_crop") and crop:
        h, w = (int(crop.get("height", crop.get("shortest_edge", 224))),
                int(crop.get("width", crop.get("shortest_edge", 224))))
        short = int(size.get("shortest_edge", size.get("height", h)))
        mode, crop_pct = "center", min(h, w) / short
    elif "height" in size:
        h, w = int(size["height"]), int(size["width"])
        mode, crop_pct = "squash", 1.0
    # SAM: the longest side resized to it, then padded to a square (a square image: squash)
    elif "longest_edge" in size:
        h = w = int(size["longest_edge"])
        mode, crop_pct = "squash", 1.0
    else:
        h = w = int(size.get("shortest_edge", 224))
        mode, crop_pct = "center", 1.0
    return {"input_size": (3, h, w), "interpolation": interpolation, "mean": mean, "std": std, "crop_pct": crop_pct,
            "crop_mode": mode}


class HuggingFaceFamily(Family):
    """What a family of transformers models of its own declared types shares (Swin, PVT, Hiera, ViTDet, SAM): it
    matches the types it declares (``hf_types``), reads the bare model a classifier wraps (``base``) and its modeling
    module (``modeling``), refuses a model class it does not name (``check_model_class``), preprocesses with its
    declared processor defaults and scores a classifier's logits, else the pooled output."""

    #: the model classes read, by model type (a backbone or a pre-training head is refused)
    model_classes: Mapping[str, tuple[str, ...]] = {}
    #: the children of a wrapping model (a classifier's ``swin``, SAM's ``vision_encoder``) that are the bare model
    base_attrs: tuple[str, ...] = ()

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model) and self.hf_types is not None and tower_type(model) in self.hf_types.processors

    def base(self, model: nn.Module) -> nn.Module:
        """The bare model (a classifier's ``swin`` / ``pvt`` / ``hiera``, SAM's ``vision_encoder``), else the model."""
        return base_model(model, self.base_attrs)

    def modeling(self, model: nn.Module) -> Any:
        """The transformers modeling module of the bare model (where its layer and attention classes are)."""
        return sys.modules[type(self.base(model)).__module__]

    def check_model_class(self, model: nn.Module, name: str) -> None:
        """Refuse, in one line, a class of the model's type this family does not read (``model_classes``)."""
        read = self.model_classes[tower_type(model) or ""]
        if type(model).__name__ not in read:
            raise UnsupportedModelError(
                f"{name!r} is a Hugging Face {type(model).__name__}; vitlens reads {', '.join(read)} of this model "
                "type (load the checkpoint as one of those).")

    def num_classes(self, model: nn.Module) -> int:
        """The classes of a ``*ForImageClassification`` (0 for the bare model)."""
        return int(model.config.num_labels) if is_image_classifier(model) else 0

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return default_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else the pooled output (the mean token), or the mean of the last stage."""
        return stage_model_logits(model, x)


__all__ = ["CLIP_MEAN", "CLIP_STD", "HALF", "IMAGENET_MEAN", "IMAGENET_STD", "VIT_PROCESSOR", "HfTypes",
           "HuggingFaceFamily", "ProcessorDefaults", "base_model", "config_image_size", "data_config_of",
           "declarations", "default_data_config", "implementation_request", "is_hf_model", "is_image_classifier",
           "label_names",
           "module_path", "processor_data_config", "processor_defaults", "reader_of", "resize_inputs",
           "stage_model_logits", "tower_type", "tower_types", "types_read_elsewhere", "video_model_types",
           "video_processor_defaults", "vision_tower"]
