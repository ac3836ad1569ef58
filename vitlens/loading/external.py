"""Models from outside timm: ``hf:ORG/NAME`` (the Hugging Face hub, or a local folder written by
``save_pretrained``), ``torchvision:vit_b_16``-style names and ``open_clip:ARCH`` / ``open_clip:ARCH/TAG``
(OpenCLIP; random init, or a pretrained tag's weights from the local cache only), offline-aware
like the timm path: weights already on disk are used without network, and a machine without
network is told so at once instead of hanging in a download.
"""
from __future__ import annotations

import contextlib
import json
import logging
import pickle
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from ..errors import CheckpointError, UnknownModelError, UnsupportedModelError, WeightsUnavailableError
from .hub import hub_offline, hub_reachable
from ..families.common.hf import implementation_request, processor_data_config
from .checkpoint import refuse_non_finite
from ..memory import available_bytes

HF_PREFIX, TORCHVISION_PREFIX, OPENCLIP_PREFIX = "hf:", "torchvision:", "open_clip:"
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
HF_INSTALL = {"python": "Install it with: pip install 'vitlens[hf]' (or pip install transformers).",
              "cli": "Install it with: pip install 'vitlens[hf]'.",
              "app": "Install it in the app's environment: pip install 'vitlens[hf]'."}


OPENCLIP_INSTALL = {"python": "Install it with: pip install 'vitlens[openclip]' (or pip install open_clip_torch).",
                    "cli": "Install it with: pip install 'vitlens[openclip]'.",
                    "app": "Install it in the app's environment: pip install 'vitlens[openclip]'."}


def _optional(module: str, models: str, package: str, fixes: dict[str, str]) -> Any:
    """An optional dependency, imported; a missing one is an UnsupportedModelError saying how to install it."""
    try:
        return __import__(module)  # the import statement's own hook (what a test without the package patches)
    except ImportError as e:
        raise UnsupportedModelError(f"{models} models need the {package} package, which is not installed.",
                                    fixes=fixes) from e


def _transformers() -> Any:
    return _optional("transformers", "Hugging Face", "transformers", HF_INSTALL)


#: the most of a model folder's config.json / preprocessor_config.json that is read (ImageNet-21k's 21,843 class
#: names take about 1 MB)
MAX_CONFIG_BYTES = 16 * 2**20


def read_json_capped(path: Path) -> Any:
    """A JSON file of a model folder, read only when it is a regular file (through links) of at most
    ``MAX_CONFIG_BYTES``: a FIFO is never opened, a huge file never read.

    Raises:
        UnknownModelError: not a regular file, too large, or not JSON.
    """
    import stat

    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UnknownModelError(f"{path} is not a regular file; give a folder written by save_pretrained.")
        if st.st_size > MAX_CONFIG_BYTES:
            raise UnknownModelError(f"{path} holds {st.st_size:,} bytes, more than a model's config may "
                                    f"({MAX_CONFIG_BYTES:,}); not read.")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"more than {MAX_CONFIG_BYTES:,} bytes")
        return json.loads(raw)
    except UnknownModelError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UnknownModelError(f"{path} is not a readable {path.name} ({type(e).__name__}: {e}).") from e


def _int_field(d: dict, key: str, default: int = 0) -> int:
    value = d.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _first(value: Any, default: int) -> int:
    value = value[0] if isinstance(value, (list, tuple)) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def estimated_parameters(config: dict) -> int:
    """About how many parameters the model a config describes has, from its sizes alone (no model built): in every
    (sub-)config, a transformer's blocks (4 h^2 + 2 h i each: attention and MLP), its patch and position
    embeddings and any vocabulary, and pyramid stages (``depths`` with ``embed_dim`` doubling, or
    ``hidden_sizes``: 12 c^2 a block). Biases, norms and heads are left out, so it errs low."""
    total, stack = 0, [config]
    while stack:
        d = stack.pop()
        stack.extend(v for v in d.values() if isinstance(v, dict))
        h, layers = _int_field(d, "hidden_size"), _int_field(d, "num_hidden_layers")
        if h and layers:
            total += layers * (4 * h * h + 2 * h * _int_field(d, "intermediate_size", 4 * h))
            patch = _first(d.get("patch_size"), 16)
            side = _first(d.get("image_size"), 224) // patch
            total += h * _int_field(d, "num_channels", 3) * patch * patch + side * side * h
            total += _int_field(d, "vocab_size") * h
        depths = d.get("depths")
        if isinstance(depths, list) and all(isinstance(n, int) and n > 0 for n in depths):
            sizes = d.get("hidden_sizes")
            if isinstance(sizes, list) and len(sizes) == len(depths) and all(isinstance(c, int) for c in sizes):
                total += sum(12 * n * c * c for n, c in zip(depths, sizes))
            elif _int_field(d, "embed_dim"):
                total += sum(12 * n * (_int_field(d, "embed_dim") * 2 ** s) ** 2 for s, n in enumerate(depths))
    return total


