"""The components activation patching and mean-ablation read and replace (docs/definitions.md, "Activation
patching", "Mean-ablation"), as named sites of a model's ``Layout``: a block's attention branch
(``blocks.{l}.hook_attn_out``), its MLP branch (``hook_mlp_out``), the residual leaving it (``hook_resid_post``), its
change to the residual (``layer``: ``hook_resid_post - hook_resid_pre``) and its heads side by side before the output
projection (``attn.hook_z``).

Where an ``nn.MultiheadAttention`` fuses its output projection into one call (OpenCLIP, torchvision), the heads are
recomputed in float64 from its input and a change ``delta`` made to them is added to its output as ``delta W_O^T``
(the projection is linear; rows left alone get exactly 0).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import torch

from ..engine.sites import HookPoint, SiteSession
from .layout import Layout
from .prenorm import head_attention, mha_qkv

#: what can be read and replaced, per block
KINDS = ("attn", "mlp", "resid", "head", "layer")

Edit = Callable[[str, int, torch.Tensor], torch.Tensor]
"""``edit(kind, layer, value) -> value``: the value itself leaves the forward as it was; another tensor replaces it."""


def mha_heads(mha: torch.nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """[B, N, H * dh] float64: the heads of a self-attention ``nn.MultiheadAttention`` on ``x``, concatenated (what its
    fused call feeds its output projection), from its packed in-projection."""
    probs, v = head_attention(*mha_qkv(mha, x), mha.num_heads, mha.head_dim, mha.head_dim ** -0.5)
    return (probs @ v).transpose(1, 2).flatten(2)


def set_head(z: torch.Tensor, head: int, head_dim: int, value: torch.Tensor | float, rows: slice = slice(None)
             ) -> None:
    """Head ``head``'s slice of the heads side by side (``attn.hook_z``, [B, N, H * dh]) set to ``value`` in the batch
    rows ``rows``, in place: the one head ablation ``vl.mean_ablate`` and ``vl.head_importance`` share (``value``: a
    mean over reference images, or 0)."""
    z[rows, ..., head * head_dim:(head + 1) * head_dim] = value


class ComponentSites(SiteSession):
    """A session on the chosen components' sites: each value goes through its entry's ``edit`` (a context manager).

    Args:
        layout: the model's layout.
        chosen: ``(kind, layer)`` entries (``KINDS``), hooked in this order, one hook each (an entry given twice is
            edited twice, one edit after the other).
        edit: what to do with each value (``Edit``): one for every entry, or one per entry.
    """

    def __init__(self, layout: Layout, chosen: Sequence[tuple[str, int]], edit: Edit | Sequence[Edit]) -> None:
        declared = layout.points()
        points: dict[str, HookPoint] = {}
        self._where: dict[str, tuple[str, int, Edit]] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._layout = layout
        edits: list[Edit] = list(edit) if isinstance(edit, (list, tuple)) else [cast(Edit, edit)] * len(chosen)
        for n, ((kind, l), fn) in enumerate(zip(chosen, edits)):
            block = f"blocks.{l}."
            if kind == "head" and layout.sites[l].out_proj is None:  # the fused projection: its input and output
                mha = cast(torch.nn.MultiheadAttention, layout.sites[l].mha)  # no out_proj: the fused mha (BlockSites)
                names = {block + "attn.hook_mha_in": HookPoint(mha, "input"),
                         block + "attn.hook_mha_out": HookPoint(mha)}
            elif kind == "layer":
                names = {k: declared[k] for k in (block + "hook_resid_pre", block + "hook_resid_post")}
            else:
                key = {"attn": "hook_attn_out", "mlp": "hook_mlp_out", "resid": "hook_resid_post",
                       "head": "attn.hook_z"}[kind]
                names = {block + key: declared[block + key]}
            for name, point in names.items():
                points[f"{name}#{n}"] = point  # one hook per entry, even where two entries share a site
                self._where[f"{name}#{n}"] = (kind, l, fn)
        super().__init__(layout.model, points, self._on)

    def _on(self, key: str, value: Any) -> Any:
        kind, l, edit = self._where[key]
        name, n = key.split("#", 1)
        if name.endswith(("hook_mha_in", "hook_resid_pre")):
            self._inputs[int(n)] = value
            return None
        if kind == "layer":
            before = self._inputs[int(n)]
            change = value - before
            new = edit(kind, l, change)
            return None if new is change else before + new
        if name.endswith("hook_mha_out"):
            # hook_mha_out is placed only on a block whose mha is set (__init__)
            mha = cast(torch.nn.MultiheadAttention, self._layout.sites[l].mha)
            heads = mha_heads(mha, self._inputs[int(n)])
            new = edit(kind, l, heads)
            if new is heads:
                return None
            delta = (new - heads) @ mha.out_proj.weight.detach().double().T
            return value + delta.to(value.dtype)
        return edit(kind, l, value)
