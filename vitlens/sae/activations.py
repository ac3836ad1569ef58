"""A named site's activations, batch by batch, as the engine's batch source hands the images over: the one stream the
SAE's training, its evaluation and the linear probes read (docs/definitions.md, "Sparse autoencoder").

Each batch is one forward of the model with the site read through a ``SiteSession`` (``vitlens.engine.sites.record``):
the forward is untouched, and no activation is kept beyond the batch that holds it (no dump of the whole set).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Sequence

import torch

from ..engine.sites import HookPoint, family_sites, record
from ..engine.sources import batch_source
from ..errors import InvalidParameterError, UnsupportedModelError
from ..images import Images
from ..kinds import kind_of
from ..loading.model import LoadedModel
from .model import TOKEN_SETS


@dataclass
class SiteBatch:
    """One batch's activations at a site.

    Attributes:
        start: the index of the batch's first image among all images streamed.
        acts: [B, T, d] the site's tokens (float32, on the model's device): ``prefix`` prefix tokens, then the
            patch tokens of ``grid`` in row-major order.
        prefix: prefix tokens (class token, registers) before the patches.
        grid: (gh, gw) the patch tokens' grid.
        logits: [B, C] the model's output of the same forward (float32), or None when it gives none.
        pixels: [B, 3, H, W] the model-ready batch the forward read (on the model's device): what an edit of the
            site runs again.
    """

    start: int
    acts: torch.Tensor
    prefix: int
    grid: tuple[int, int]
    logits: torch.Tensor | None
    pixels: torch.Tensor | None = None


def site_point(m: LoadedModel, site: str) -> dict[str, HookPoint]:
    """``{site: HookPoint}`` of a site ``m``'s family declares (``vitlens.engine.sites.family_sites``); an unknown site
    is refused by name with the sites there are."""
    if not isinstance(site, str) or not site:
        raise InvalidParameterError(f"site must name a site of the model, e.g. 'blocks.0.hook_resid_post'; got "
                                    f"{site!r}.")
    points = family_sites(m)
    if site not in points:
        raise InvalidParameterError(f"{m.spec.name} has no site {site!r}; its sites are {', '.join(site_names(m))}.")
    return {site: points[site]}


def site_names(m: LoadedModel) -> list[str]:
    """The named sites of ``m``, blocks in depth order (what an unknown site's refusal lists)."""
    def order(name: str) -> tuple[int, int, str]:
        parts = name.split(".")
        return (0, int(parts[1]), name) if parts[0] == "blocks" and parts[1].isdigit() else (1, 0, name)
    return sorted(family_sites(m), key=order)


def check_images_model(m: LoadedModel) -> None:
    """Refuse a video model in one line: an SAE reads one image's token grid."""
    if kind_of(m).clips:
        raise UnsupportedModelError(f"{m.spec.name} reads clips; the sparse autoencoder and the probes read image "
                                    "models' token grids.")


def tokens_of(value: Any, m: LoadedModel, x: torch.Tensor, site: str) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """``(acts [B, T, d], prefix, grid)`` of a site's value: a [B, T, d] token sequence (prefix tokens, then the
    grid), or a channels-last map [B, gh, gw, d] (a Swin stage's) read as its grid's tokens."""
    if not isinstance(value, torch.Tensor):
        raise UnsupportedModelError(f"{m.spec.name}: site {site!r} holds a {type(value).__name__}, not a tensor of "
                                    "tokens.")
    if value.ndim == 4:
        b, gh, gw, d = value.shape
        return value.reshape(b, gh * gw, d).float(), 0, (int(gh), int(gw))
    if value.ndim != 3:
        raise UnsupportedModelError(f"{m.spec.name}: site {site!r} holds a tensor of shape {tuple(value.shape)}, "
                                    "not tokens [B, T, d].")
    gh, gw = m.grid_for(x.shape[-2:])
    prefix = int(value.shape[1]) - gh * gw
    if prefix < 0:
        raise UnsupportedModelError(f"{m.spec.name}: site {site!r} holds {value.shape[1]} tokens, fewer than the "
                                    f"{gh}x{gw} patch grid; an SAE reads a site of the full grid.")
    return value.float(), prefix, (int(gh), int(gw))


def iter_site_batches(m: LoadedModel, images: Images, site: str, batch_size: int = 16,
                      skip: int = 0) -> Iterator[SiteBatch]:
    """The site's activations of every batch of ``images``, one forward each (the engine's batch source).

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        site: a named site (``blocks.3.hook_resid_post``; ``vitlens.engine.sites``).
        batch_size: images per forward.
        skip: batches to leave out at the start (no forward for them; a tensor or a sequence of images is sliced,
            so they are not even read).

    Yields:
        ``SiteBatch`` per forward, in the images' order.
    """
    for seen in iter_sites(m, images, [site], batch_size, skip):
        yield seen[site]


def iter_sites(m: LoadedModel, images: Images, sites: Sequence[str], batch_size: int = 16,
               skip: int = 0) -> Iterator[dict[str, SiteBatch]]:
    """Several sites' activations from one forward per batch (the probes read every block's output at once): per
    batch, ``{site: SiteBatch}`` (``iter_site_batches``'s arguments, with a list of sites)."""
    check_images_model(m)
    points: dict[str, HookPoint] = {}
    for site in sites:
        points.update(site_point(m, site))
    start = skip * int(batch_size)
    if skip and isinstance(images, (torch.Tensor, Sequence)) and not isinstance(images, str):
        images, skip = images[start:], 0
    source = batch_source(m, images)
    for index, x in enumerate(source.batches(int(batch_size))):
        if index < skip:
            continue
        x = x.to(m.device)
        seen, out = record(m.model, points, partial(m.forward, x))
        logits = out.float() if isinstance(out, torch.Tensor) and out.ndim == 2 else None
        batches = {}
        for site in sites:
            if site not in seen:
                raise UnsupportedModelError(f"{m.spec.name}: the forward never reached site {site!r}.")
            acts, prefix, grid = tokens_of(seen[site], m, x, site)
            batches[site] = SiteBatch(start, acts, prefix, grid, logits, x)
        yield batches
        start += int(x.shape[0])


def select_tokens(acts: torch.Tensor, prefix: int, tokens: str) -> torch.Tensor:
    """[N, d] the tokens of ``acts`` [B, T, d] an SAE reads, flattened image by image.

    Args:
        acts: the site's tokens.
        prefix: prefix tokens before the patches.
        tokens: "patches" (the grid's tokens), "prefix" (class token, registers) or "all".
    """
    if tokens not in TOKEN_SETS:
        raise InvalidParameterError(f"tokens must be one of {', '.join(TOKEN_SETS)}; got {tokens!r}.")
    if tokens == "prefix" and prefix < 1:
        raise InvalidParameterError("tokens='prefix' reads the prefix tokens (class token, registers), and this site "
                                    "has none: use tokens='patches' or 'all'.")
    part = acts[:, prefix:] if tokens == "patches" else acts[:, :prefix] if tokens == "prefix" else acts
    return part.reshape(-1, acts.shape[-1])


__all__ = ["SiteBatch", "check_images_model", "iter_site_batches", "iter_sites", "select_tokens", "site_names",
           "site_point", "tokens_of"]
