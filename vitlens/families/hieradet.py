"""SAM 2's HieraDet (timm's ``hieradet_sam2_*``): a Hiera whose blocks attend within windows of their own size (a global
block every few), query-pooled between stages. Its windows are read through the model's own code (token numbers
coded into the values, decoded from the outputs), its attention from each block's softmax; the windowed views read it
as they read Swin (distance in image pixels per stage, rollout through the windows and the poolings)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry, pooling_transport
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import register
from .common.hiera import QueriesAndKeys, TimmHieraBase, queries_and_keys, stage_geometry, triple, zero_product
from .common.windows import StandIn, identity, token_centres


# --------------------------------------------------------------------------------------- SAM 2's Hiera (HieraDet)
def _hieradet_step(block: nn.Module, x: torch.Tensor, zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [windows, Nq, c], k [windows, Nk, c], the block's output [H', W', c]) of a HieraDet ``MultiScaleBlock``'s own
    forward on coded channels ``x`` [1, H, W, c] (``_coded``): its norms the identity, its MLP zero, its attention on
    a stand-in (one head of c channels, ``qkv`` three copies, ``proj`` the identity, scale 1, the non-fused path)
    whose probabilities times v is answered with q (``zero``: with zeros, the output then the residual alone)."""
    attn = block.attn
    stand_in = StandIn(attn, qkv=triple, proj=identity, scale=1.0, num_heads=1, fused_attn=False)
    mode = QueriesAndKeys(zero=zero)

    def attention(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return type(attn).forward(stand_in, t)

    replaced: dict[str, Any] = {name: identity for name in ("norm1", "proj", "norm2", "ls1", "ls2", "drop_path1",
                                                                "drop_path2")}
    out = type(block).forward(StandIn(block, attn=attention, mlp=zero_product, **replaced), x)
    return queries_and_keys(mode, attn, out)


def _coded(h: int, w: int) -> tuple[torch.Tensor, int]:
    """[1, h, w, 5] each token's code (r + 1, c + 1, big - r, big - c, -1): under a max over tokens (a max pool)
    the first four give the members' bounding box and the last is 0 where padding (all zero) was among them."""
    big = h + w + 2
    r, c = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    return torch.stack([r + 1, c + 1, big - r, big - c, -torch.ones_like(r)], -1)[None], big

def _decode(v: np.ndarray, big: int, grid: tuple[int, int], step: tuple[int, int], what: str) -> np.ndarray:
    """[rows] the cell of the grid pooled by ``step`` each coded row ([rows, 5], ``_coded`` under max pools) stands
    for: its members' bounding box must be exactly one aligned ``step`` block of real tokens; a row of padding
    alone is -1."""
    h, w = grid
    sy, sx = step
    pad = v[:, 0] == 0
    r1, c1, r0, c0 = v[:, 0] - 1, v[:, 1] - 1, big - v[:, 2], big - v[:, 3]
    bad = ~pad & ((v[:, 4] != -1) | (r1 - r0 + 1 != sy) | (c1 - c0 + 1 != sx) | (r0 % sy != 0) | (c0 % sx != 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UnsupportedModelError(f"{what}: a token pools rows {r0[i]:.0f}-{r1[i]:.0f}, columns {c0[i]:.0f}-"
                                    f"{c1[i]:.0f} of the {h}x{w} grid{' and padding' if v[i, 4] != -1 else ''}, not "
                                    f"one {sy}x{sx} block; vitlens reads 2-D max pools of whole blocks only.")
    return np.where(pad, -1, (r0 // sy) * (w // sx) + c0 // sx).astype(np.int64)

def read_hieradet_windows(model: nn.Module, grid: tuple[int, int], patch_stride: tuple[int, int],
                          stages: Sequence[int]) -> list[WindowGeometry]:
    """Every HieraDet block's ``WindowGeometry``, read through its own ``forward`` on coded token positions of its
    input grid (row-major, [B, H, W, C] as the model keeps them; ``_coded``: five channels, so a 1024 px SAM 2
    encoder's 65536 tokens cost what its forward does): its padding to whole windows, its window partition, its
    query max-pool inside each window, its max-pooled residual and its window unpartition. A query or key is
    placed by the bounding box of the tokens it holds (one token; a pooled query: exactly one aligned 2x2 block).

    Args:
        model: a timm ``HieraDet``.
        grid: (H, W) the patch tokens' grid.
        patch_stride: (sy, sx) the patch embedding's stride in pixels.
        stages: the stage of every block.

    Returns:
        One ``WindowGeometry`` per block ("window", "global", "query-pooled window" / "query-pooled global"; padding
            queries and keys -1).
    """
    h, w = grid
    centres = token_centres((h, w), patch_stride)
    stride = tuple(int(s) for s in patch_stride)
    out = []
    with torch.no_grad():
        for layer, (stage, block) in enumerate(zip(stages, model.blocks)):
            what = f"block {layer + 1} (stage {stage + 1}, {type(block).__name__})"  # counted from 1, as the app
            pooled = block.attn.q_pool is not None
            step = (int(block.q_stride[0]), int(block.q_stride[1])) if pooled else (1, 1)
            x, big = _coded(h, w)
            q, k, both = _hieradet_step(block, x, zero=False)
            _q, _k, res = _hieradet_step(block, x, zero=True)
            out_grid = (int(res.shape[0]), int(res.shape[1]))
            index = _decode(q.reshape(-1, 5).numpy(), big, (h, w), step, what).reshape(q.shape[:2])
            keys = _decode(k.reshape(-1, 5).numpy(), big, (h, w), (1, 1), what).reshape(k.shape[:2])
            cells = _decode(res.reshape(-1, 5).numpy(), big, (h, w), step, what)
            if not np.array_equal(cells, np.arange(out_grid[0] * out_grid[1])):
                raise UnsupportedModelError(f"{what}: its output tokens are not its grid's in row-major order.")
            if not np.array_equal(_decode((both - res).reshape(-1, 5).numpy(), big, (h, w), step, what), cells):
                raise UnsupportedModelError(f"{what}: its attention's output tokens are not in the order of its "
                                            "(pooled) residual; vitlens cannot read it.")
            nw, nq = index.shape
            stride = (stride[0] * step[0], stride[1] * step[1])
            allowed = np.broadcast_to((keys >= 0)[:, None, :], (nw, nq, keys.shape[1])).copy()
            kind = "global" if nw == 1 and (index >= 0).all() else "window"
            move = pooling_transport((h, w), step, step, (0, 0), coarse=out_grid) if pooled else None
            g, centres = stage_geometry(stage, out_grid, stride, index, keys, allowed, kind, (h, w), centres, move,
                                        what)
            out.append(g)
            h, w = out_grid
    return out

class TimmHieraDet(TimmHieraBase):
    """timm ``HieraDet`` (SAM 2's Hiera image encoder, ``sam2_hiera_*``, ``hieradet_*``): windowed (padded to whole
    windows) and global attention on a row-major token grid, queries max-pooled 2x2 inside each window at each
    pooling stage's first block (``read_hieradet_windows``)."""

    name = "timm-hieradet"
    summary = "timm SAM 2 Hiera (sam2_hiera_*)"
    reads = ("timm HieraDet, SAM 2's Hiera image encoder (sam2_hiera_*, hieradet_*, timm.models.hieradet_sam2): "
             "windowed (padded) and global attention, query pooling inside the windows between stages; the "
             "windowed views as for Hiera")
    names = ("timm names: sam2_hiera_tiny, hieradet_small (timm.list_models('sam2_hiera_*'))",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.hieradet_sam2 import HieraDet

        return isinstance(model, HieraDet)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models.hieradet_sam2 import HieraPatchEmbed, MultiScaleAttention, MultiScaleBlock

        if type(model.patch_embed) is not HieraPatchEmbed:
            raise UnsupportedModelError(f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens "
                                        "reads HieraDet's own HieraPatchEmbed (one convolution).")
        self.check_block_classes(model, name, MultiScaleBlock, MultiScaleAttention)

    def image_size(self, model: nn.Module, input_size: tuple[int, int] | None = None) -> tuple[int, int]:
        if input_size is not None:
            return tuple(int(s) for s in input_size)  # type: ignore[return-value]  # 2 ints (mypy: tuple[int, ...])
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(s) for s in (getattr(model, "pretrained_cfg", None) or {}).get(  # type: ignore[return-value]
            "input_size", (3, 1024, 1024))[-2:])

    def grid(self, model: nn.Module, size: Sequence[int]) -> tuple[int, int]:
        conv = model.patch_embed.proj
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple((int(n) + 2 * int(p) - int(k)) // int(st) + 1  # type: ignore[return-value]
                     for n, p, k, st in zip(size, conv.padding, conv.kernel_size, conv.stride))

    def stages(self, model: nn.Module) -> list[int]:
        return [sum(1 for e in model.stage_ends if e < i) for i in range(len(model.blocks))]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model, input_size)
        conv = model.patch_embed.proj
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model, size),
            stride_px=tuple(int(s) for s in conv.stride),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(conv.out_channels), has_class_token=False, has_pos_embed=True,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        conv = model.patch_embed.proj
        return read_hieradet_windows(model, self.grid(model, input_hw),
                                     # the ignore below: 2 ints (mypy: tuple[int, ...])
                                     tuple(int(s) for s in conv.stride), self.stages(model))  # type: ignore[arg-type]

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return list(zip(self.stages(model), model.blocks))

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        # what the model adds at each stage-0 token: its interpolated global table plus the tiled window table
        with torch.no_grad():
            zeros = model.pos_embed.new_zeros(1, *spec.grid, model.pos_embed.shape[1])
            return model._pos_embed(zeros).reshape(1, spec.grid[0] * spec.grid[1], -1).detach(), spec.grid


register(TimmHieraDet())


__all__ = ["TimmHieraDet", "read_hieradet_windows"]
