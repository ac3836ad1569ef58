"""From a name to a loaded model: embedded reference models, timm names (hub weights or random
init), local checkpoint files with their architecture, and modules built in user code.

Every failure is a vitlens exception whose message says what to do, with hints for the Python
API, the command line and the app (``VitlensError.message_for``).
"""
from __future__ import annotations

import difflib
import itertools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import (CheckpointError, InvalidParameterError, UnknownModelError, UnsupportedModelError,
                      WeightsUnavailableError)
from ..families import family_of
from ..families.generic import state_token_layout
from ..reference import REFERENCE_NAMES, build_reference, weights_path
from .checkpoint import (file_num_classes, fitting_architectures, load_checkpoint_into, looks_like_checkpoint_path,
                         shape_summary, tensor_shapes)
from .external import HF_PREFIX, OPENCLIP_PREFIX, TORCHVISION_PREFIX, load_hf, load_open_clip, load_torchvision
from .hub import resolve_pretrained_source
from .model import LoadedModel, check_dtype, resolve_device

#: how each interface asks for random weights / a checkpoint with its architecture
RANDOM_INIT = {"python": "pass pretrained=False", "cli": "add --random-init",
               "app": "untick 'Pretrained weights' (Name source)"}


def loadable(name: str) -> bool:
    """Whether timm's ``name`` builds a model vitlens can capture (built on the meta device: no memory).

    Args:
        name: a timm model name.

    Returns:
        True when a family would capture it exactly.
    """
    import timm


    try:
        family_of(timm.create_model(name, pretrained=False, device="meta"), name)
    except Exception:  # refused, or timm cannot build it without arguments
        return False
    return True


def suggest(name: str) -> UnknownModelError:
    """The error for an unknown name, with close timm names that vitlens can load.

    Args:
        name: the name that did not resolve.

    Returns:
        An ``UnknownModelError`` (to raise) whose message names up to five close names.
    """
    import timm

    base = name.split(".")[0]
    choices = timm.list_models()
    close = difflib.get_close_matches(base, choices, n=12, cutoff=0.6)
    if not close:
        close = [c for c in choices if base[:6] and c.startswith(base[:6])][:12]
    # building each candidate (even on the meta device, timm initialises its weights) is ~0.3 s: stop at five
    close = list(itertools.islice((c for c in close if loadable(c)), 5))
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return UnknownModelError(
        f"Unknown model {name!r}: it is not a vitlens reference model, a timm model name or an existing file.{hint}",
        fixes={"python": "vl.list_models() lists presets; timm.list_models('vit_*') lists timm's ViTs.",
               "cli": "`vitlens models` lists the presets and the families vitlens reads.",
               "app": "Pick an Embedded model or a Preset, or check the spelling."})


def name_problem(name: str) -> UnknownModelError | None:
    """The error ``load_model(name)`` would give for a name that resolves to nothing, found without
    building a model or reading weights (a survey's driver asks it before it starts a worker per model); None for a
    name that may load: a reference model, a prefix (``hf:``, ``open_clip:``, ``torchvision:``), a file, a timm
    name (and pretrained tag) that timm knows. What only loading can tell (refused architectures, missing weights)
    is left to the load."""
    if not isinstance(name, str) or not name.strip():
        return UnknownModelError(f"A model name must be a non-empty string; got {name!r}.")
    if name in REFERENCE_NAMES or name.startswith((HF_PREFIX, OPENCLIP_PREFIX, TORCHVISION_PREFIX)):
        return None
    path, sep, _arch = name.rpartition("@")
    if (sep and looks_like_checkpoint_path(path)) or (looks_like_checkpoint_path(name) and not _is_timm_name(name)):
        return None
    import timm

    if not timm.is_model(name):
        return suggest(name)
    if "." in name and name not in timm.list_pretrained(name):
        tags = timm.list_pretrained(name.split(".")[0] + ".*")
        return UnknownModelError(f"timm has no pretrained weights named {name!r}. "
                                 f"Available for this architecture: {', '.join(tags) or 'none'}.",
                                 fixes={k: f"Or, for random weights: {v}." for k, v in RANDOM_INIT.items()})
    return None


def _create_checked(name: str, **kwargs: Any) -> None:
    """Build ``name`` on the meta device (no memory, no weights) to refuse unsupported models early."""
    import timm


    try:
        meta = timm.create_model(name, pretrained=False, device="meta", **kwargs)
    except TypeError as e:
        raise UnknownModelError(f"timm cannot build {name!r} with {kwargs}: {e}") from e
    family_of(meta, name)


