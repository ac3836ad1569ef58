"""The learned relative-position bias a model adds to its attention scores, read from the model's own modules
(for the position view of relative-position models, ``vitlens.views.relpos``).

Each source is evaluated by the module's own code, so the numbers are the bias the block adds:

- timm ``VisionTransformerRelPos`` (``vit_relpos_*``, ``vit_srelpos_*``): each block's ``attn.rel_pos`` or, where
  the blocks have none, the model's ``shared_rel_pos``, through their ``get_bias()`` (``RelPosBias``: a learned table
  looked up by offset; ``RelPosMlp``: a small MLP of log-spaced offsets, modes 'cr' and 'swin'; ``RelPosBiasTf``);
- timm BEiT (``beit_*``, ``beitv2_*``): each block's ``attn._get_rel_pos_bias()`` (its
  ``relative_position_bias_table[relative_position_index]``) plus the model's shared ``rel_pos_bias()`` where it
  has one;
- Hugging Face ``Beit*`` and ``Data2VecVision*``: each layer's ``*RelativePositionBias`` module and the shared one,
  called at their own window.

Each gives one [heads, T, T] tensor per block, query rows and key columns, T = prefix + gh * gw. A block's own
bias and a shared one are summed into one tensor, as the fused attention paths add them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...errors import ViewNotAvailableError


@dataclass(frozen=True)
class RelativeBias:
    """The relative-position bias of every block, as the blocks add it to their attention scores.

    Attributes:
        biases: one [heads, T, T] tensor per block (query rows, key columns), detached, on the CPU, in the dtype
            the model adds it in.
        sources: per block, in words, the module(s) the bias was read from.
        grid: (gh, gw), the patch grid (window) the bias is defined on.
        num_prefix_tokens: tokens before the patch tokens (T - gh * gw).
        grids: each block's own grid where the blocks' windows differ (Swin: the window of each stage, clamped
            where a stage's grid is smaller); None: every block's is ``grid``.
    """

    biases: tuple[torch.Tensor, ...]
    sources: tuple[str, ...]
    grid: tuple[int, int]
    num_prefix_tokens: int
    grids: tuple[tuple[int, int], ...] | None = None

    def block_grid(self, layer: int) -> tuple[int, int]:
        """The grid block ``layer``'s bias is defined on."""
        return self.grid if self.grids is None else self.grids[layer]


def _plain(bias: torch.Tensor, where: str) -> torch.Tensor:
    """A bias as [heads, T, T] on the CPU (a leading batch dimension of 1 dropped)."""
    bias = bias.detach()
    if bias.dim() == 4 and bias.shape[0] == 1:
        bias = bias[0]
    if bias.dim() != 3 or bias.shape[-1] != bias.shape[-2]:
        raise ViewNotAvailableError(f"{where} gives a bias of shape {list(bias.shape)}, not [heads, T, T]; vitlens "
                                    "reads a bias over the tokens of one global attention.")
    return bias.cpu()


def _in_eval(module: nn.Module, where: str) -> None:
    """Refuse a bias module whose dropout is live (training mode): its bias would be a random draw."""
    if module.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        raise ViewNotAvailableError(f"{where} is in training mode, where its dropout makes the bias random; put the "
                                    "model in eval() first.")


def _describe_timm(module: nn.Module) -> str:
    mode = getattr(module, "mode", None)
    kinds = {"RelPosBias": "a learned table looked up by offset", "RelPosBiasTf": "a learned table by offset",
             "RelPosMlp": f"an MLP of log-spaced offsets, mode {mode!r}"}
    return f"{type(module).__name__}, {kinds.get(type(module).__name__, 'its get_bias()')}"


def _timm_relpos(model: nn.Module) -> RelativeBias | None:
    from timm.layers import RelPosBias, RelPosBiasTf, RelPosMlp
    from timm.models.vision_transformer_relpos import RelPosAttention

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not len(blocks) or \
            not all(isinstance(getattr(b, "attn", None), RelPosAttention) for b in blocks):
        return None
    shared = getattr(model, "shared_rel_pos", None)
    modules = [(f"blocks.{i}.attn.rel_pos", b.attn.rel_pos) for i, b in enumerate(blocks)]
    if shared is None and all(mod is None for _, mod in modules):
        return None
    known = (RelPosBias, RelPosMlp, RelPosBiasTf)

    def evaluated(where: str, mod: nn.Module) -> torch.Tensor:
        if not isinstance(mod, known):
            raise ViewNotAvailableError(f"{where} is a {type(mod).__name__}; vitlens reads timm's RelPosBias, "
                                        "RelPosMlp and RelPosBiasTf.")
        _in_eval(mod, where)
        with torch.no_grad():
            return _plain(mod.get_bias(), where)

    shared_bias = evaluated("shared_rel_pos", shared) if shared is not None else None
    biases: list[torch.Tensor | None]
    biases, sources, windows = [], [], []
    for where, mod in modules:
        # RelPosAttention adds its own rel_pos when it has one and the shared bias only when it has none
        if mod is not None:
            biases.append(evaluated(where, mod))
            sources.append(f"{where} ({_describe_timm(mod)}): its get_bias()")
            windows.append(mod.window_size)
        elif shared is not None and shared_bias is not None:
            biases.append(shared_bias)
            sources.append(f"shared_rel_pos ({_describe_timm(shared)}), the same in every block: its get_bias()")
            windows.append(shared.window_size)
        else:
            biases.append(None)
            sources.append(f"{where}: none (this block adds no relative bias)")
    return _assembled(biases, sources, windows)


#: one bias module's contribution: (its [heads, T, T] bias, where it was read in words, its window)
Part = tuple[torch.Tensor, str, tuple]


def _own_plus_shared(own: list[Part | None], shared: Part | None, nothing: str) -> RelativeBias:
    """Each block's own bias plus the shared one, summed into one tensor as the fused attention paths add them
    (``nothing``: the words, with {i} for the block, for a block with neither)."""
    biases, sources, windows = [], [], []
    for i, part in enumerate(own):
        parts = [p for p in (part, shared) if p is not None]
        biases.append(parts[0][0] + parts[1][0] if len(parts) == 2 else parts[0][0] if parts else None)
        sources.append(" + ".join(p[1] for p in parts) or nothing.format(i=i))
        windows += [p[2] for p in parts]
    return _assembled(biases, sources, windows)


def _timm_beit(model: nn.Module) -> RelativeBias | None:
    from timm.models.beit import Beit

    if not isinstance(model, Beit):
        return None
    shared = model.rel_pos_bias
    attns = [b.attn for b in model.blocks]
    if shared is None and all(a.relative_position_bias_table is None for a in attns):
        return None
    with torch.no_grad():
        own: list[Part | None] = [
            (_plain(a._get_rel_pos_bias(), f"blocks.{i}.attn"), f"blocks.{i}.attn.relative_position_bias_table"
             "[relative_position_index] (its _get_rel_pos_bias())", a.window_size)
            if a.relative_position_bias_table is not None else None for i, a in enumerate(attns)]
        common = (_plain(shared(), "rel_pos_bias"), "rel_pos_bias() (shared by every block)", shared.window_size) \
            if shared is not None else None
    return _own_plus_shared(own, common, "blocks.{i}.attn: none (this block adds no relative bias)")


def _hf_beit(model: nn.Module) -> RelativeBias | None:
    if not type(model).__module__.startswith("transformers."):  # not an HF model: transformers is not imported
        return None
    try:
        from transformers.models.beit.modeling_beit import BeitLayer, BeitRelativePositionBias
        from transformers.models.data2vec.modeling_data2vec_vision import (
            Data2VecVisionLayer, Data2VecVisionRelativePositionBias)
    except ImportError:  # transformers is optional
        return None
    kinds = (BeitRelativePositionBias, Data2VecVisionRelativePositionBias)
    found = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, kinds)]
    if not found:
        return None
    layer_lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod)
                   and all(isinstance(c, (BeitLayer, Data2VecVisionLayer)) for c in mod)]
    if len(layer_lists) != 1:
        raise ViewNotAvailableError(f"{type(model).__name__}: vitlens found {len(layer_lists)} lists of BEiT layers, "
                                    "not one, so it cannot say which block adds which relative bias.")
    list_name, layers = layer_lists[0]
    own: list[Part | None] = [None] * len(layers)
    shared: list[Part] = []
    for name, mod in found:
        _in_eval(mod, name)
        with torch.no_grad():  # at the module's own window: the input size the model was configured for
            bias = _plain(mod(tuple(mod.window_size)), name)
        index = next((i for i in range(len(layers)) if name.startswith(f"{list_name}.{i}.")), None)
        if index is None:
            shared.append((bias, f"{name} ({type(mod).__name__}, shared by every layer)", mod.window_size))
        else:
            own[index] = (bias, f"{name} ({type(mod).__name__}, called at its window)", mod.window_size)
    if len(shared) > 1:
        raise ViewNotAvailableError(f"{type(model).__name__} has {len(shared)} relative-position bias modules outside "
                                    "its layers; vitlens reads one shared bias at most.")
    return _own_plus_shared(own, shared[0] if shared else None,
                            list_name + ".{i}: none (this layer adds no relative bias)")


