"""SAE files: vitlens's own (safetensors weights and a small JSON config, in one folder) and the layouts other tools
publish, read without running code (docs/security.md, "Checkpoints").

- vitlens: ``sae.safetensors`` (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``) beside ``sae.json`` (the ``SAEConfig``);
- SAELens and ViT-Prisma: a folder with ``cfg.json`` beside ``sae_weights.safetensors`` (``W_enc`` [d_in, d_sae],
  ``W_dec`` [d_sae, d_in], ``b_enc``, ``b_dec``); the config's ``architecture`` ("standard": ReLU, "topk") or
  ``activation_fn_str`` / ``activation_fn`` ("relu", "topk", with ``k`` in ``activation_fn_kwargs`` or at the top),
  ``hook_name`` (``hook_point`` in ViT-Prisma's; ``metadata.hook_name`` in SAELens 6), ``apply_b_dec_to_input``;
- saev (OSU-NLP): one file, a JSON header line (the config: ``d_vit``, ``exp_factor``, the activation) and then
  ``torch.save`` of the state dict, read with ``torch.load(weights_only=True)``: tensors only, no pickled code run.

Where a tool's encoder reads ``x`` rather than ``x - b_dec`` (SAELens with ``apply_b_dec_to_input`` false, saev's
schema 2), the same function is written in vitlens's form exactly: ``x W + b = (x - b_dec) W + (b + b_dec W)``.
A published SAE of a pretrained CLIP or DINOv2 thus works once the user has downloaded it.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..results import atomic_write_bytes
from .model import SAEConfig, SparseAutoencoder

#: the files of a vitlens SAE folder
WEIGHTS_FILE = "sae.safetensors"
CONFIG_FILE = "sae.json"
#: the format's name and version in ``sae.json``
FORMAT = "vitlens-sae"
VERSION = 1
#: the parameters every SAE file holds, with their shapes in terms of (d_in, F)
PARAMETERS = ("W_enc", "b_enc", "W_dec", "b_dec")
#: the largest JSON config read (a config is a few hundred bytes)
MAX_CONFIG_BYTES = 1 << 20


def save_sae(sae: SparseAutoencoder, path: str | Path) -> Path:
    """Write ``sae`` to the folder ``path`` (created): ``sae.safetensors`` and ``sae.json``, each whole or not at
    all.

    Returns:
        The folder.
    """
    from safetensors.torch import save

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file; save_sae writes a folder (sae.safetensors and sae.json): name a "
                              "new or existing folder.")
    tensors = {name: getattr(sae, name).detach().float().cpu().contiguous() for name in PARAMETERS}
    atomic_write_bytes(folder / WEIGHTS_FILE, save(tensors, metadata={"format": FORMAT}))
    config = {"format": FORMAT, "version": VERSION, **sae.config.to_dict()}
    atomic_write_bytes(folder / CONFIG_FILE, (json.dumps(config, indent=1) + "\n").encode())
    return folder


def read_json(path: Path) -> dict[str, Any]:
    """A small JSON object from ``path``, refused in one line when it is large, not JSON or not an object."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{path} is {size} bytes, larger than an SAE config ({MAX_CONFIG_BYTES} at most); "
                                  "not read.")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable JSON config: {e}.") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not the object of an SAE config.")
    return data


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (a format of plain tensors: reading it runs no code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}.") from e


def build_sae(config: SAEConfig, tensors: dict[str, torch.Tensor], where: Path) -> SparseAutoencoder:
    """An SAE of ``config`` holding ``tensors`` (``PARAMETERS``, shapes checked against the config first)."""
    d, f = config.d_in, config.n_features
    shapes = {"W_enc": (d, f), "b_enc": (f,), "W_dec": (f, d), "b_dec": (d,)}
    missing = [n for n in PARAMETERS if n not in tensors]
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing)}; an SAE file holds {', '.join(PARAMETERS)}.")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {shapes[n]})" for n in PARAMETERS
             if tuple(tensors[n].shape) != shapes[n]]
    if wrong:
        raise CheckpointError(f"{where}: shapes do not fit d_in={d}, n_features={f}: {'; '.join(wrong)}.")
    sae = SparseAutoencoder(config)
    with torch.no_grad():
        for name in PARAMETERS:
            getattr(sae, name).copy_(tensors[name].float())
    return sae


