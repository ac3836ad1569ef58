"""What a survey manifest's model entries say: each model's file key, its kind of weights (pretrained, random
init, embedded, a checkpoint's), a ``PATH@ARCH`` checkpoint's parts and its file's digest, and how many images a
manifest's image source holds."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from ..reference import REFERENCE_NAMES
from ..loading.checkpoint import looks_like_checkpoint_path




def model_key(name: str, pretrained: bool = True) -> str:
    """A file name for a model and its weights (readable, and unique through a short hash)."""
    ident = name if pretrained else f"{name}#random-init"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]
    return f"{safe}{'' if pretrained else '-random'}-{hashlib.sha1(ident.encode()).hexdigest()[:6]}"


def checkpoint_of(name: str) -> tuple[str, str] | None:
    """(path, arch) of a model named as a local checkpoint with its architecture, ``PATH@ARCH``
    ("runs/epoch3.safetensors@vit_tiny_patch16_224", "ft.pth@ref-vit"); None for any other name."""
    path, sep, arch = name.rpartition("@")
    if not sep or not path.strip() or not arch.strip() or not looks_like_checkpoint_path(path):
        return None
    return path, arch.strip()


def own_weights(name: str) -> str | None:
    """The weights a model keeps whatever weights are asked for: "embedded" for the embedded pair (ref-vit,
    ref-hybrid: trained here, shipped with vitlens), "checkpoint" for a ``PATH@ARCH`` checkpoint; None for a
    hub name, which ``pretrained=False`` (``--random-init``) gives random weights."""
    if name in REFERENCE_NAMES:
        return "embedded"
    return "checkpoint" if checkpoint_of(name) is not None else None


def random_init_note(name: str) -> str | None:
    """What random init does not do to a model with its own weights (``own_weights``), in one line for the run's
    output and the manifest's ``weights_note``; None for a hub name, which random init applies to."""
    kept = own_weights(name)
    if kept is None:
        return None
    what = "its embedded trained weights" if kept == "embedded" else "its checkpoint's weights"
    return f"keeps {what}: random init (--random-init, pretrained=False) applies to hub models only"


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_of(entry: dict[str, Any]) -> str:
    """The kind of weights of a manifest entry ("pretrained", "random init", "embedded", ...): what
    its worker reported, else (older folders) what its name and pretrained flag say."""
    if entry.get("weights"):
        return str(entry["weights"])
    if entry.get("checkpoint"):
        return "checkpoint"
    if entry.get("name") in REFERENCE_NAMES:
        return "embedded"
    return "pretrained" if entry.get("pretrained", True) else "random init"


def source_count(source: dict[str, Any]) -> int:
    """How many images a manifest's image source holds."""
    return len(source.get("files") or ()) or int(source.get("n", 0))
