"""What an unread model's attention is, for the one line that refuses it (issue 64 item 8): a transformers vision model
that no family names and the generic capture's layouts do not find is refused naming what vitlens found in it,
windows, several softmaxes per attention module, or no softmax at all, rather than in words that would fit any model.

The finding comes from the model itself: its config's window settings (``window_size`` with the blocks that attend
globally, ``global_attn_indexes`` / ``fullatt_block_indexes``), then one forward of a zero image at its config's size
under a ``TorchFunctionMode`` that counts, per top-level attention module (a module whose class name has
"Attention", not inside another such), its ``scaled_dot_product_attention`` and softmax calls and the groups each
call attends in (a batch of one image attended as several groups of tokens is windows). Nothing is kept: the
forward runs without gradients, and a forward that fails leaves the structural words alone.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

#: the functions that turn scores into attention probabilities (and the fused call that does both)
_SOFTMAXES = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.scaled_dot_product_attention)


class _Counting(TorchFunctionMode):
    """Counts each softmax / SDPA call made while a top-level attention module runs (``current``), with the call's
    leading dimensions (how many groups a batch of one image is attended in)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: list[int] = []
        self.calls: dict[int, list[tuple[int, int]]] = {}
        self.outside = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SOFTMAXES:
            first = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(first, torch.Tensor) and first.dim() >= 2:
                groups = int(torch.tensor(first.shape[:-2]).prod().item()) if first.dim() > 2 else 1
                heads = int(first.shape[-3]) if first.dim() >= 3 else 1
                if self.current:
                    self.calls.setdefault(self.current[-1], []).append((groups // max(heads, 1), int(first.shape[-2])))
                else:
                    self.outside += 1
        return func(*args, **kwargs)


def _top_attention(tower: nn.Module) -> list[nn.Module]:
    """The tower's attention modules (class name with "Attention"), none inside another."""
    found: list[nn.Module] = []
    for _name, mod in tower.named_modules():
        if "Attention" in type(mod).__name__ and not any(
                any(sub is mod for sub in outer.modules()) for outer in found):
            found.append(mod)
    return found


def _config_windows(cfg: Any) -> str | None:
    """The windows a config states: a ``window_size`` with the blocks that attend globally, if any."""
    window = getattr(cfg, "window_size", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    full = next((getattr(cfg, a) for a in ("global_attn_indexes", "fullatt_block_indexes")
                 if getattr(cfg, a, None) is not None), None)
    where = f", global attention only in blocks {sorted(full)}" if full else ""
    return f"it attends in windows (window_size={window} in its config{where})"


def _blocks_with_several(tower: nn.Module, attns: list[nn.Module],
                         calls: dict[int, list[tuple[int, int]]]) -> str | None:
    """Words for blocks that hold several attention modules that each made a softmax call (X-CLIP's message and self
    attention), or None."""
    parents: dict[int, tuple[nn.Module, list[str]]] = {}
    for _name, mod in tower.named_modules():
        for child_name, child in mod.named_children():
            i = next((j for j, a in enumerate(attns) if a is child), None)
            if i is not None and calls.get(i):
                parents.setdefault(id(mod), (mod, []))[1].append(child_name)
    block = next(((m, names) for m, names in parents.values() if len(names) > 1), None)
    if block is None:
        return None
    return (f"its blocks ({type(block[0]).__name__}) make several softmax calls each, one in each of their attention "
            f"modules ({', '.join(block[1])}), so no single map is the one a block applies")


def attention_found(tower: nn.Module, forward: Callable[[], Any] | None) -> str | None:
    """What the tower's attention is, in words for a refusal ("it attends in windows ...", "its attention modules
    make several softmax calls ...", "no softmax ..."), or None when nothing stands out (one global softmax per
    attention module: then the layout is what vitlens lacks).

    Args:
        tower: the vision tower (its ``config`` read for windows).
        forward: one forward of a zero image through it (None: the config and the modules alone).
    """
    windows = _config_windows(getattr(tower, "config", None))
    if windows is not None:
        return windows
    attns = _top_attention(tower)
    if forward is None:
        return None
    mode = _Counting()
    hooks = []
    def leave(_mod: nn.Module, _args: tuple, _out: Any) -> None:
        mode.current.pop()  # (returns None: the module's output is left as it is)

    for i, attn in enumerate(attns):
        hooks.append(attn.register_forward_pre_hook(lambda _m, _a, i=i: mode.current.append(i)))
        hooks.append(attn.register_forward_hook(leave))
    try:
        with torch.no_grad(), mode:
            forward()
    except Exception:  # noqa: BLE001 (a forward that needs more than pixels: the structural words stand)
        return None
    finally:
        for h in hooks:
            h.remove()
    if not mode.calls and not mode.outside:
        kinds = sorted({type(a).__name__ for a in attns})
        what = f"its {', '.join(kinds)} modules" if kinds else "its blocks"
        return (f"no softmax: {what} make no softmax and no scaled_dot_product_attention call in a forward (tokens "
                "mixed some other way), so it has no attention map of the paper's kind")
    windowed = sorted({(g, n) for calls in mode.calls.values() for g, n in calls if g > 1})
    if windowed:
        groups, tokens = windowed[0]
        return (f"it attends in windows: a softmax over {tokens} tokens in {groups} groups for one image (a batch of "
                "windows), not one attention over the image's tokens")
    several = {i: len(c) for i, c in mode.calls.items() if len(c) > 1}
    if several:
        i, n = next(iter(several.items()))
        return (f"its attention modules make several softmax calls each ({type(attns[i]).__name__} makes {n} in one "
                "forward), so no single map is the one a block applies")
    blocks = _blocks_with_several(tower, attns, mode.calls)
    if blocks is not None:
        return blocks
    if mode.outside and not mode.calls:
        return (f"its {mode.outside} softmax calls are made outside any module vitlens knows as attention (no class "
                "named *Attention around them)")
    return None


def _unread_packing(tower: nn.Module) -> str | None:
    """Words for a packed tower (a forward taking ``grid_thw``) whose patch layout its modules do not declare: where
    its patches enter (the first linear layer or convolution named for patches); None for a tower that is not
    packed."""
    import inspect

    try:
        if "grid_thw" not in inspect.signature(tower.forward).parameters:
            return None
    except (TypeError, ValueError):
        return None
    entry = next(((n, m) for n, m in tower.named_modules()
                  if "patch" in n.rsplit(".", 1)[-1] and isinstance(m, (nn.Linear, nn.Conv2d, nn.Conv3d))), None)
    if entry is None:
        return "whose patches enter through no linear layer or convolution named for patches"
    n, m = entry
    width = m.in_features if isinstance(m, nn.Linear) else m.in_channels
    return (f"whose patches enter through {n} (nn.{type(m).__name__}, {width} inputs), which declares neither the "
            "order of a patch's pixels nor the order of the patches (merge blocks), so vitlens cannot cut an image "
            "for it")


def hf_refusal(model: nn.Module, tower: nn.Module, name: str, model_type: str | None) -> str | None:
    """The one-line refusal of a transformers vision model no family and no layout reads, naming what its attention
    is (``attention_found``, one forward of a zero image at its config's size); None when nothing stands out.

    Args:
        model: the model as loaded.
        tower: its vision tower (whose config says the size and the windows).
        name: its name, for the message.
        model_type: its model type, for the message.
    """
    packed = _unread_packing(tower)
    if packed is not None:
        return (f"{name!r} is a Hugging Face {type(model).__name__} (model type {model_type!r}) that no family "
                f"names: a packed vision tower (its forward takes grid_thw) {packed}; vitlens reads packed towers "
                "whose patch_embed is a Conv3d over flattened temporal patches with a spatial_merge_size (Qwen2-VL, "
                "Qwen3-VL, GLM-4.1V) or a convolution over stacked [N, C, p, p] patches (Kimi K2.5's MoonViT).")
    cfg = getattr(tower, "config", None)
    size = getattr(cfg, "image_size", None)
    forward = None
    if isinstance(size, (int, list, tuple)) and size:
        h, w = (int(size[0]), int(size[-1])) if isinstance(size, (list, tuple)) else (int(size), int(size))
        x = torch.zeros(1, int(getattr(cfg, "num_channels", 3) or 3), h, w,
                        dtype=next((p.dtype for p in tower.parameters() if p.is_floating_point()), torch.float32))
        forward = lambda: tower(pixel_values=x)  # noqa: E731
    found = attention_found(tower, forward)
    if found is None:
        return None
    windowed = found.startswith("it attends in windows")
    tail = ("vitlens reads windowed attention only where a family undoes the windows (Swin, Hiera, ViTDet, SAM, "
            "Qwen2.5-VL, MaxViT, DaViT: docs/models.md)" if windowed else
            "vitlens reads one softmax (or one scaled_dot_product_attention call) per block, over the image's tokens")
    return (f"{name!r} is a Hugging Face {type(model).__name__} (model type {model_type!r}) that no family names, and "
            f"{found}; {tail}.")


__all__ = ["attention_found", "hf_refusal"]