def _from_checkpoint(name: str, arch: str | None, **kwargs: Any) -> tuple[nn.Module, str, str]:
    import timm


    path = Path(name).expanduser()
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint file. Give the weights file inside it "
                              "(.safetensors, .pth/.pt/.bin, .npz), or, for a folder written by save_pretrained, "
                              f"the model name hf:{path}.")
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file not found: {path}. Check the path.")
    if not arch:  # suggest only architectures whose every tensor fits the file's, or none
        fits = fitting_architectures(path)
        if fits:
            raise CheckpointError(f"{path} is a checkpoint file: pass its architecture too; "
                                  f"{' or '.join(fits)} fit{'s' if len(fits) == 1 else ''} its tensors.",
                                  fixes={"python": f"For example: vl.load_model({str(path)!r}, arch={fits[0]!r}).",
                                         "cli": f"For example: --model {path} --arch {fits[0]}.",
                                         "app": f"Give it in the Architecture field: {fits[0]}."})
        try:
            shape = shape_summary(tensor_shapes(path))
        except CheckpointError:
            shape = "tensors vitlens cannot read"
        raise CheckpointError(f"{path} is a checkpoint file: pass its architecture too (the one it was trained "
                              f"with; the file has {shape}, and none of vitlens's usual architectures fits it).",
                              fixes={"python": "Pass arch= the timm name it was trained with.",
                                     "cli": "Pass --arch with the timm name it was trained with.",
                                     "app": "Give it in the Architecture field (a timm name, or ref-vit / "
                                            "ref-hybrid)."})
    if arch in REFERENCE_NAMES:
        model = build_reference(arch)
    else:
        if not timm.is_model(arch):
            raise suggest(arch)
        if "num_classes" not in kwargs and (classes := file_num_classes(path, arch)) is not None:
            kwargs = {**kwargs, "num_classes": classes}  # a fine-tuned head: the file says its size
        _create_checked(arch, **kwargs)
        model = timm.create_model(arch, pretrained=False, **kwargs)
    load_checkpoint_into(model, path, arch)
    return model, f"{arch} ({path.name})", str(path)


def _from_timm(name: str, pretrained: bool, **kwargs: Any) -> tuple[nn.Module, str, str]:
    import timm

    problem = name_problem(name)
    if problem is not None:
        raise problem
    _create_checked(name, **kwargs)
    if not pretrained:
        return timm.create_model(name, pretrained=False, **kwargs), name, "random init"

    from timm.models import get_pretrained_cfg


    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise WeightsUnavailableError(f"timm has no pretrained weights for {name!r}.",
                                      fixes={k: f"For random weights: {v}." for k, v in RANDOM_INIT.items()})
    cached = resolve_pretrained_source(name, cfg.to_dict())
    overlay = {"file": str(cached), "source": ""} if cached is not None else None
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except (OSError, RuntimeError) as e:
        raise WeightsUnavailableError(f"Loading the pretrained weights of {name!r} failed: {e}") from e
    return model, name, str(cached) if cached else f"hub:{cfg.hf_hub_id or cfg.url}"


