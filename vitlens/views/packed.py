"""Images of different sizes, each analysed on its own grid (issue 48): ``analyze_each``.

Serves the attention views of Fig. 6 (rollout) and Fig. 7 right / Fig. 11 (distance) for a model that takes images
of any size. A model that packs several images in one sequence (Pixtral: each image's patches row-major, images in
order, a block-diagonal mask) is run once on the whole list: its captured maps [1, heads, T, T] are cut into each
image's diagonal block (``core.tokens.ImageTokens``), which holds every row's whole mass, since the mask gives the
other images' keys exactly zero probability. A model that pads them in one batch (Siglip2 NaFlex: image i in row
i, its cells first, padding keys at exactly zero probability) is run once too, and image i's block is row i's own
cells. Each block is then fed to the view's consumer as one image of that image's grid and size, so each image's
result is the one it gets run alone. A long list runs in several packs of at most ``pack_tokens`` patch tokens (issue
62: the maps of one pack grow with the square of its tokens, ``MAX_PACK_MAP_BYTES``), which changes no image's
result. Any other model
runs the images one by one (``analyze`` per image).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch


from ..engine.capture import capture_attention
from ..engine.consumer import BatchInfo
from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from .analyze import AnalysisResult, analyze
from .registry import VIEWS, ViewParams, check_views

def packed_views() -> tuple[str, ...]:
    """The views ``analyze_each`` computes per image from the pack's maps: the registry's default attention views
    (distance and rollout), each fed an image's diagonal block as one image of its own grid."""
    return tuple(v.name for v in VIEWS.values() if v.kind == "attention" and v.default)


#: the most bytes of captured maps one packed forward of ``analyze_each`` holds (issue 62: every block's [1, heads, T,
#: T] float32 over the pack); more images run in several packs (``pack_tokens``)
MAX_PACK_MAP_BYTES = 256 << 20


def __getattr__(name: str) -> tuple[str, ...]:
    """``PACKED_VIEWS``: ``packed_views()``, read from the registry when asked."""
    if name == "PACKED_VIEWS":
        return packed_views()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def analyze_each(m: LoadedModel, images: Sequence[torch.Tensor], views: Sequence[str] | None = None,
                 renormalize: bool = True, head_fusion: str = "mean",
                 discard_ratio: float = 0.0) -> list[AnalysisResult]:
    """Each image's own attention distance and rollout, for images of different sizes.

    Args:
        m: the model.
        images: preprocessed tensors [C, H_i, W_i] (or [1, C, H_i, W_i]), each at its own size (for a packing model,
            sides that are multiples of the patch stride).
        views: any of ``packed_views()`` (None: all of them).
        renormalize: as for ``attention_distance``.
        head_fusion: as for ``attention_rollout``.
        discard_ratio: as for ``attention_rollout``.

    Returns:
        One ``AnalysisResult`` per image, in order (``results[i]`` is image ``i``'s): its ``spec`` at the image's own
            size and grid, its distance over that image alone and its rollout map on its own grid.

    Raises:
        InvalidParameterError: no images, a view other than ``packed_views()``, or an image that is not one tensor.
    """
    packable = packed_views()
    views = check_views(packable if views is None else views)
    other = [v for v in views if v not in packable]
    if other or not images:
        raise InvalidParameterError(f"analyze_each computes {list(packable)} of one or more images; got views "
                                    f"{list(views)} and {len(images)} images.")
    batch = []
    for i, img in enumerate(images):
        if not isinstance(img, torch.Tensor) or img.dim() not in (3, 4) or (img.dim() == 4 and img.shape[0] != 1):
            raise InvalidParameterError(f"image {i}: analyze_each takes preprocessed tensors [C, H, W] of any size; "
                                        f"got {type(img).__name__} {tuple(getattr(img, 'shape', ()))}.")
        batch.append((img[0] if img.dim() == 4 else img).to(m.device))
    params = ViewParams(renormalize=renormalize, head_fusion=head_fusion, discard_ratio=discard_ratio)
    if m.family.packed_forward is None:
        return [_alone(m, img, views, params) for img in batch]
    return [r for pack in _packs(m, batch) for r in _pack_results(m, pack, views, params)]


def pack_tokens(m: LoadedModel) -> int:
    """The most patch tokens in one pack of ``m``: its blocks' maps over them within ``MAX_PACK_MAP_BYTES``
    (``num_layers x num_heads x T^2`` float32; 4,096 tokens for 2 blocks of 2 heads, 418 for Pixtral's 24 of 16)."""
    per_token_pair = 4 * max(1, m.spec.num_layers) * max(1, m.spec.num_heads)
    return max(1, math.isqrt(MAX_PACK_MAP_BYTES // per_token_pair))


def _packs(m: LoadedModel, images: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The images in order, cut into packs of at most ``pack_tokens`` patch tokens (an image above it alone): a
    pack's captured maps grow with the square of its tokens (1,000 images of 64 x 64 were one 16,000-token pack,
    2.9 GB), and the mask keeps each image to its own block, so how they are packed changes no image's result."""
    budget = pack_tokens(m)
    packs: list[list[torch.Tensor]] = []
    tokens = 0
    for img in images:
        gh, gw = m.grid_for(img.shape[-2:])
        n = gh * gw
        if not packs or tokens + n > budget:
            packs.append([])
            tokens = 0
        packs[-1].append(img)
        tokens += n
    return packs


def _pack_results(m: LoadedModel, pack: list[torch.Tensor], views: tuple, params: ViewParams) -> list[AnalysisResult]:
    """One packed forward of ``pack`` and each image's result from its diagonal block (the images one by one when
    the model does not pack them); its captured maps are dropped on return, before the next pack runs."""
    packed_forward = m.family.packed_forward
    if packed_forward is None:  # a family of no packed models: the images one by one
        return [_alone(m, img, views, params) for img in pack]
    with capture_attention(m) as cap:
        where_all = packed_forward(m.model, pack)
    if where_all is None:
        return [_alone(m, img, views, params) for img in pack]
    out = []
    for img, where in zip(pack, where_all):
        size, grid, rows = (int(img.shape[-2]), int(img.shape[-1])), where.grid, where.tokens
        spec = replace(m.spec, image_size=size, grid=grid)
        consumers = {name: VIEWS[name].build(m, params) for name in views}
        for c in consumers.values():
            c.begin_batch(BatchInfo.of(grid, size, size=1, device=m.device))
        for layer, probs in enumerate(cap.maps):
            block = probs[where.row:where.row + 1, :, rows, rows]
            for c in consumers.values():
                c.on_attention(layer, block)
        for c in consumers.values():
            c.end_batch(None)
        results = {name: c.result(spec) for name, c in consumers.items()}
        out.append(AnalysisResult(spec=spec, filters=None, position=None, distance=results.pop("distance", None),
                                  rollout=results.pop("rollout", None), prefix=results.pop("prefix", None),
                                  views=views, others=results))
    return out


def _alone(m: LoadedModel, img: torch.Tensor, views: tuple, params: ViewParams) -> AnalysisResult:
    """One image through ``analyze``, its result's spec at the image's own size and grid."""
    result = analyze(m, img[None], views=views, renormalize=params.renormalize, head_fusion=params.head_fusion,
                     discard_ratio=params.discard_ratio)
    size = (int(img.shape[-2]), int(img.shape[-1]))
    return replace(result, spec=replace(m.spec, image_size=size, grid=m.grid_for(size)))


__all__ = ["MAX_PACK_MAP_BYTES", "analyze_each", "pack_tokens", "packed_views"]