def load_vitlens(folder: Path) -> SparseAutoencoder:
    """An SAE from a folder ``save_sae`` wrote."""
    data = read_json(folder / CONFIG_FILE)
    if data.pop("format", None) != FORMAT:
        raise CheckpointError(f"{folder / CONFIG_FILE} is not a vitlens SAE config (no format {FORMAT!r}).")
    version = data.pop("version", None)
    if version != VERSION:
        raise CheckpointError(f"{folder / CONFIG_FILE} is version {version!r} of the SAE format; this vitlens reads "
                              f"version {VERSION}: upgrade vitlens.")
    try:
        config = SAEConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / CONFIG_FILE}: {e}") from e
    return build_sae(config, read_safetensors(folder / WEIGHTS_FILE), folder)


#: SAELens's / ViT-Prisma's files in its folder
SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
#: SAELens's normalisations that leave the activations as they are (any other one rescales them by a factor that is
#: not in these files)
PLAIN_NORMALISATIONS = (None, "none")


def mapping(value: Any) -> dict[str, Any]:
    """``value`` where it is a JSON object, else an empty one (an absent or malformed part of a config)."""
    return value if isinstance(value, dict) else {}


def fold_b_dec(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of an encoder that reads ``x`` rewritten for one that reads ``x - b_dec`` (the same function)."""
    out = dict(tensors)
    out["b_enc"] = tensors["b_enc"].double() + tensors["b_dec"].double() @ tensors["W_enc"].double()
    return out


def kind_and_k(name: Any, k: Any, where: Path) -> tuple[str, int | None]:
    """("topk", k) or ("relu", None) of a tool's activation name, refused by name otherwise."""
    name = str(name).lower()
    if name in ("relu", "standard"):
        return "relu", None
    if name == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise CheckpointError(f"{where}: a TopK SAE without a positive integer k (got {k!r}).")
        return "topk", k
    raise CheckpointError(f"{where}: activation {name!r} is not one vitlens's SAE computes (ReLU or TopK); "
                          "JumpReLU, gated and BatchTopK SAEs are not read.")


def site_of(hook: Any) -> str:
    """A hook's name as a vitlens site (``blocks.9.hook_resid_post``), "" when it is not one of that form."""
    return hook if isinstance(hook, str) and re.fullmatch(r"blocks\.\d+\.[\w.]+|hook_\w+|ln_final\.\w+", hook) else ""


def positive_int(cfg: dict, key: str, where: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key} must be a positive integer; got {value!r}.")
    return value


def load_saelens(folder: Path, site: str | None = None, tokens: str | None = None) -> SparseAutoencoder:
    """An SAE from a SAELens / ViT-Prisma folder (``cfg.json`` + ``sae_weights.safetensors``)."""
    where = folder / SAELENS_CONFIG
    cfg = read_json(where)
    meta = mapping(cfg.get("metadata"))
    d_in, d_sae = positive_int(cfg, "d_in", where), positive_int(cfg, "d_sae", where)
    kwargs = mapping(cfg.get("activation_fn_kwargs"))
    arch = cfg.get("architecture") or "standard"
    if arch not in ("standard", "topk"):
        kind_and_k(arch, None, where)  # refused by name: JumpReLU, gated, ...
    name = "topk" if arch == "topk" else cfg.get("activation_fn_str") or cfg.get("activation_fn") or "relu"
    kind, k = kind_and_k(name, kwargs.get("k", cfg.get("k")), where)
    normalisation = cfg.get("normalize_activations")
    if normalisation not in PLAIN_NORMALISATIONS:
        raise CheckpointError(f"{where}: normalize_activations={normalisation!r} rescales the activations by a factor "
                              "these files do not hold; vitlens reads SAEs of the raw activations only.")
    tensors = read_safetensors(folder / SAELENS_WEIGHTS)
    if not cfg.get("apply_b_dec_to_input", True):
        tensors = fold_b_dec({n: tensors[n] for n in PARAMETERS if n in tensors}) \
            if all(n in tensors for n in PARAMETERS) else tensors
    hook = cfg.get("hook_name") or cfg.get("hook_point") or meta.get("hook_name")
    config = SAEConfig(d_in=d_in, n_features=d_sae, kind=kind, k=k, site=site or site_of(hook),
                       tokens=tokens or "all", model_name=str(cfg.get("model_name") or meta.get("model_name") or ""))
    return build_sae(config, tensors, folder)


def saev_activation(cfg: dict, header: dict, where: Path) -> tuple[str, int | None, bool]:
    """(kind, k, encoder reads x - b_dec) of a saev header, in each of its schemas."""
    schema = header.get("schema")
    if schema is None:  # the first files: the config itself, a ReLU SAE
        return "relu", None, True
    activation = cfg.get("activation")
    if schema == 1 and header.get("cls") in ("Relu", "TopK", "BatchTopK"):
        return (*kind_and_k(header["cls"], cfg.get("top_k"), where), True)
    if schema in (1, 2) and isinstance(activation, dict):
        params = mapping(activation.get("params"))
        return (*kind_and_k(activation.get("cls"), params.get("top_k"), where), schema == 1)
    if schema == 1:
        return "relu", None, True
    raise CheckpointError(f"{where}: saev header schema {schema!r} is not one vitlens reads (none, 1 or 2).")


def load_saev(path: Path, site: str | None = None, tokens: str | None = None) -> SparseAutoencoder:
    """An SAE from a saev checkpoint: a JSON header line, then the state dict (loaded with ``weights_only``)."""
    with open(path, "rb") as f:
        line = f.readline(MAX_CONFIG_BYTES + 1)
        if len(line) > MAX_CONFIG_BYTES or not line.endswith(b"\n"):
            raise CheckpointError(f"{path} does not start with a saev header line (a JSON object, then a newline).")
        try:
            header = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: its first line is not JSON ({e}); not a saev checkpoint.") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: its first line is a JSON {type(header).__name__}, not a saev header.")
        try:
            state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        except Exception as e:  # the restricted unpickler refuses anything but tensors and plain containers
            raise CheckpointError(f"{path}: the state dict after the header is not plain tensors ({type(e).__name__}: "
                                  f"{str(e)[:200]}); not loaded.") from e
    cfg = mapping(header.get("cfg", header))
    kind, k, centred = saev_activation(cfg, header, path)
    d_vit, factor = positive_int(cfg, "d_vit", path), positive_int(cfg, "exp_factor", path)
    if not isinstance(state, dict) or not all(isinstance(state.get(n), torch.Tensor) for n in PARAMETERS):
        raise CheckpointError(f"{path}: the state dict lacks {', '.join(PARAMETERS)}.")
    tensors = {n: state[n] for n in PARAMETERS}
    if not centred:
        tensors = fold_b_dec(tensors)
    config = SAEConfig(d_in=d_vit, n_features=d_vit * factor, kind=kind, k=k, site=site or "",
                       tokens=tokens or "patches")
    return build_sae(config, tensors, path)