def load_model(
    name: str | nn.Module,
    pretrained: bool = True,
    arch: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    token_layout: Any = None,
    **kwargs: Any,
) -> LoadedModel:
    """Load a ViT for analysis.

    Args:
        name: an embedded reference model ("ref-vit", "ref-hybrid"), a timm model name with optional
            pretrained tag ("vit_base_patch16_224.augreg2_in21k_ft_in1k"; ViT, DeiT, BEiT, EVA, ...), a
            local checkpoint file (.safetensors, .pth/.pt/.bin state dict, original ViT .npz) together
            with ``arch``, "hf:ORG/NAME" or "hf:FOLDER" (Hugging Face ViT/DeiT/Dinov2/IJepa/ViTMAE, CLIP/SigLIP; needs
            transformers), "torchvision:vit_b_16" (and torchvision's other ViTs), "open_clip:ViT-B-32"
            (random init) or "open_clip:ViT-B-32/laion2b_s34b_b79k" (a tag's weights from the local cache;
            needs open_clip_torch), or a module built in code (as ``LoadedModel.from_module``).
        pretrained: load hub weights for a timm name (False: random init).
        arch: architecture of a local checkpoint (timm name or reference name).
        device: torch device; default CUDA when available, else CPU.
        dtype: compute dtype; torch.bfloat16/float16 run the forward under autocast while every
            statistic vitlens computes stays in float32/float64.
        token_layout: for a module built in code read by the generic capture, what each token of its attention is
            (a ``vitlens.core.tokens.TokenLayout``: prefix tokens wherever they stand, cells of its grid), where vitlens
            cannot infer it; refused in one line when it does not fit the attention's token count.
        **kwargs: passed to ``timm.create_model`` (e.g. ``img_size=(160, 224)``, ``dynamic_img_size=True``).

    Returns:
        A ``LoadedModel``: the module in eval mode on ``device``, its ``spec`` (grid, stride, prefix
            tokens, layers x heads), its preprocessing and its family.

    Raises:
        UnknownModelError: a name that is no reference model, timm name, prefix or file (close names suggested).
        UnsupportedModelError: a model whose attention no family reproduces exactly (XCiT, NaFlexViT, a CNN, ...;
            the families it names are ``vitlens.families.supported_families()``).
        WeightsUnavailableError: hub weights with no network and no local cache.
        CheckpointError: a checkpoint without ``arch``, unreadable, mismatched, or a pickle that needs code.
        DeviceUnavailableError: a device that is not there.
        InvalidParameterError: a bad keyword argument.
    """
    check_dtype(dtype)
    dev = resolve_device(device)
    if token_layout is not None and not isinstance(name, nn.Module):
        raise InvalidParameterError("token_layout= is for a module built in code (vl.load_model(module, "
                                    "token_layout=...)); a named model's token layout is read from the model.")
    if isinstance(name, nn.Module):
        _refuse_unused("a module built in code", "it is already built", arch, kwargs)
        if token_layout is None:
            return LoadedModel.from_module(name, device=dev, dtype=dtype)
        state_token_layout(name, token_layout)
        m = LoadedModel.from_module(name, device=dev, dtype=dtype)
        if m.family.name != "generic":
            raise InvalidParameterError(f"token_layout= is read by the generic call-level capture; {m.spec.name!r} "
                                        f"is read by the {m.family.name!r} family, which knows its tokens: drop it.")
        return m
    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError(f"A model name must be a non-empty string or an nn.Module; got {name!r}.")
    for prefix, why in ((HF_PREFIX, "Hugging Face models are built from their own config"),
                        (OPENCLIP_PREFIX, "OpenCLIP models are built from their own config"),
                        (TORCHVISION_PREFIX, "torchvision ViTs are built at their own size")):
        if name.startswith(prefix):
            _refuse_unused(repr(name), why, arch, kwargs)
    if name.startswith(HF_PREFIX):
        model, label, source, data_config = load_hf(name, pretrained)
        return LoadedModel.from_module(model, name=label, device=dev, dtype=dtype, source=source,
                                       data_config=data_config, weights=_hub_weights(source))
    if name.startswith(OPENCLIP_PREFIX):
        model, label, source = load_open_clip(name, pretrained)
        return LoadedModel.from_module(model, name=label, device=dev, dtype=dtype, source=source,
                                       weights=_hub_weights(source))
    if name.startswith(TORCHVISION_PREFIX):
        model, label, source = load_torchvision(name, pretrained)
        return LoadedModel.from_module(model, name=label, device=dev, dtype=dtype, source=source,
                                       weights=_hub_weights(source))
    weights = "embedded"
    if arch and arch != name and not looks_like_checkpoint_path(name):  # never ignored silently
        ignored = ", ".join([f"arch={arch!r}"] + ([f"{k}={v!r}" for k, v in kwargs.items()]
                                                 if name in REFERENCE_NAMES else []))
        raise InvalidParameterError(
            f"load_model({name!r}) cannot honour {ignored}: arch= is for a checkpoint file, and {name!r} is a "
            "model name that brings its own architecture.",
            fixes={"python": f"Drop arch=, or pass a checkpoint file: vl.load_model('weights.safetensors', "
                             f"arch={arch!r}).",
                   "cli": f"Drop --arch, or pass a checkpoint file: --model weights.safetensors --arch {arch}.",
                   "app": "The Architecture field is for checkpoint files only."})
    if name in REFERENCE_NAMES:
        _refuse_unused(repr(name), "the embedded reference models are built as they were trained", arch, kwargs)
        model = build_reference(name)
        path = weights_path(name)
        if not path.is_file():
            raise WeightsUnavailableError(
                f"The weights of the embedded model {name!r} are missing ({path}); reinstall vitlens or "
                "train them with: python analyses/locality_sweep.py --recipes pair-alike (MODEL_CARD.md)")
        load_checkpoint_into(model, path, name)
        model, label, source = model, name, str(path)
    elif looks_like_checkpoint_path(name) and not _is_timm_name(name):
        model, label, source = _from_checkpoint(name, arch, **kwargs)
        weights = "checkpoint"
    else:
        _refuse_unused(repr(name), "arch= names the architecture of a checkpoint file", arch, {})
        model, label, source = _from_timm(name, pretrained, **kwargs)
        weights = _hub_weights(source)
    return LoadedModel.from_module(model, name=label, device=dev, dtype=dtype, source=source, weights=weights)


def _refuse_unused(what: str, why: str, arch: str | None, kwargs: dict[str, Any]) -> None:
    """Refuse the ``arch`` and keyword arguments a loader would silently ignore, naming each."""
    unused = ([f"arch={arch!r}"] if arch is not None else []) + [f"{k}={v!r}" for k, v in kwargs.items()]
    if unused:
        raise InvalidParameterError(
            f"load_model({what}) cannot honour {', '.join(unused)}: {why}, so vitlens would ignore "
            f"{'it' if len(unused) == 1 else 'them'}. Drop {'it' if len(unused) == 1 else 'them'} (keyword arguments "
            "reach timm.create_model for timm names; arch= goes with a checkpoint file).")


def _hub_weights(source: str) -> str:
    return "random init" if source == "random init" else "pretrained"


def _is_timm_name(name: str) -> bool:
    import timm

    return timm.is_model(name)


__all__ = ["UnsupportedModelError", "load_model", "loadable", "suggest"]