def refuse_too_large(ref: str, config: dict) -> None:
    """Refuse, before anything is built, a model whose config describes more float32 parameters than the memory
    there is now (``vitlens.memory.available_bytes``), naming both.

    Raises:
        UnsupportedModelError: the estimate (``estimated_parameters`` x 4 bytes) exceeds the available memory.
    """
    need, have = estimated_parameters(config) * 4, available_bytes()
    if have is not None and need > have:
        raise UnsupportedModelError(
            f"Refused hf:{ref}: its config.json describes a model of about {need // 4:,} parameters "
            f"(~{need / 2**30:,.1f} GiB in float32), more than the memory available here (~{have / 2**30:,.1f} GiB); "
            "not built. Check the sizes in its config.json.")


def _processor_config(folder_or_repo: str, local: bool) -> dict | None:
    """The preprocessor_config.json of a local folder or a cached hub repo, if there is one."""
    if local:
        path: Path | None = Path(folder_or_repo) / "preprocessor_config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(folder_or_repo, "preprocessor_config.json")
        path = Path(found) if isinstance(found, str) else None
    if path is None or not path.exists():
        return None
    data = read_json_capped(path)
    return data if isinstance(data, dict) else None


def _hf_config_json(folder_or_repo: str, local: bool) -> dict:
    """The raw config.json of a local folder or a cached hub repo ({} when there is none), read as JSON only."""
    if local:
        path: Path | None = Path(folder_or_repo) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(folder_or_repo, "config.json")
        path = Path(found) if isinstance(found, str) else None
    if path is None or not path.exists():
        return {}
    data = read_json_capped(path)
    if not isinstance(data, dict):
        raise UnknownModelError(f"{path} is not a Hugging Face config (a JSON object); got {type(data).__name__}.")
    return data


#: config.json keys through which a Hugging Face folder names Python code of its own to run
REMOTE_CODE_KEYS = ("auto_map", "custom_pipelines")


def refuse_remote_code(ref: str, config: dict) -> None:
    """Refuse a Hugging Face model whose config names its own code (``auto_map``): vitlens never runs a model
    folder's Python, and never asks whether to (it passes ``trust_remote_code=False`` as well).

    Raises:
        UnsupportedModelError: the config has an ``auto_map`` / ``custom_pipelines`` entry.
    """
    for key in REMOTE_CODE_KEYS:
        if config.get(key):
            where = ", ".join(sorted(str(v) for v in config[key].values())) if isinstance(config[key], dict) \
                else str(config[key])
            raise UnsupportedModelError(
                f"Refused hf:{ref}: its config.json has {key} pointing at the folder's own Python code "
                f"({where[:200]}); vitlens loads models without running code. Use a checkpoint of a standard "
                "transformers class.")


def transformers_class(transformers: Any, config: Any, arch: Any) -> type | None:
    """The transformers class ``arch`` names: a top-level export, or a class of the config's own modeling module
    inside the transformers package (Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel`` is not exported); None
    for a name transformers does not define (never a folder's own code)."""
    import importlib

    if not (isinstance(arch, str) and arch.isidentifier()):
        return None
    cls = getattr(transformers, arch, None)
    module = type(config).__module__
    if cls is None and module.startswith("transformers.models.") and ".configuration_" in module:
        try:
            cls = getattr(importlib.import_module(module.replace(".configuration_", ".modeling_")), arch, None)
        except ImportError:
            cls = None
    return cls if isinstance(cls, type) and cls.__module__.startswith("transformers.") else None


def looks_like_folder(ref: str) -> bool:
    """Whether an ``hf:`` reference is a path, not a hub id (``ORG/NAME``): it starts at a root, a home or a dot, or
    has more than one ``/`` (or a backslash), which no repository id has."""
    return ref.startswith(("/", "~", ".")) or ref.count("/") > 1 or "\\" in ref


def missing_folder(path: Path) -> UnknownModelError:
    """'the folder does not exist', with the folder's near namesakes beside it (a misspelt name)."""
    import difflib

    parent = path.parent
    near = []
    if parent.is_dir():
        try:
            near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir() if p.is_dir()], n=3)
        except OSError:  # an unreadable parent: no suggestion
            near = []
    hint = f" Did you mean {' or '.join(f'hf:{parent / n}' for n in near)}?" if near else ""
    where = "" if parent.is_dir() else f" (nor does {parent})"
    return UnknownModelError(f"The folder {path} does not exist{where}.{hint} Give the folder that save_pretrained "
                             "wrote (it holds config.json), or a hub id hf:ORG/NAME.")


