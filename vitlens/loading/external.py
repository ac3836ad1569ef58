"""Models from outside timm: ``hf:ORG/NAME`` (the Hugging Face hub, or a local folder written by
``save_pretrained``) and ``torchvision:vit_b_16``-style names, offline-aware like the timm path:
weights already on disk are used without network, and a machine without network is told so at
once instead of hanging in a download.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import UnknownModelError, UnsupportedModelError, WeightsUnavailableError
from .hub import hub_offline, hub_reachable

HF_PREFIX, TORCHVISION_PREFIX = "hf:", "torchvision:"
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
HF_INSTALL = {"python": "Install it with: pip install 'vitlens[hf]' (or pip install transformers).",
              "cli": "Install it with: pip install 'vitlens[hf]'.",
              "app": "Install it in the app's environment: pip install 'vitlens[hf]'."}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise UnsupportedModelError("Hugging Face models need the transformers package, which is not installed.",
                                    fixes=HF_INSTALL) from e
    return transformers


def _processor_config(folder_or_repo: str, local: bool) -> dict | None:
    """The preprocessor_config.json of a local folder or a cached hub repo, if there is one."""
    if local:
        path = Path(folder_or_repo) / "preprocessor_config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(folder_or_repo, "preprocessor_config.json")
        path = Path(found) if isinstance(found, str) else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def load_hf(name: str, pretrained: bool = True) -> tuple[nn.Module, str, str, dict | None]:
    """(model, display name, source, data config or None) for ``hf:ORG/NAME`` or ``hf:/a/folder``.

    Raises:
        UnsupportedModelError: transformers is missing, or the model is not one the hf family reads (ViT, DeiT,
            Dinov2, IJepa, ViTMAE with mask_ratio set to 0, CLIP/SigLIP/SigLIP2 vision towers).
        WeightsUnavailableError: not on disk and no network (or HF_HUB_OFFLINE).
    """
    transformers = _transformers()
    from ..families.hf import processor_data_config

    ref = name[len(HF_PREFIX):].strip()
    local = Path(ref).expanduser().is_dir()
    target = str(Path(ref).expanduser()) if local else ref
    kwargs: dict[str, Any] = {}
    if not local:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(ref, "config.json"), str)
        if cached:
            kwargs["local_files_only"] = True
        else:
            why = "HF_HUB_OFFLINE is set" if hub_offline() else \
                (None if hub_reachable() else "the Hugging Face hub cannot be reached (no network)")
            if why:
                raise WeightsUnavailableError(
                    f"The Hugging Face model {ref!r} is not in the local cache and could not be downloaded: {why}.",
                    fixes={"python": f"Save it where there is network (model.save_pretrained('folder')) and pass "
                                     f"vl.load_model('hf:folder').",
                           "cli": "Save it where there is network (save_pretrained) and pass --model hf:FOLDER.",
                           "app": "Save it where there is network (save_pretrained) and give hf:FOLDER as the name."})
    try:
        config = transformers.AutoConfig.from_pretrained(target, **kwargs)
        if config.model_type == "vit_mae":  # the encoder on every patch: MAE would drop a random 75% at each forward
            config.mask_ratio = 0.0
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        cls = cls or transformers.AutoModel
        # CLIP/SigLIP checkpoints load whole (CLIPModel, SiglipModel): vitlens reads the vision tower, the text
        # tower stays available as model.text_model
        model = cls.from_pretrained(target, config=config, **kwargs) if pretrained else cls.from_config(config)
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"transformers could not load {ref!r}: {str(e).splitlines()[0]}") from e
    processor = _processor_config(target, local)
    data_config = processor_data_config(processor, config.model_type) if processor else None
    return model, f"hf:{ref}", ("random init" if not pretrained else (target if local else f"hf-hub:{ref}")), \
        data_config


def load_torchvision(name: str, pretrained: bool = True) -> tuple[nn.Module, str, str]:
    """(model, display name, source) for ``torchvision:vit_b_16`` and the other torchvision ViTs.

    Raises:
        UnknownModelError: not one of torchvision's ViTs.
        WeightsUnavailableError: weights not in torch's hub cache and no network.
    """
    import torch
    import torchvision

    arch = name[len(TORCHVISION_PREFIX):].strip()
    if arch not in TORCHVISION_VITS:
        raise UnknownModelError(f"torchvision:{arch} is not one of torchvision's Vision Transformers "
                                f"({', '.join(TORCHVISION_VITS)}).")
    if not pretrained:
        return torchvision.models.get_model(arch, weights=None), f"torchvision:{arch}", "random init"
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    model = torchvision.models.get_model(arch, weights=None)
    if cached.is_file():
        model.load_state_dict(torch.load(cached, map_location="cpu", weights_only=True))
        return model, f"torchvision:{arch}", str(cached)
    if hub_offline() or not hub_reachable(url=weights.url):
        raise WeightsUnavailableError(
            f"The torchvision weights of {arch} ({weights.url}) are not in torch's cache ({cached.parent}) and "
            "could not be downloaded (no network, or HF_HUB_OFFLINE is set).",
            fixes={"python": f"Put the file there, or pass pretrained=False for random weights.",
                   "cli": "Put the file there, or add --random-init.",
                   "app": "Put the file there, or untick 'Pretrained weights'."})
    model.load_state_dict(weights.get_state_dict(progress=False))
    return model, f"torchvision:{arch}", weights.url
