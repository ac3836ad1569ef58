"""Towers fed flattened patches through one linear layer (the Hugging Face layout's, ``common.layouts_hf``): Molmo2's
vision model (``patch_embedding``, an ``nn.Linear`` over patches flattened (row, column, channel), a position table
of one row per patch of its one size) and Pix2Struct's (``embeddings.patch_projection``, the same patches with their
1-based row and column ids in front, any size up to its ``seq_len`` rows or columns).

Serves the token geometry of every view (Fig. 6, Fig. 7): such a linear layer over non-overlapping patches is the
convolution of kernel = stride = patch (``common.patches.PatchEmbedding``, ``channels_last``), so its tokens are the
image's patches row-major, as the processor cuts them; the inputs are built here from a batch [B, C, H, W] the way
each model's image processor builds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import UnsupportedModelError
from .patches import PatchEmbedding


def flatten_patches(x: torch.Tensor, p: int, who: str) -> tuple[torch.Tensor, int, int]:
    """``(patches [B, gh * gw, p * p * C], gh, gw)``: a batch [B, C, H, W] cut as the flattened-patch processors cut
    it (Molmo2, Pix2Struct, Gemma 4): each image's patches row-major, each flattened (row, column, channel); a side
    that is not a whole number of patches is refused in one line naming ``who`` (the tower)."""
    b, c, h, w = x.shape
    if h % p or w % p:
        raise UnsupportedModelError(f"{who} takes images whose sides are multiples of its {p} px patches; got {h}x{w}.")
    gh, gw = h // p, w // p
    return x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, p * p * c), gh, gw


@dataclass(frozen=True)
class FlatPatches:
    """How a tower takes flattened patches.

    Attributes:
        linear: the layer that embeds one flattened patch.
        patch: pixels per patch side.
        channels: image channels.
        ids: whether each patch comes with its (row + 1, column + 1) in front (Pix2Struct).
        argument: the forward's keyword for the patches.
    """

    linear: nn.Linear
    patch: int
    channels: int
    ids: bool
    argument: str

    def embedding(self) -> PatchEmbedding:
        """The layer read as a convolution of the pixels (kernel = stride = patch, patches flattened channel-last)."""
        p = (self.patch, self.patch)
        return PatchEmbedding(self.linear, self.linear, self.channels, int(self.linear.out_features), p, p, (0, 0),
                              "linear", channels_last=True)

    def inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A batch [B, C, H, W] as the tower's processor hands it: each image's patches row-major, each flattened
        (row, column, channel); Pix2Struct's with (row + 1, column + 1) in front and a mask of no padding."""
        b = x.shape[0]
        pixels, gh, gw = flatten_patches(x, self.patch, "this tower (flattened patches)")
        if not self.ids:
            return {self.argument: pixels}
        rows = torch.arange(1, gh + 1, device=x.device, dtype=x.dtype).repeat_interleave(gw)
        cols = torch.arange(1, gw + 1, device=x.device, dtype=x.dtype).repeat(gh)
        ids = torch.stack([rows, cols], -1).expand(b, -1, -1)
        return {self.argument: torch.cat([ids, pixels], -1),
                "attention_mask": torch.ones(b, gh * gw, device=x.device, dtype=x.dtype)}

    def max_side(self, tower: nn.Module) -> int | None:
        """The most patches a side the tower has ids for (Pix2Struct's row and column tables), None without ids."""
        table = getattr(getattr(tower, "embeddings", None), "row_embedder", None)
        return int(table.num_embeddings) - 1 if self.ids and isinstance(table, nn.Embedding) else None


def flat_patches(tower: nn.Module) -> FlatPatches | None:
    """The ``FlatPatches`` of a transformers tower: Molmo2's ``patch_embedding`` (an ``nn.Linear`` of
    ``patch_size``² x ``num_channels`` inputs), Pix2Struct's ``embeddings.patch_projection`` beside its
    ``row_embedder`` and ``column_embedder`` (square patches of 3 channels: its config states no patch size); None
    for any other tower."""
    cfg = getattr(tower, "config", None)
    linear = getattr(tower, "patch_embedding", None)
    if isinstance(linear, nn.Linear) and getattr(tower, "embeddings", None) is None and cfg is not None:
        p, c = getattr(cfg, "patch_size", None), int(getattr(cfg, "num_channels", 3) or 3)
        if isinstance(p, int) and p * p * c == int(linear.in_features):
            return FlatPatches(linear, p, c, False, "pixel_values")
    emb = getattr(tower, "embeddings", None)
    linear = getattr(emb, "patch_projection", None)
    if isinstance(linear, nn.Linear) and isinstance(getattr(emb, "row_embedder", None), nn.Embedding) and \
            isinstance(getattr(emb, "column_embedder", None), nn.Embedding):
        p = math.isqrt(int(linear.in_features) // 3)
        if 3 * p * p == int(linear.in_features):
            return FlatPatches(linear, p, 3, True, "flattened_patches")
    return None


__all__ = ["FlatPatches", "flat_patches", "flatten_patches"]
