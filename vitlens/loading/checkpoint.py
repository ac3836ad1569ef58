"""Reading local checkpoints without executing code: safetensors, weights-only torch pickles, npz."""
from __future__ import annotations

import pickle
import sys
import zipfile
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn

from ..errors import CheckpointError

CHECKPOINT_SUFFIXES: tuple[str, ...] = (".safetensors", ".pth", ".pt", ".bin", ".npz", ".tar")


def looks_like_checkpoint_path(name: str) -> bool:
    """True when ``name`` names a file (exists, or ends in a checkpoint suffix)."""
    return Path(name).suffix.lower() in CHECKPOINT_SUFFIXES or Path(name).is_file()


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read the tensors of a .safetensors or torch checkpoint, refusing pickled code.

    Args:
        path: the checkpoint file. Torch pickles are read with ``weights_only=True``; a nested
            ``state_dict`` / ``model`` / ``model_ema`` entry is unwrapped and a DataParallel
            ``module.`` prefix removed.
    """
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "global" not in str(e).lower():
            raise CheckpointError(f"{path} is not a PyTorch checkpoint vitlens can read ({first}).") from e
        raise CheckpointError(
            f"Refused to load {path}: it is a pickle that needs code to unpickle ({first}). "
            "vitlens only loads weights (weights_only=True). Re-save the state dict as safetensors, e.g. "
            "safetensors.torch.save_file(model.state_dict(), 'model.safetensors'), from a trusted environment."
        ) from e
    except Exception as e:  # torch raises many types (RuntimeError, IndexError, EOFError, ...) on junk files
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint vitlens can read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Pass a .safetensors, .pth/.pt/.bin (state dict) or original ViT .npz file."
        ) from e
    return _unwrap_state_dict(obj, path)


def refuse_non_finite(tensors: "Iterable[tuple[str, torch.Tensor]]", what: str) -> None:
    """Refuse weights with NaN or infinite values: every view would read nan ("attends nan of the width").

    Raises:
        CheckpointError: naming up to three such tensors.
    """
    bad = [name for name, t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
           and not bool(torch.isfinite(t).all())]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{what} holds NaN or infinite weights ({', '.join(bad[:3])}{more}); vitlens refuses "
                              "them, as every number it reports would be nan. Check the run that wrote them.")


def _unwrap_state_dict(obj: object, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        for key in ("state_dict_ema", "model_ema", "state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} holds no state dict of tensors; save model.state_dict() and pass that file.")
    return {(k[7:] if k.startswith("module.") else k): v for k, v in obj.items()}


def load_checkpoint_into(model: nn.Module, path: Path, arch: str) -> None:
    """Load ``path`` into ``model`` (built as ``arch``) strictly; mismatches raise CheckpointError.

    Original JAX ``.npz`` checkpoints go through timm's own converter; torch and safetensors
    files through the architecture's ``checkpoint_filter_fn`` when timm has one (it renames
    legacy keys and resamples position embeddings to the model's grid).
    """
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint file. Give the weights file inside it "
                              "(.safetensors, .pth/.pt/.bin, .npz), or, for a folder written by save_pretrained, "
                              f"the model name hf:{path}.")
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file not found: {path}. Check the path.")
    if path.suffix.lower() == ".npz":
        _load_npz(model, path, arch)
        refuse_non_finite(model.state_dict().items(), str(path))
        return
    state = read_state_dict(path)
    refuse_non_finite(state.items(), str(path))
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            state = filter_fn(state, model)
        except Exception as e:  # timm's converters assert on foreign layouts
            raise _mismatch_error(path, arch, f"its tensors do not convert ({e})") from e
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        if len(detail) > 600:
            detail = detail[:600] + " ..."
        raise _mismatch_error(path, arch, detail) from e


def _load_npz(model: nn.Module, path: Path, arch: str) -> None:
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = list(data.keys())
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is not a readable .npz file ({e}).") from e
    if not any(k.startswith(("Transformer/", "embedding/")) for k in keys):
        raise CheckpointError(f"{path} is not an original (JAX) ViT checkpoint: no Transformer/ or embedding/ arrays.")
    loader = getattr(model, "load_pretrained", None)
    if loader is None:
        raise CheckpointError(f"{arch} cannot read original ViT .npz checkpoints; pass a safetensors file.")
    try:
        loader(str(path))
    except Exception as e:  # timm's npz loader raises KeyError/RuntimeError on foreign layouts
        raise _mismatch_error(path, arch, f"{type(e).__name__}: {e}") from e


def _mismatch_error(path: Path, arch: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint {path} does not fit the architecture {arch!r}: {detail}.",
        fixes={"python": "Pass the arch= the checkpoint was trained with (and the same img_size/num_classes "
                         "keyword arguments).",
               "cli": "Pass the --arch the checkpoint was trained with.",
               "app": "Give the architecture the checkpoint was trained with."})