def load_hf(name: str, pretrained: bool = True) -> tuple[nn.Module, str, str, dict | None]:
    """(model, display name, source, data config or None) for ``hf:ORG/NAME`` or ``hf:/a/folder``.

    Raises:
        UnsupportedModelError: transformers is missing, or the model is not one the hf family reads (ViT, DeiT,
            Dinov2, IJepa, ViTMAE with mask_ratio set to 0, CLIP/SigLIP/SigLIP2 vision towers).
        WeightsUnavailableError: not on disk and no network (or HF_HUB_OFFLINE).
    """
    transformers = _transformers()
    ref = name[len(HF_PREFIX):].strip()
    local = Path(ref).expanduser().is_dir()
    target = str(Path(ref).expanduser()) if local else ref
    kwargs: dict[str, Any] = {}
    if not local and looks_like_folder(ref):
        raise missing_folder(Path(ref).expanduser())
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
                    fixes={"python": "Save it where there is network (model.save_pretrained('folder')) and pass "
                                     "vl.load_model('hf:folder').",
                           "cli": "Save it where there is network (save_pretrained) and pass --model hf:FOLDER.",
                           "app": "Save it where there is network (save_pretrained) and give hf:FOLDER as the name."})
    refuse_remote_code(ref, _hf_config_json(target, local))
    kwargs["trust_remote_code"] = False  # never run, nor ask to run, a folder's own code
    try:
        config = transformers.AutoConfig.from_pretrained(target, **kwargs)
        if config.model_type == "vit_mae":  # the encoder on every patch: MAE would drop a random 75% at each forward
            config.mask_ratio = 0.0
        refuse_too_large(ref, config.to_dict())
        arch = (getattr(config, "architectures", None) or [None])[0]
        # a transformers model class, called through its loading API (from_pretrained, _from_config)
        cls: Any = transformers_class(transformers, config, arch)
        if arch is not None and not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise UnsupportedModelError(
                f"Refused hf:{ref}: its config.json names the architecture {arch!r}, which is not a transformers "
                "model class. Save the model with save_pretrained from a standard transformers class.")
        cls = cls or transformers.AutoModel
        # CLIP/SigLIP checkpoints load whole (CLIPModel, SiglipModel): vitlens reads the vision tower, the text
        # tower stays available as model.text_model
        impl = sdpa_request(config)
        if pretrained:
            model = _with_sdpa(lambda **i: cls.from_pretrained(target, config=config, **i, **kwargs), impl)
            refuse_non_finite(model.state_dict().items(), f"hf:{ref}")
        else:  # random init from the config: AutoModel builds through from_config, a model class from its config
            model = _with_sdpa(lambda **i: cls.from_config(config, **i) if cls is transformers.AutoModel
                               else cls._from_config(config, **i) if i else cls(config), impl)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"Refused to load hf:{ref}: its weights are a pickle that needs code to unpickle; vitlens only loads "
            "weights (weights_only=True). "
            "Re-save the model with save_pretrained (safetensors) from a trusted environment.") from e
    except UnsupportedModelError:
        raise
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"transformers could not load {ref!r}: {str(e).splitlines()[0]}") from e
    processor = _processor_config(target, local)
    data_config = processor_data_config(processor, config.model_type) if processor else None
    return model, f"hf:{ref}", ("random init" if not pretrained else (target if local else f"hf-hub:{ref}")), \
        data_config


def sdpa_request(config: Any) -> dict[str, str]:
    """The ``attn_implementation`` an ``hf:`` model is built with: the one the family that declares its model type
    asks for (``Family.hf_types``; {} where it keeps the checkpoint's own: ``hf-vit`` reads any, ``hf-pvt`` the one
    transformers has), ``{"attn_implementation": "sdpa"}`` for a type no family declares (DINOv3, AIMv2,
    Data2Vec-Vision, BEiT, ...: the generic call-level capture reads its scaled_dot_product_attention calls)."""
    return implementation_request(getattr(config, "model_type", None))


def _with_sdpa(build: Any, impl: dict[str, str]) -> nn.Module:
    """``build(**impl)``; a model class that has no sdpa implementation is built on its default instead (the generic
    capture then refuses it in one line, naming the implementation)."""
    if not impl:
        return build()
    try:
        return build(**impl)
    except ValueError as e:
        if "sdpa" not in str(e).lower() and "scaled_dot_product" not in str(e).lower():
            raise
        return build()


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
            fixes={"python": "Put the file there, or pass pretrained=False for random weights.",
                   "cli": "Put the file there, or add --random-init.",
                   "app": "Put the file there, or untick 'Pretrained weights'."})
    model.load_state_dict(weights.get_state_dict(progress=False))
    return model, f"torchvision:{arch}", weights.url


