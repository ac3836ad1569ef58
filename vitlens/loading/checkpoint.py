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
from ..reference import REFERENCE_NAMES, build_reference

CHECKPOINT_SUFFIXES: tuple[str, ...] = (".safetensors", ".pth", ".pt", ".bin", ".npz", ".tar")


def looks_like_checkpoint_path(name: str) -> bool:
    """True when ``name`` names a file (exists, or ends in a checkpoint suffix)."""
    return Path(name).suffix.lower() in CHECKPOINT_SUFFIXES or Path(name).is_file()


READABLE_FORMATS = "Pass a .safetensors, .pth/.pt/.bin/.tar (state dict) or original ViT .npz file."

#: leading bytes of files often passed by mistake, and what to call them
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
    (b"BM", "a BMP image"), (b"RIFF", "a RIFF file (WebP image or WAV audio)"), (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "a gzip archive"), (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"),
)


def file_kind(path: Path) -> str:
    """What a file evidently is when it is no checkpoint ("a PNG image", "a text file"); "" when it may be
    one (a zip archive, a pickle, anything else)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return ""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head and b"\x00" not in head:
        try:
            head.decode("utf-8")
            return "a text file"
        except UnicodeDecodeError:
            pass
    return ""


def _torch_reason(e: Exception) -> str:
    """torch's complaint, without its advice to retry with weights_only=False (vitlens never suggests it)."""
    lines = [line for line in str(e).splitlines() if line.strip() and "weights_only" not in line]
    sentences = [s for s in " ".join(lines).split(". ") if "weights_only" not in s and "trusted source" not in s]
    return ". ".join(sentences).strip() or type(e).__name__


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
    kind = file_kind(path)
    if kind:  # an image, a text file, an archive: say what it is rather than what torch tripped on
        raise CheckpointError(f"{path} is {kind}, not a checkpoint. {READABLE_FORMATS}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():
            raise CheckpointError(f"{path} is not a PyTorch checkpoint vitlens can read: its data is not a "
                                  f"pickled state dict. {READABLE_FORMATS}") from e
        raise CheckpointError(
            f"Refused to load {path}: it is a pickle that needs code to unpickle ({_torch_reason(e)}). "
            "vitlens only loads weights (weights_only=True). Re-save the state dict as safetensors, e.g. "
            "safetensors.torch.save_file(model.state_dict(), 'model.safetensors'), from a trusted environment."
        ) from e
    except Exception as e:  # torch raises many types (RuntimeError, IndexError, EOFError, ...) on junk files
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint vitlens can read: neither a torch zip archive nor a pickled "
            f"state dict. {READABLE_FORMATS}") from e
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


#: architectures a checkpoint without --arch is tried against (their shapes, built on the meta device): the
#: embedded pair and the common timm ViTs and DeiTs. A hint names only those whose every tensor fits.
CANDIDATE_ARCHS: tuple[str, ...] = (
    "ref-vit", "ref-hybrid", "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
    "vit_base_patch32_224", "vit_large_patch16_224", "vit_base_patch16_384", "vit_base_r50_s16_224",
    "deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224")


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint (safetensors headers only; torch files are read)."""
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - any unreadable header is the same answer
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from e
    return {k: tuple(v.shape) for k, v in read_state_dict(path).items()}


def shape_summary(shapes: dict[str, tuple[int, ...]]) -> str:
    """A ViT state dict's shape in words: depth (blocks), width, patch size, classes ("" where unknown).
    Heads are not stored in a state dict (qkv is [3 x width, width]), so they are not said."""
    depth = 1 + max((int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.split(".")[1].isdigit()),
                    default=-1)
    width = next((shape[-1] for key in ("cls_token", "pos_embed", "norm.weight") if (shape := shapes.get(key))), None)
    patch = shapes.get("patch_embed.proj.weight")
    head = shapes.get("head.weight")
    parts = [f"{depth} blocks" if depth else "", f"width {width}" if width else "",
             f"patch {patch[-1]} px" if patch and len(patch) == 4 else "", f"{head[0]} classes" if head else ""]
    return ", ".join(p for p in parts if p) or f"{len(shapes)} tensors, none of a ViT's usual names"


def _arch_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    import timm


    if arch in REFERENCE_NAMES:
        model = build_reference(arch)
    else:
        model = timm.create_model(arch, pretrained=False, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def fitting_architectures(path: Path, candidates: tuple[str, ...] = CANDIDATE_ARCHS) -> list[str]:
    """The candidate architectures whose every tensor has the checkpoint's name and shape (the hint for a
    checkpoint passed without its architecture; [] when none fits or the file cannot be read)."""
    try:
        shapes = tensor_shapes(path)
    except CheckpointError:
        return []
    fits = []
    for arch in candidates:
        try:
            if _arch_shapes(arch) == shapes:
                fits.append(arch)
        except Exception:  # noqa: BLE001 - an architecture this timm lacks is simply not a fit
            continue
    return fits


def file_num_classes(path: Path, arch: str) -> int | None:
    """The class count of the checkpoint's head: the rows of ``arch``'s classifier weight (timm's
    ``pretrained_cfg['classifier']``, e.g. ``head``) as the file stores it; None where the file has no such 2-D
    tensor (a headless file, an original .npz) or cannot be read. A fine-tuned checkpoint (10 classes where the
    architecture's default has 1000) is then built with its own head, as ``num_classes=`` would build it."""
    import timm

    if path.suffix.lower() == ".npz":
        return None
    try:
        classifier = timm.create_model(arch, pretrained=False, device="meta").pretrained_cfg.get("classifier") or "head"
        if isinstance(classifier, (tuple, list)):  # a model with two heads (DeiT distilled): the first's size
            classifier = classifier[0]
        shape = tensor_shapes(path).get(f"{classifier}.weight")
    except Exception:  # noqa: BLE001 - unreadable here is reported by the strict load, with the shapes
        return None
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


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
    file_shapes = {k: tuple(v.shape) for k, v in state.items()}  # as stored (timm's filter resamples some)
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            state = filter_fn(state, model)
        except Exception as e:  # timm's converters assert on foreign layouts
            raise _mismatch_error(path, arch, f"its tensors do not convert ({e})") from e
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # a summary, not torch's hundreds of missing keys
        arch_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing, unexpected = len(set(arch_shapes) - set(file_shapes)), len(set(file_shapes) - set(arch_shapes))
        wrong = sum(1 for k in set(arch_shapes) & set(file_shapes) if arch_shapes[k] != file_shapes[k])
        detail = (f"the file has {shape_summary(file_shapes)}; {arch} has {shape_summary(arch_shapes)} "
                  f"({missing} tensors missing, {unexpected} unexpected, {wrong} of another shape)")
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
        fixes={"python": "Pass the arch= the checkpoint was trained with (and the same img_size keyword argument; "
                         "the head's size is read from the file).",
               "cli": "Pass the --arch the checkpoint was trained with.",
               "app": "Give the architecture the checkpoint was trained with."})