def load_sae(path: str | Path, site: str | None = None, tokens: str | None = None) -> SparseAutoencoder:
    """An SAE from a file or folder, recognised by its layout (no layout runs code).

    Args:
        path: a folder ``save_sae`` wrote (``sae.json`` + ``sae.safetensors``), a SAELens / ViT-Prisma folder
            (``cfg.json`` + ``sae_weights.safetensors``) or a saev checkpoint file (a JSON header line, then the
            state dict).
        site: the site it reads, where the file names none or another tool's name for it (default: the file's).
        tokens: which tokens it reads, "patches", "prefix" or "all" (default: vitlens's file says; "all" for
            SAELens / ViT-Prisma, "patches" for saev, whose files do not say).

    Returns:
        The ``SparseAutoencoder`` (its ``config`` says what it reads where the file says).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: name an SAE folder or a saev checkpoint file.")
    if p.is_dir() and (p / CONFIG_FILE).is_file():
        sae = load_vitlens(p)
        overrides = {k: v for k, v in (("site", site), ("tokens", tokens)) if v}
        sae.config = SAEConfig.from_dict({**sae.config.to_dict(), **overrides})
        return sae
    if p.is_dir() and (p / SAELENS_CONFIG).is_file() and (p / SAELENS_WEIGHTS).is_file():
        return load_saelens(p, site, tokens)
    if p.is_file():
        return load_saev(p, site, tokens)
    raise CheckpointError(f"{p} is not an SAE this vitlens reads: expected a folder with {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE} (save_sae), a folder with {SAELENS_CONFIG} and {SAELENS_WEIGHTS} (SAELens, "
                          "ViT-Prisma) or a saev checkpoint file.")


__all__ = ["CONFIG_FILE", "FORMAT", "PARAMETERS", "SAELENS_CONFIG", "SAELENS_WEIGHTS", "WEIGHTS_FILE", "build_sae",
           "fold_b_dec", "load_sae", "load_saelens", "load_saev", "read_json", "read_safetensors", "save_sae"]
