"""SAE files other tools publish, read without running code (docs/security.md, "Checkpoints"), so that a published SAE
of a pretrained CLIP or DINOv2 works once the user has downloaded it:

- SAELens and ViT-Prisma: a folder with ``cfg.json`` beside ``sae_weights.safetensors`` (``W_enc`` [d_in, d_sae],
  ``W_dec`` [d_sae, d_in], ``b_enc``, ``b_dec``); the config's ``architecture`` ("standard": ReLU, "topk") or
  ``activation_fn_str`` / ``activation_fn`` ("relu", "topk", with ``k`` in ``activation_fn_kwargs`` or at the top),
  ``hook_name`` (``hook_point`` in ViT-Prisma's; ``metadata.hook_name`` in SAELens 6), ``apply_b_dec_to_input``.
- saev (OSU-NLP): one file, a JSON header line (the config: ``d_vit``, ``exp_factor``, the activation) and then
  ``torch.save`` of the state dict, read with ``torch.load(weights_only=True)``: tensors only, no pickled code run.

Where a tool's encoder reads ``x`` rather than ``x - b_dec`` (SAELens with ``apply_b_dec_to_input`` false, saev's
schema 2), the same function is written in vitlens's form exactly: ``x W + b = (x - b_dec) W + (b + b_dec W)``.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .files import MAX_CONFIG_BYTES, PARAMETERS, build_sae, read_json, read_safetensors
from .model import SAEConfig, SparseAutoencoder

#: SAELens's / ViT-Prisma's files in its folder
SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
#: SAELens's normalisations that leave the activations as they are (any other one rescales them by a factor that is
#: not in these files)
PLAIN_NORMALISATIONS = (None, "none")


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
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    d_in, d_sae = positive_int(cfg, "d_in", where), positive_int(cfg, "d_sae", where)
    kwargs = cfg.get("activation_fn_kwargs") if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
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
        params = activation.get("params") if isinstance(activation.get("params"), dict) else {}
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
    cfg = header.get("cfg", header) if isinstance(header.get("cfg", header), dict) else {}
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


__all__ = ["SAELENS_CONFIG", "SAELENS_WEIGHTS", "fold_b_dec", "load_saelens", "load_saev"]
