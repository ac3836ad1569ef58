"""Each feature of a sparse autoencoder shown (issue 66, item 3; docs/definitions.md, "SAE feature views"): its
top-activating images with the activation over the token grid, its activation frequency and histogram, its mean
activation per grid cell (where in the image it fires, beside the position-embedding view of Fig. 7 centre), per class,
its direct effect on the logits, and the heads that write it against their mean attention distance (Fig. 7 right):
``vl.sae_features``, one forward per batch through the engine's stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..components.layout import Layout, structure
from ..engine.sites import HookPoint, family_sites
from ..engine.stream import stream_attention
from ..errors import InvalidParameterError
from ..images import Images, count_images
from ..loading.model import LoadedModel
from ..progress import ProgressArg
from ..results import Result
from ..views.distance import AttentionDistanceAccumulator
from ..words import class_label
from .activations import check_images_model, site_point
from .evaluate import as_sae
from .model import SparseAutoencoder
from .feature_stats import HIST_EDGES, FeatureStats, WriterBlock

#: bytes the kept maps (every feature's grid mean, each shown feature's top maps) may take, checked before the stream
MAX_KEPT_BYTES = 512 * 2**20
#: how the features can be ordered (``SAEFeaturesResult.order``)
FEATURE_ORDERS = ("frequency", "logit_effect", "index")


@dataclass(eq=False, repr=False)
class SAEFeaturesResult(Result):
    """Every feature of an SAE over a set of images, and the shown features' images and writers.

    Attributes:
        features: [K] the features shown (their top images and writers are kept), indices into the SAE's F.
        frequency: [F] the share of the read tokens on which each feature is active (> 0).
        mean_activation: [F] each feature's mean activation over the tokens where it is active (0 where never).
        hist_counts: [F, bins] each feature's active values counted in the bins of ``hist_edges``.
        hist_edges: [bins + 1] the histogram's edges (log-spaced; values outside fall in the end bins).
        grid_mean: [F, gh, gw] each feature's mean activation at each patch cell, over the images.
        class_mean: [F, C] each feature's mean activation over the read tokens of each class's images ([F, 0] without
            labels).
        class_names: the C classes' names.
        top_images: [K, top] the images (stream indices) where each shown feature is largest, best first (-1: no
            further image where it is active).
        top_values: [K, top] its largest activation on each of them.
        top_maps: [K, top, gh, gw] its activation over each one's patch grid.
        logit_effect: [F, C'] the logits one unit of each feature adds when written at the token the head reads,
            through the final norm with its scale held at the images' mean ([F, 0] where not read: ``logit_note``).
        logit_names: the C' outputs' names.
        logit_note: why there is no logit effect ("" where there is).
        writers: [K, W] each writer head's output projected on each shown feature's encoder direction, averaged over
            the read tokens where the feature is active (NaN where it never is).
        writers_all: [K, W] the same averaged over every read token.
        writer_heads: [W, 2] (block, head) of each writer column (0-based).
        head_distance_px: [L, H] every head's mean attention distance in pixels over the same images (Fig. 7 right).
        site: the SAE's site.
        tokens: the tokens it reads ("patches", "prefix", "all").
        n_images: images streamed.
        n_tokens: read tokens over them.
        grid: (gh, gw).
        model_name: the model's name.
    """

    kind = "sae_features"
    features: np.ndarray
    frequency: np.ndarray
    mean_activation: np.ndarray
    hist_counts: np.ndarray
    hist_edges: np.ndarray
    grid_mean: np.ndarray
    class_mean: np.ndarray
    class_names: list
    top_images: np.ndarray
    top_values: np.ndarray
    top_maps: np.ndarray
    logit_effect: np.ndarray
    logit_names: list
    logit_note: str
    writers: np.ndarray
    writers_all: np.ndarray
    writer_heads: np.ndarray
    head_distance_px: np.ndarray
    site: str
    tokens: str
    n_images: int
    n_tokens: int
    grid: tuple[int, int]
    model_name: str = ""
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        f = len(self.frequency)
        dead = int((self.frequency == 0).sum())
        return (f"{self.model_name or 'model'} {self.site} ({self.tokens}): {f} features over {self.n_images} images, "
                f"{dead} never active, median frequency {float(np.median(self.frequency)):.3g}; {len(self.features)} "
                f"shown with their top {self.top_images.shape[1]} images")

    def row(self, feature: int) -> int:
        """The row of a shown feature in ``features`` (top images, writers), refused by name when it is not shown."""
        hits = np.flatnonzero(self.features == int(feature))
        if not len(hits):
            raise InvalidParameterError(f"feature {feature} is not among the shown features ({len(self.features)}); "
                                        "pass it in features= to vl.sae_features.")
        return int(hits[0])

    def logit_strength(self) -> np.ndarray:
        """[F] each feature's largest logit effect in size (0 where there is none)."""
        return np.abs(self.logit_effect).max(1) if self.logit_effect.size else np.zeros(len(self.frequency))

    def order(self, by: str = "frequency", shown_only: bool = True) -> np.ndarray:
        """Feature indices, most frequent (or largest logit effect, or by index) first; ``shown_only``: of the shown
        features alone."""
        if by not in FEATURE_ORDERS:
            raise InvalidParameterError(f"order by must be one of {', '.join(FEATURE_ORDERS)}; got {by!r}.")
        pool = self.features if shown_only else np.arange(len(self.frequency))
        if by == "index":
            return np.sort(pool)
        key = self.frequency if by == "frequency" else self.logit_strength()
        return pool[np.argsort(-key[pool], kind="stable")]

    def top_logits(self, feature: int, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` outputs a feature raises most (name, logit per unit activation)."""
        if not self.logit_effect.size:
            return []
        effect = self.logit_effect[int(feature)]
        return [(self.logit_names[i] if i < len(self.logit_names) else f"class {i}", float(effect[i]))
                for i in np.argsort(-effect)[:k]]

    def to_rows(self) -> list[dict]:
        """One row per feature: frequency, mean activation, and its strongest logit effect."""
        rows = []
        for f in range(len(self.frequency)):
            best = self.top_logits(f, 1)
            rows.append({"feature": f, "frequency": float(self.frequency[f]),
                         "mean_activation": float(self.mean_activation[f]), "shown": bool(f in set(self.features)),
                         "top_logit": best[0][0] if best else "", "logit_effect": best[0][1] if best else float("nan")})
        return rows


def _site_layer(site: str) -> tuple[int, bool]:
    """(block, whether the site is that block's input) of ``blocks.{i}.<name>``; refused for another site."""
    parts = site.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        raise InvalidParameterError(f"vl.sae_features reads an SAE of a block's site (blocks.I.hook_resid_post, ...); "
                                    f"got {site!r}.")
    return int(parts[1]), parts[2] == "hook_resid_pre"


def _layout(m: LoadedModel) -> Layout | None:
    """The component analyses' site map of the model, where they read it (its layer scales, its final norm)."""
    return Layout(m.model, m.spec.name) if structure(m.model) is not None else None


def writer_blocks(m: LoadedModel, site: str, layout: Layout | None) -> tuple[list[WriterBlock], dict[str, HookPoint]]:
    """The blocks whose heads write into ``site`` (those before it: a block's heads write its own output), each with
    its ``attn.hook_z`` site and the weights that take its heads to the stream (as ``components.head_vectors``), and
    the sites they are read at: the component analyses' map where it reads the model (its output projections and
    layer scales), else the family's where its heads' site is a projection's input."""
    layer, is_input = _site_layer(site)
    points = layout.points() if layout is not None else family_sites(m)
    out, used = [], {}
    for i in range(layer if is_input else layer + 1):
        name = f"blocks.{i}.attn.hook_z"
        proj = layout.sites[i].out_proj if layout is not None else points[name].module if name in points else None
        if name not in points or not isinstance(proj, nn.Linear):
            continue
        gamma = getattr(layout.sites[i].attn, "gamma", None) if layout is not None else None
        out.append(WriterBlock(i, name, proj.weight.detach().double(),
                               gamma.detach().double() if isinstance(gamma, torch.Tensor) else None,
                               int(m.spec.num_heads)))
        used[name] = points[name]
    return out, used


def readout(m: LoadedModel, layout: Layout | None) -> tuple[nn.Module, torch.Tensor, int, list[str]] | str:
    """``(final norm, head weight [C, D], the token the head reads, class names)`` where the model's output is a
    linear head on one token after its final LayerNorm (timm's class-token ViTs, Hugging Face ``ViTFor...``);
    otherwise why not, in words."""
    if layout is None or not layout.classes:
        return "the model has no classifier the component analyses read (its output is not logits of classes)"
    if layout.kind == "timm-vit":
        model = layout.model
        if getattr(model, "global_pool", "token") != "token" or not isinstance(getattr(model, "fc_norm", None),
                                                                              nn.Identity):
            return "its head pools the tokens (global_pool != 'token'), so no one token's direction reads the logits"
    head = layout.classifier
    if not isinstance(head, nn.Linear) or not isinstance(layout.final_norm, (nn.LayerNorm, nn.Identity)):
        return "its readout after the final norm is not one linear layer"
    if not layout.has_class_token:
        return "it has no class token for the head to read"
    names = list(m.label_names() or [])
    return layout.final_norm, head.weight.detach().double(), 0, names


def logit_effect(sae: nn.Module, norm: nn.Module, weight: torch.Tensor, sigma: float) -> np.ndarray:
    """[F, C] the logits each feature's decoder direction adds, per unit activation, when written at the read token:
    ``W_head (gamma * centre(W_dec[f]) / sigma)``, the final LayerNorm with its scale held at ``sigma`` (the
    linearisation of ``components.linearise``; the head's bias and beta are the same with and without it)."""
    d = sae.W_dec.detach().double().cpu()
    if isinstance(norm, nn.LayerNorm):
        gamma = norm.weight.detach().double().cpu() if norm.weight is not None else 1.0
        d = (d - d.mean(-1, keepdim=True)) * gamma / sigma
    return (d @ weight.cpu().T).numpy()


def _check(sae: SparseAutoencoder, m: LoadedModel, top: int, features: Sequence[int] | None) -> np.ndarray:
    config = sae.config
    if not config.site:
        raise InvalidParameterError("The SAE does not say which site it reads (config.site is empty); set it, e.g. "
                                    "sae.config.site = 'blocks.3.hook_resid_post'.")
    if config.site.split(".")[-1].startswith("hook_resid") and config.d_in != m.spec.embed_dim:
        raise InvalidParameterError(f"The SAE reads {config.d_in}-wide tokens; {m.spec.name}'s residual stream is "
                                    f"{m.spec.embed_dim} wide: use the model it was trained on "
                                    f"({config.model_name or '?'}).")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidParameterError(f"top (images kept per feature) must be a positive integer; got {top!r}.")
    n = int(config.n_features)
    shown = np.arange(n) if features is None else np.asarray(list(features), dtype=np.int64).reshape(-1)
    if len(shown) and (shown.min() < 0 or shown.max() >= n):
        raise InvalidParameterError(f"features must be feature indices in [0, {n}); got {features!r}.")
    cells = int(np.prod(m.spec.grid))
    kept = 8 * cells * (n + len(shown) * top)
    if kept > MAX_KEPT_BYTES:
        raise InvalidParameterError(
            f"Showing {len(shown)} features with {top} images each over a {m.spec.grid[0]}x{m.spec.grid[1]} grid "
            f"would keep {kept / 2**20:.0f} MB (at most {MAX_KEPT_BYTES // 2**20} MB): pass features= (the ones to "
            "show) or a smaller top.")
    return np.unique(shown) if features is not None else shown


def sae_features(m: LoadedModel, sae: SparseAutoencoder | str | Path | Any, images: Images,
                 labels: Sequence[int] | np.ndarray | None = None,
                 top: int = 8, features: Sequence[int] | None = None, batch_size: int = 16,
                 progress: ProgressArg = None) -> SAEFeaturesResult:
    """Every feature of ``sae`` over ``images``, and the shown features' top images and writers, from one forward
    per batch (the engine's stream: the SAE's site, the heads' outputs, the final norm's input and the attention
    distance all read in the same pass; docs/definitions.md, "SAE feature views").

    Args:
        m: the model the SAE was trained on.
        sae: a ``SparseAutoencoder`` whose ``config.site`` is a block's site of ``m``, a ``train_sae`` result or the
            path of an SAE file (``vitlens.sae.load_sae``).
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        labels: [N] class indices of the images: each feature's mean activation per class.
        top: images kept per shown feature.
        features: the features whose top images and writers are kept (default every one, within ``MAX_KEPT_BYTES``).
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.

    Returns:
        A ``SAEFeaturesResult``.

    Raises:
        InvalidParameterError: an SAE of another model or site, bad ``top`` / ``features`` / ``labels``, or more to
            keep than ``MAX_KEPT_BYTES``.
    """
    check_images_model(m)
    sae = as_sae(sae)
    shown = _check(sae, m, top, features)
    site = sae.config.site
    points: dict[str, HookPoint] = dict(site_point(m, site))
    n = count_images(images)
    names: list[str] = list(m.label_names() or [])
    num_classes = 0
    if labels is not None:
        labels = np.asarray(labels).reshape(-1)
        if labels.dtype.kind not in "iu" or (n is not None and len(labels) != n) or (len(labels) and labels.min() < 0):
            raise InvalidParameterError(f"labels must be one non-negative class index per image ({n} images); got "
                                        f"{len(labels)} of dtype {labels.dtype}.")
        num_classes = max(len(names), int(labels.max()) + 1 if len(labels) else 0)
    layout = _layout(m)
    writers, writer_points = writer_blocks(m, site, layout)
    points.update(writer_points)
    read = readout(m, layout)
    notes = [] if writers else [f"no writer heads: {m.spec.name}'s family names no heads' site (attn.hook_z) of a "
                                "projection of its own before this site"]
    if not isinstance(read, str):
        assert layout is not None  # readout reads a layout
        points["ln_final.hook_in"] = layout.points()["ln_final.hook_in"]
    eps = float(getattr(read[0], "eps", 1e-6)) if not isinstance(read, str) else 1e-6
    stats = FeatureStats(sae, points, m.model, m.spec.num_prefix_tokens, shown, top, writers, num_classes,
                         None if isinstance(read, str) else read[2], eps)
    distance = AttentionDistanceAccumulator.for_model(m.spec)
    stream_attention(m, images, [stats, distance], batch_size, progress,
                     labels=None if labels is None else np.asarray(labels), desc="sae features", capture_mode=None)
    if stats.n_images == 0 or stats.grid is None:
        raise InvalidParameterError("No images were given; pass at least one.")
    gh, gw = stats.grid
    f = int(sae.config.n_features)
    if isinstance(read, str):
        effect, logit_names, logit_note = np.zeros((f, 0)), [], read
    else:
        effect = logit_effect(sae, read[0], read[1], stats.sigma_sum / stats.n_images)
        logit_names, logit_note = [class_label(read[3], c) for c in range(effect.shape[1])], ""
    active = stats.active.numpy()
    fired = stats.write_on.numpy()[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        writers_active = np.where(fired > 0, stats.write_active.numpy() / np.maximum(fired, 1), np.nan)
    writer_heads = np.array([(w.layer, h) for w in writers for h in range(w.heads)], dtype=np.int64).reshape(-1, 2)
    class_mean = (stats.class_sum.numpy() / np.maximum(stats.class_images.numpy(), 1)[None]
                  if num_classes else np.zeros((f, 0)))
    return SAEFeaturesResult(
        features=shown.astype(np.int64), frequency=active / max(stats.n_tokens, 1),
        mean_activation=np.where(active > 0, stats.total.numpy() / np.maximum(active, 1), 0.0),
        hist_counts=stats.hist.numpy().astype(np.int64), hist_edges=HIST_EDGES.copy(),
        grid_mean=(stats.cells.numpy() / stats.n_images).reshape(f, gh, gw) if stats.cells is not None else
        np.zeros((f, gh, gw)),
        class_mean=class_mean, class_names=[class_label(names, c) for c in range(num_classes)],
        top_images=np.where(stats.top_values.numpy() > 0, stats.top_index.numpy(), -1),
        top_values=np.maximum(stats.top_values.numpy(), 0.0),
        top_maps=stats.top_maps.numpy().reshape(len(shown), top, gh, gw) if stats.top_maps is not None else
        np.zeros((len(shown), top, gh, gw)),
        logit_effect=effect, logit_names=logit_names, logit_note=logit_note,
        writers=writers_active, writers_all=stats.write_all.numpy() / max(stats.write_tokens, 1),
        writer_heads=writer_heads, head_distance_px=distance.result(m.spec).mean_px,
        site=site, tokens=sae.config.tokens, n_images=stats.n_images, n_tokens=stats.n_tokens, grid=(gh, gw),
        model_name=m.spec.name, notes=notes)


__all__ = ["FEATURE_ORDERS", "MAX_KEPT_BYTES", "SAEFeaturesResult", "logit_effect", "readout", "sae_features",
           "writer_blocks"]