def _assembled(biases: list[torch.Tensor | None], sources: list[str], windows: list) -> RelativeBias:
    """One ``RelativeBias`` from the blocks' biases (None: a block without one, zero), checked to share one window."""
    grids = {(int(w[0]), int(w[1])) for w in windows}
    if len(grids) != 1:
        raise ViewNotAvailableError(f"The relative-position biases of this model are defined on different windows "
                                    f"({sorted(grids)}); vitlens reads one window over the whole patch grid.")
    grid = grids.pop()
    present = [b for b in biases if b is not None]
    shapes = {tuple(b.shape) for b in present}
    if len(shapes) != 1:
        raise ViewNotAvailableError(f"The blocks' relative-position biases have different shapes ({sorted(shapes)}).")
    heads, tokens, _ = shapes.pop()
    prefix = tokens - grid[0] * grid[1]
    if prefix < 0:
        raise ViewNotAvailableError(f"A relative-position bias over {tokens} tokens does not cover the {grid[0]}x"
                                    f"{grid[1]} patch window it is defined on.")
    zero = torch.zeros(heads, tokens, tokens, dtype=present[0].dtype)
    return RelativeBias(biases=tuple(zero if b is None else b for b in biases), sources=tuple(sources), grid=grid,
                        num_prefix_tokens=prefix)


#: the readers ``read_relative_bias`` tries, in order; each returns None for a model that is not its kind
READERS: tuple[Callable[[nn.Module], RelativeBias | None], ...] = (_timm_relpos, _timm_beit, _hf_beit)


def read_relative_bias(model: nn.Module) -> RelativeBias | None:
    """The learned relative-position bias every block of ``model`` adds to its attention scores.

    Args:
        model: a timm ``VisionTransformerRelPos`` or ``Beit``, or a Hugging Face BEiT / Data2VecVision model.

    Returns:
        A ``RelativeBias``, or None when the model has none of the relative-bias modules vitlens reads.

    Raises:
        ViewNotAvailableError: a bias module vitlens does not read, one in training mode with live dropout, or
            biases on different windows.
    """
    for reader in READERS:
        found = reader(model)
        if found is not None:
            return found
    return None


__all__ = ["READERS", "RelativeBias", "read_relative_bias"]
