"""SAE files: vitlens's own (safetensors weights and a small JSON config, in one folder) and the layouts other tools
publish, read without running code (docs/security.md, "Checkpoints").

- vitlens: ``sae.safetensors`` (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``) beside ``sae.json`` (the ``SAEConfig``);
- SAELens / ViT-Prisma folders and saev checkpoints: ``vitlens.sae.external``.
"""
from __future__ import annotations

import json
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


def load_sae(path: str | Path, site: str | None = None, tokens: str | None = None) -> SparseAutoencoder:
    """An SAE from a file or folder, recognised by its layout (``vitlens.sae.external``: no layout runs code).

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
    from .external import SAELENS_CONFIG, SAELENS_WEIGHTS, load_saelens, load_saev

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


__all__ = ["CONFIG_FILE", "FORMAT", "PARAMETERS", "WEIGHTS_FILE", "build_sae", "load_sae", "read_json",
           "read_safetensors", "save_sae"]
