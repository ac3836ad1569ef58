"""A loaded model: the plain module in eval mode with its spec, family, device, dtype and data
config. vitlens never changes what the module computes; every view reads it through here.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..families import Family, family_of
from ..core.spec import ModelSpec
from ..core.windows import stage_heads
from ..errors import DeviceUnavailableError, InvalidParameterError, UnsupportedModelError
from ..kinds import kind_of
from ..reference import REFERENCE_NAMES
from ..families.base import model_lock
from .towers import describe_tower, find_tower

#: the kinds of weights a model can have (``LoadedModel.weights``, the survey table's ``weights`` column)
WEIGHT_KINDS = ("pretrained", "random init", "embedded", "checkpoint", "module")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU; a CUDA device without a GPU is refused clearly.

    Args:
        device: "cpu", "cuda", "cuda:1", a ``torch.device``, or None.

    Returns:
        The torch device.

    Raises:
        DeviceUnavailableError: CUDA asked for on a machine without a usable GPU.
        InvalidParameterError: a value that is not a torch device.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidParameterError(f"device must be a torch device such as 'cpu' or 'cuda'; got {device!r}.") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {str(dev)!r} was asked for, but this machine has no usable CUDA GPU "
                                     "(PyTorch finds no NVIDIA driver or device). Run on the CPU instead.")
    return dev


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dtype(dtype: torch.dtype) -> None:
    """The one check of a compute dtype (float32, or bf16/fp16 run under autocast)."""
    if dtype not in COMPUTE_DTYPES:
        raise InvalidParameterError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, not {dtype}.")


def read_target(module: nn.Module, name: str) -> tuple[nn.Module, Any, str]:
    """(the module read, its family, what ``ModelSpec.read_module`` says) of a model given to ``from_module``: the
    model itself where a family reads it (naming the tower a family reads inside it, as a CLIP model's
    ``vision_model``, unless it is a classifier, whose output is the whole model's); else the vision tower inside it
    (``loading.towers``: a VLM's, a depth, pose or detection model's), run alone on the images.

    Raises:
        UnsupportedModelError: neither the model nor any tower inside it is read (the model's own refusal).
    """
    try:
        family, outer, path = family_of(module, name), module, ""
    except UnsupportedModelError as refusal:
        path, outer, family = find_tower(module, name, refusal)
    tower = family.tower(outer) if family.tower is not None else outer
    if tower is not outer:
        inner = next(n for n, sub in outer.named_modules() if sub is tower)
        path = f"{path}.{inner}" if path else inner
    if not path or (outer is module and type(module).__name__.endswith("ForImageClassification")):
        return outer, family, ""
    return outer, family, describe_tower(path, tower)


@dataclass
class LoadedModel:
    """A ViT in eval mode with what the views need to read it.

    Attributes:
        model: the plain module (timm, or another family's). Loading puts it in eval mode, turns off its
            parameters' ``requires_grad`` and moves it to ``device`` (``from_module``); its weights are never
            changed. A capture or an attribution method installs hooks (and AttnLRP switches attention paths)
            only for its duration and removes them on exit and on error.
        spec: grid, stride, prefix tokens, depth, ... (``ModelSpec``).
        device: where it runs.
        dtype: compute dtype (bf16/fp16 run the forward under autocast).
        data_config: preprocessing (timm's keys: input_size, mean, std, interpolation, crop_pct, ...).
        source: where the weights came from, in words.
        family: how vitlens captures its attention (``vitlens.families``).
        weights: what kind of weights they are, one of ``WEIGHT_KINDS``: "pretrained" (hub
            weights), "random init", "embedded" (the reference pair's own), "checkpoint" (a
            local file) or "module" (a model built in user code).
        tokenizer: the text tower's tokenizer for models with one (CLIP/SigLIP), when known: set it for a
            Hugging Face model built from a config; open_clip's is found from the name (``vitlens.attribution.text``).
    """

    model: nn.Module
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype = torch.float32
    data_config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    # None only until __post_init__ reads it from the model (family_of): never None on a constructed LoadedModel
    family: Family = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    weights: str = "module"
    tokenizer: Any = field(default=None, repr=False, compare=False)
    _label_cache: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = family_of(self.model, self.spec.name)

    def block_names(self) -> list[str]:
        """Module names of the blocks, first to last: the modules that hold each attention module
        (what token norms and CKA hook; ``model.named_modules()`` names)."""
        names = {id(mod): n for n, mod in self.model.named_modules()}
        return [names[id(a)].rsplit(".", 1)[0] for a in self.family.attention_modules(self.model)]

    def blocks(self) -> list[nn.Module]:
        """The block modules of ``block_names``, first to last."""
        modules = dict(self.model.named_modules())
        return [modules[n] for n in self.block_names()]

    def __repr__(self) -> str:
        """One line, like the results (the module's own repr is thousands of characters)."""
        d = self.spec.describe()
        dtype = str(self.dtype).replace("torch.", "")
        depth = (f"{d['layers x heads']} heads" if "layers x heads" in d else
                 f"{len(self.spec.stage_heads)} stages of {d['heads per stage']} heads")
        return (f"LoadedModel({self.spec.name}: {d['kind']}, {d['input']}, {d['grid']}, {depth}, "
                f"{d['parameters']} parameters, {self.device}, {dtype}"
                + (f", from {self.source}" if self.source else "")
                + (f", {self.family.path}" if self.family is not None and self.family.path else "") + ")")

    def _repr_html_(self) -> str:
        """The spec as a small table in a notebook."""
        import html

        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in {**self.spec.describe(), "device": str(self.device),
                                    "dtype": str(self.dtype).replace("torch.", ""), "source": self.source}.items())
        return f"<table><caption>LoadedModel</caption>{rows}</table>"

    @classmethod
    def from_module(cls, module: nn.Module, name: str | None = None, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32, source: str = "module",
                    data_config: dict[str, Any] | None = None, weights: str | None = None) -> "LoadedModel":
        """Wrap a model built in user code (a fine-tuned copy, a subclass of a supported model).

        The module is put in eval mode on ``device`` and its parameters stop requiring
        gradients (vitlens never trains; gradient methods differentiate the input only).

        Args:
            module: the model.
            name: what results call it (default: its class name).
            device: torch device (default: where CUDA is available, else CPU).
            dtype: compute dtype for the forward (float32, bfloat16 or float16).
            source: where its weights came from, in words.
            data_config: preprocessing overrides (mean, std, input_size, ...).
            weights: the kind of weights (``WEIGHT_KINDS``; default "random init" when ``source``
                says so, else "module").

        Raises:
            UnsupportedModelError: naming the first block or attention type vitlens cannot capture.
        """
        check_dtype(dtype)
        name = name or type(module).__name__
        module, family, read_module = read_target(module, name)
        dev = resolve_device(device)
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        module.to(dev)
        size = tuple((data_config or {}).get("input_size", ())[-2:]) or None
        spec = family.spec(module, name, size)
        if kind_of(spec).stages:  # its heads by stage, from the family's windows (the facts show them)
            spec = dataclasses.replace(spec, stage_heads=stage_heads(family, module, spec.image_size))
        if read_module:
            spec = dataclasses.replace(spec, read_module=read_module)
        config = family.data_config(module, spec)
        config.update(data_config or {})
        kind = weights or ("random init" if source == "random init" else "module")
        return cls(model=module, spec=spec, device=dev, dtype=dtype, data_config=config, source=source,
                   family=family, weights=kind)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward when ``dtype`` is not float32 (e.g. bf16 on CUDA)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def preprocess(self, images: Any) -> torch.Tensor:
        """PIL images / paths / arrays -> [B, 3, H, W] on the model's device, with its data config."""
        # import cost: vitlens.images imports PIL, which this module does not at import
        from ..images import preprocess

        return preprocess(images, self.data_config).to(self.device)

    def display(self, images: Any) -> list[np.ndarray]:
        """Each image as the model sees it (resized, cropped), as uint8 [H, W, 3] for overlays.

        ``images`` may also be an already preprocessed batch [B, 3, H, W].
        """
        # import cost: vitlens.images imports PIL, which this module does not at import
        from ..images import display_image

        x = images if isinstance(images, torch.Tensor) else self.preprocess(images)
        x = x.unsqueeze(0) if x.ndim == 3 else x
        return [display_image(xi, self.data_config) for xi in x]

    def grid_for(self, input_hw: Sequence[int]) -> tuple[int, int]:
        """Patch-token grid for an input of (H, W) pixels (differs from spec.grid for dynamic sizes)."""
        return self.family.grid_for(self.model, self.spec, (int(input_hw[0]), int(input_hw[1])))

    def label_names(self) -> list[str] | None:
        """Class names of the classifier when known (ImageNet subsets via timm, reference classes)."""
        if self._label_cache is None:
            self._label_cache = self._find_label_names() or []
        return list(self._label_cache) or None

    def _find_label_names(self) -> list[str] | None:
        names = self.data_config.get("label_names")
        if names:
            return list(names)
        if self.spec.num_classes <= 0:
            return None
        try:
            from timm.data import ImageNetInfo, infer_imagenet_subset

            subset = infer_imagenet_subset(self.model)
            if subset is None:
                return None
            info = ImageNetInfo(subset)
            names = [info.index_to_description(i) for i in range(info.num_classes())]
        except Exception:  # class names are a convenience; never fail a view for them
            return None
        return names if len(names) == self.spec.num_classes else None

    @property
    def lock(self) -> Any:
        """The model's lock (``vitlens.families.base.model_lock``, re-entrant): every hook session on it (capture,
        pool attention, token norms, AttnLRP, ...) and every ``forward`` holds it, so two threads sharing this
        model (the app's sessions) wait for each other and never see each other's maps. Hold it yourself
        (``with m.lock:``) around several calls that must not interleave with another thread's."""
        return model_lock(self.model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for a batch already on the device (autocast applied; graph kept), under the
        model's lock (``lock``): a forward waits while another thread's hook session is on the model."""
        with self.lock, self.autocast():
            return self.family.logits(self.model, x)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for a preprocessed batch, in float32."""
        return self.forward(x.to(self.device)).float()

    def top_predictions(self, x: torch.Tensor, k: int = 5) -> list[tuple[str, float]]:
        """Top-k (label, probability) of one preprocessed image [1, 3, H, W]; [] without a classifier."""
        if self.spec.num_classes <= 0:
            return []
        probs = self.logits(x[:1]).softmax(-1)[0]
        values, idx = probs.topk(min(k, probs.numel()))
        names = self.label_names()
        return [(names[i] if names else f"class {i}", float(v)) for v, i in zip(values.tolist(), idx.tolist())]

    def prediction_caveat(self, image_source: str = "") -> str:
        """Why this model's predictions on these images mean nothing, or "" when they may mean something.

        Args:
            image_source: where the images come from: "shapes" (the reference scenes), "samples",
                "files", "upload", ... ("" when unknown).
        """
        if self.source == "random init":
            return ("Random weights: the predictions mean nothing, and the views show an untrained model "
                    "(useful for checking the machinery, not for reading the model).")
        if self.spec.name.split(" ")[0] in REFERENCE_NAMES and image_source not in ("", "shapes"):
            return ("The embedded models know only six synthetic shapes (see MODEL_CARD.md): on other images "
                    "their predictions mean nothing, though every view still shows what the model computes.")
        return ""

    def describe(self) -> dict[str, str]:
        """``spec.describe()`` plus where and how it runs."""
        return {**self.spec.describe(), "device": f"{self.device} ({str(self.dtype).replace('torch.', '')})",
                "weights": self.source}