def _open_clip() -> Any:
    return _optional("open_clip", "OpenCLIP", "open_clip_torch", OPENCLIP_INSTALL)


def _open_clip_cached(cfg: dict) -> Path | None:
    """The local file of an open_clip pretrained tag (hub cache, or open_clip's ~/.cache/clip), or None."""
    import os

    hub = cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache

        # as open_clip resolves it: 'org/repo/file' or 'org/repo/' (its default file), safetensors first
        repo, filename = os.path.split(hub)
        filename = filename or "open_clip_pytorch_model.bin"
        safe = filename[:-4].replace("pytorch_model", "model") + ".safetensors" if filename.endswith(".bin") else None
        for n in dict.fromkeys([x for x in (safe, filename) if x]):
            found = try_to_load_from_cache(repo, n)
            if isinstance(found, str) and Path(found).is_file():
                return Path(found)
    url = cfg.get("url", "")
    if url:
        legacy = Path("~/.cache/clip").expanduser() / Path(url).name
        if legacy.is_file():
            return legacy
    return None


#: how open_clip's warning begins, on the root logger, when it builds a model without weights
OPEN_CLIP_RANDOM_INIT = "No pretrained weights loaded for model"


class _DropRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(OPEN_CLIP_RANDOM_INIT)


@contextlib.contextmanager
def _no_random_init_warning() -> Iterator[None]:
    """Drop open_clip's root-logger warning that no pretrained weights were loaded while vitlens builds a model with
    random weights on purpose (``open_clip:ARCH``: its source says "random init"); every other record passes."""
    drop, root = _DropRandomInitWarning(), logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def load_open_clip(name: str, pretrained: bool = True) -> tuple[nn.Module, str, str]:
    """(model, display name, source) for ``open_clip:ARCH`` (random init) or ``open_clip:ARCH/TAG`` (the tag's
    weights, from the local cache only: open_clip never downloads here).

    The whole CLIP model is loaded; vitlens reads its image tower (``model.visual``), the text tower stays.

    Raises:
        UnsupportedModelError: open_clip_torch is missing.
        UnknownModelError: not an open_clip architecture or tag.
        WeightsUnavailableError: the tag's weights are not in the local cache.
    """
    open_clip = _open_clip()
    from open_clip.pretrained import get_pretrained_cfg, list_pretrained_tags_by_model

    ref = name[len(OPENCLIP_PREFIX):].strip()
    arch, _, tag = ref.partition("/")
    if arch not in open_clip.list_models():
        import difflib

        close = difflib.get_close_matches(arch, open_clip.list_models(), n=5, cutoff=0.6)
        raise UnknownModelError(f"open_clip has no architecture {arch!r}." +
                                (f" Did you mean: {', '.join(close)}?" if close else "") +
                                " open_clip.list_models() lists them.")
    if not tag or not pretrained:
        with _no_random_init_warning():
            model = open_clip.create_model(arch, pretrained=None)
        return model, f"open_clip:{arch}", "random init"
    cfg = get_pretrained_cfg(arch, tag)
    if not cfg:
        tags = list_pretrained_tags_by_model(arch)
        raise UnknownModelError(f"open_clip has no pretrained tag {tag!r} for {arch}. "
                                f"Tags: {', '.join(tags) or 'none'}.",
                                fixes={"python": f"Or, for random weights: vl.load_model('open_clip:{arch}').",
                                       "cli": f"Or, for random weights: --model open_clip:{arch}.",
                                       "app": f"Or, for random weights: open_clip:{arch}."})
    path = _open_clip_cached(cfg)
    if path is None:
        where = cfg.get("hf_hub") or cfg.get("url")
        raise WeightsUnavailableError(
            f"The open_clip weights {arch}/{tag} ({where}) are not in the local cache; vitlens loads open_clip tags "
            "from the cache only.",
            fixes={"python": "Download them where there is network (open_clip.create_model("
                             f"{arch!r}, pretrained={tag!r})) and copy the cache over, or use "
                             f"vl.load_model('open_clip:{arch}') for random weights.",
                   "cli": f"Download them where there is network and copy the cache over, or --model open_clip:{arch}.",
                   "app": f"Download them where there is network and copy the cache over, or open_clip:{arch}."})
    preprocess = {k: cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if cfg.get(k) is not None}
    model = open_clip.create_model(arch, pretrained=str(path), force_quick_gelu=bool(cfg.get("quick_gelu", False)),
                                   force_preprocess_cfg=preprocess)
    return model, f"open_clip:{arch}/{tag}", str(path)
