"""Perturbation tests as the papers report them, beside deletion/insertion (``faithfulness``).

- ``perturbation_test``: Chefer et al. 2021 ("Transformer Interpretability Beyond Attention
  Visualization", section 4.2, Table 1/2): remove 10%, 20%, .., 90% of the input by relevance
  (positive: most relevant first, where a faithful map makes the score fall fast, lower AUC is
  better; negative: least relevant first, where it should hold, higher AUC is better) and follow
  top-1 accuracy against labels, or without labels the target class's softmax probability. The
  AUC is the trapezoid over the fractions 0, 0.1, .., 0.9, the point at 0 being the unperturbed
  image (as the paper's evaluation script records it), so an AUC is at most 0.9.
- ``road``: ROAD (Rong et al. 2022, "A Consistent and Efficient Evaluation Strategy for
  Attribution Methods"): the removed pixels are filled by noisy linear imputation
  (``imputation.noisy_linear_impute``) instead of a constant, which removes the information the
  removal's shape would otherwise leak; most-relevant-first (MoRF, lower is better) and
  least-relevant-first (LeRF, higher is better) curves at the given percentages.

What is removed (``granularity``): "token" (default) removes whole patch tokens, ranked by the
map's value, the unit every map of ``vitlens.attribution`` is computed on; "pixel" ranks the pixels
of the map upsampled bilinearly to the input size, as Chefer et al.'s script does with their
16x-upsampled maps (their ``torch.topk`` over 224x224 pixels). Token removal is the default because
bilinear upsampling invents an order inside each patch that no method computed, and a half-removed
patch is a token the model never saw. Chefer et al. set removed pixels to 0 before normalisation
(black): ``fill="black"``, the default of ``perturbation_test``; "mean" and "blur" are the
baselines of deletion/insertion.

Ties (a constant map, rollout's equal tokens) are broken by token index, the same way in every
test, by a stable sort.

Protocols and ordering (``protocols``): ``protocol="chefer2021"`` is Chefer et al.'s script (pixels,
black), ``road(protocol="rong2022")`` ROAD on pixels as Rong et al.; ``ordering="absolute"`` ranks by |R|
instead of R. Each result records its protocol, granularity and ordering, and its summary says them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.resample import upsample_map
from ..errors import InvalidParameterError
from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..results import Result, significant
from .baselines import baseline_image, prompt_embeddings, score_name
from .tower_targets import scores_own_output, unit_outputs
from .methods import AttributionResult, map_grids
from ..words import counted
from .protocols import check_ordering, protocol as get_protocol
from .imputation import noisy_linear_impute

CHEFER_FRACTIONS: tuple[float, ...] = tuple(i / 10 for i in range(10))  # 0 (unperturbed), 0.1, .., 0.9
ROAD_PERCENTAGES: tuple[float, ...] = tuple(i / 10 for i in range(1, 10))  # 0.1, .., 0.9
GRANULARITIES = ("token", "pixel")
FILLS = ("black", "mean", "blur")


def removal_counts(n_units: int, fractions: Sequence[float] | np.ndarray) -> np.ndarray:
    """How many of ``n_units`` a fraction removes: floor(n x f), as ``int(base_size * step)`` in Chefer et al.'s
    script and ``int(a_size * p / 100)`` in quantus's ROAD (a tiny epsilon keeps 0.7 x 10 at 7)."""
    return np.floor(n_units * np.asarray(fractions, dtype=np.float64) + 1e-9).astype(np.int64)


def removal_masks(maps: np.ndarray, fractions: Sequence[float] | np.ndarray | None, most_relevant_first: bool,
                  stride: tuple[int, int], size: tuple[int, int], granularity: str = "token",
                  ordering: str = "signed", counts: Sequence[int] | None = None) -> torch.Tensor:
    """[B, S, H, W] bool, True on the pixels removed at each fraction, for maps [B, gh, gw].

    Built for the whole batch at once: each unit's rank in the order (stable sort, so ties go by
    index), and a unit is removed at step s when its rank is below that step's count
    (``removal_counts`` of the fractions, or ``counts`` given directly, e.g. Petsiuk et al.'s W pixels a step).
    ``ordering`` "signed" ranks by the map's value, "absolute" by its magnitude.
    """
    check_ordering(ordering)
    if granularity not in GRANULARITIES:
        raise InvalidParameterError(f"granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}.")
    maps = np.asarray(maps, dtype=np.float64)
    b, gh, gw = maps.shape
    h, w = size
    if granularity == "pixel":
        units = np.stack([upsample_map(mp, size) for mp in maps]).reshape(b, -1)
    else:
        units = maps.reshape(b, -1)
    if ordering == "absolute":
        units = np.abs(units)
    key = -units if most_relevant_first else units
    order = np.argsort(key, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(units.shape[1])[None].repeat(b, 0), axis=1)
    if counts is not None:
        steps = np.minimum(np.asarray(counts, dtype=np.int64), units.shape[1])
    elif fractions is not None:
        steps = removal_counts(units.shape[1], fractions)
    else:
        raise InvalidParameterError("removal_masks takes the fractions or the counts to remove; got neither.")
    removed = torch.as_tensor(rank[:, None, :] < steps[None, :, None])  # [B, S, U]
    if granularity == "pixel":
        return removed.reshape(b, len(steps), h, w)
    sy, sx = stride
    grid = removed.reshape(b, len(steps), gh, gw).repeat_interleave(sy, 2).repeat_interleave(sx, 3)
    out = torch.zeros(b, len(steps), h, w, dtype=torch.bool)
    out[:, :, : grid.shape[2], : grid.shape[3]] = grid[:, :, :h, :w]  # pixels past the grid are never removed
    return out


def fill_image(x: torch.Tensor, fill: str, data_config: dict) -> torch.Tensor:
    """What removed pixels become, for a normalised batch [B, C, H, W]: "black" is pixel value 0 before
    normalisation, (0 - mean) / std (Chefer et al.); "mean" and "blur" are deletion/insertion's baselines."""
    if fill == "black":
        mean = torch.as_tensor(data_config.get("mean", (0.0,) * x.shape[1]), dtype=x.dtype, device=x.device)
        std = torch.as_tensor(data_config.get("std", (1.0,) * x.shape[1]), dtype=x.dtype, device=x.device)
        return ((0.0 - mean) / std)[None, :, None, None].expand_as(x).clone()
    if fill in ("mean", "blur"):
        return baseline_image(x, fill)
    raise InvalidParameterError(f"fill must be one of {', '.join(FILLS)}; got {fill!r}.")


class _Scorer:
    """Scores of perturbed batches: accuracy against labels, else the target's probability (or, for maps of a
    text target, the cosine similarity to the prompt)."""

    def __init__(self, m: LoadedModel, attribution: AttributionResult, labels: np.ndarray | None):
        n = len(attribution.maps)
        self.m, self.targets = m, np.asarray(attribution.targets)
        self.labels = None if labels is None else np.asarray(labels).reshape(-1)
        if self.labels is not None and len(self.labels) != n:
            raise InvalidParameterError(f"labels must hold one class per image ({n}); got {len(self.labels)}.")
        self.text = prompt_embeddings(m, attribution)
        if self.labels is not None and (self.text is not None or m.spec.num_classes <= 0):
            why = "these maps explain a prompt" if self.text is not None else f"{m.spec.name} has no classes"
            raise InvalidParameterError(f"labels (accuracy) need a classifier head and class maps; {why}. Leave "
                                        "labels out to score probabilities or similarities.")
        self.own = scores_own_output(m, attribution.target_kind)
        self.reference: tuple[int, torch.Tensor] | None = None  # (first image, [b, D] unit outputs) of the batch
        self.name = "top-1 accuracy" if self.labels is not None else score_name(m, attribution)

    def see(self, x: torch.Tensor, offset: int) -> None:
        """Note the unperturbed batch (images ``offset`` ..): a tower without classes scores against its outputs."""
        if self.own:
            self.reference = (offset, unit_outputs(self.m, x))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, image_index: np.ndarray, batch_size: int) -> np.ndarray:
        """[N] scores of perturbed images x [N, C, H, W], image ``image_index[k]`` each, in forwards of
        ``batch_size``."""
        out = torch.cat([self.m.logits(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
        if self.labels is not None:
            return (out.argmax(-1).cpu().numpy() == self.labels[image_index]).astype(np.float64)
        if self.own:
            assert self.reference is not None, "see() the unperturbed batch first"
            rows = torch.as_tensor(image_index - self.reference[0], device=out.device)
            return (torch.nn.functional.normalize(out.flatten(1), dim=-1) * self.reference[1][rows]).sum(-1) \
                .cpu().numpy().astype(np.float64)
        t = torch.as_tensor(self.targets[image_index], device=out.device)
        if self.text is None:
            return out.softmax(-1).gather(1, t[:, None])[:, 0].cpu().numpy().astype(np.float64)
        return (torch.nn.functional.normalize(out, dim=-1) * self.text[t]).sum(-1).cpu().numpy().astype(np.float64)


def _check_fractions(fractions: Sequence[float], name: str) -> np.ndarray:
    f = np.asarray(fractions, dtype=np.float64)
    if f.ndim != 1 or len(f) == 0 or np.any(f < 0) or np.any(f >= 1) or np.any(np.diff(f) <= 0):
        raise InvalidParameterError(f"{name} must be increasing values in [0, 1); got {list(fractions)}.")
    return f


def _check_maps(m: LoadedModel, attribution: AttributionResult) -> None:
    grids = map_grids(m, attribution.image_size)  # the patch grid; a hierarchical model's stage grids too (its CAMs)
    if tuple(attribution.grid) not in grids:
        raise InvalidParameterError(f"these {attribution.method} maps are on a {attribution.grid} grid, not this "
                                    f"model's {' or '.join(str(g) for g in grids)}; compute them on this model.")


@dataclass(frozen=True)
class _Setup:
    """What a perturbation metric resolves once for every batch: its granularity and ordering (the protocol's unless
    given), the checked shares removed, the pixels of one map cell (a hierarchical CAM's: a stage's) and the scorer."""

    granularity: str
    ordering: str
    points: np.ndarray
    cell: tuple[int, int]
    scorer: _Scorer

    @classmethod
    def of(cls, metric: str, m: LoadedModel, attribution: AttributionResult, labels: np.ndarray | None,
           points: Sequence[float], name: str, protocol: str, granularity: str | None, ordering: str | None
           ) -> "_Setup":
        proto = get_protocol(metric, protocol)
        granularity = proto.granularity if granularity is None else granularity
        ordering = check_ordering(proto.ordering if ordering is None else ordering)
        f = _check_fractions(points, name)
        _check_maps(m, attribution)
        return cls(granularity, ordering, f, attribution.cell_px(m.spec.stride_px), _Scorer(m, attribution, labels))

    def curves(self, m: LoadedModel, images: Images, attribution: AttributionResult, batch_size: int,
               perturbation: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
               ) -> tuple[np.ndarray, np.ndarray]:
        """(most relevant first, least relevant first): [B, S] scores of the images with the units the maps rank
        removed at each share; ``perturbation(batch)`` gives the batch's ``perturb(masks [b, S, H, W])`` -> the
        perturbed images [b * S, C, H, W], called for the most relevant first, then the least."""
        curves: dict[bool, list[np.ndarray]] = {True: [], False: []}
        offset, s = 0, len(self.points)
        for x in iter_batches(images, m.data_config, batch_size):
            b = x.shape[0]
            perturb = perturbation(x)
            self.scorer.see(x.to(m.device), offset)
            index = np.repeat(np.arange(offset, offset + b), s)
            for most_first in (True, False):
                masks = removal_masks(attribution.maps[offset:offset + b], self.points, most_first, self.cell,
                                      (int(x.shape[-2]), int(x.shape[-1])), self.granularity,
                                      self.ordering)  # [b, S, H, W]
                curves[most_first].append(self.scorer(perturb(masks), index, batch_size * s).reshape(b, s))
            offset += b
        if offset != len(attribution.maps):
            raise InvalidParameterError(f"{offset} images for {len(attribution.maps)} maps; pass the images the maps "
                                        "were computed on.")
        return np.concatenate(curves[True]), np.concatenate(curves[False])


@dataclass(eq=False, repr=False)
class PerturbationResult(Result):
    """Chefer et al.'s positive and negative perturbation curves of one method's maps.

    Attributes:
        method: the attribution method the maps came from.
        fractions: [S] share of tokens (or pixels) removed; the first is 0, the unperturbed image.
        positive: [B, S] score as the most relevant units are removed first.
        negative: [B, S] score as the least relevant units are removed first.
        positive_auc, negative_auc: [B] trapezoid areas over ``fractions`` (mean over images = the area of the mean
            curve). Positive: lower is more faithful; negative: higher is more faithful.
        score: "top-1 accuracy" (against labels), "probability" (of the target class), or "cosine similarity to
            the prompt".
        granularity: "token" or "pixel"; fill: "black", "mean" or "blur".
        model_name: the model's name.
        protocol: the named protocol (``protocols.PROTOCOLS``: "vitlens" or "chefer2021");
        ordering: "signed" (by R) or "absolute" (by |R|).
    """

    kind = "perturbation"
    method: str
    fractions: np.ndarray
    positive: np.ndarray
    negative: np.ndarray
    positive_auc: np.ndarray
    negative_auc: np.ndarray
    score: str
    granularity: str = "token"
    fill: str = "black"
    model_name: str = ""
    protocol: str = "vitlens"
    ordering: str = "signed"

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}: {self.method} over {counted(len(self.positive), 'image')}, "
                f"positive perturbation AUC {significant(self.positive_auc.mean())} (lower is better), negative "
                f"{significant(self.negative_auc.mean())} (higher is better), {self.score}, {self.granularity}s "
                f"removed to {self.fill}, protocol {self.protocol}, ordered by {_ordering_words(self.ordering)}")

    def to_rows(self) -> list[dict]:
        """One row per (order, fraction): the mean score over images, with the order's mean AUC."""
        return [{"method": self.method, "order": name, "fraction": float(f), "score": float(v),
                 "auc": float(auc.mean()), "protocol": self.protocol, "ordering": self.ordering}
                for name, curve, auc in (("positive", self.positive, self.positive_auc),
                                         ("negative", self.negative, self.negative_auc))
                for f, v in zip(self.fractions, curve.mean(0))]


def perturbation_test(m: LoadedModel, images: Images, attribution: AttributionResult,
                      labels: np.ndarray | None = None, fractions: Sequence[float] = CHEFER_FRACTIONS,
                      granularity: str | None = None, fill: str = "black", batch_size: int = 16,
                      protocol: str = "vitlens", ordering: str | None = None) -> PerturbationResult:
    """Chefer et al. 2021's positive and negative perturbation of ``attribution``'s maps (same images, same targets).

    Args:
        m: the model the maps explain.
        images: the images the maps were computed on, in the same order.
        attribution: the maps (``vl.attribute``).
        labels: [B] true classes: the curves are then top-1 accuracy, as in the paper; without, the target class's
            probability.
        fractions: shares removed, increasing in [0, 1); the paper's 0, 0.1, .., 0.9 by default (0 = unperturbed).
        granularity: "token" (whole patches) or "pixel" (the bilinearly upsampled map's pixels, the paper's way);
            None for the protocol's.
        fill: what removed pixels become: "black" (the paper's zero before normalisation), "mean" or "blur".
        batch_size: images per step; every image's perturbed copies go through the model together, in forwards of
            ``batch_size`` x len(fractions) images.
        protocol: "vitlens" (tokens) or "chefer2021" (Chefer et al.'s script: pixels, black), see ``protocols``.
        ordering: "signed" (rank by R) or "absolute" (by |R|); None for the protocol's ("signed").

    Returns:
        A ``PerturbationResult``: ``positive`` (most relevant removed first; lower AUC is better) and
            ``negative`` (least relevant first; higher is better) curves [B, len(fractions)], their AUCs, as
            accuracy with ``labels`` or the target's probability without.
    """
    run = _Setup.of("perturbation", m, attribution, labels, fractions, "fractions", protocol, granularity, ordering)
    f = run.points

    def filled(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        x = x.to(m.device)
        fill_x = fill_image(x, fill, m.data_config)

        def perturb(masks: torch.Tensor) -> torch.Tensor:  # [b, S, H, W] -> [b * S, C, H, W]
            where = masks.to(x.device)[:, :, None]  # [b, S, 1, H, W]
            return torch.where(where, fill_x[:, None], x[:, None]).reshape(-1, *x.shape[1:])
        return perturb

    pos, neg = run.curves(m, images, attribution, batch_size, filled)
    return PerturbationResult(method=attribution.method, fractions=f, positive=pos, negative=neg,
                              positive_auc=np.trapezoid(pos, f, axis=1), negative_auc=np.trapezoid(neg, f, axis=1),
                              score=run.scorer.name, granularity=run.granularity, fill=fill, model_name=m.spec.name,
                              protocol=protocol, ordering=run.ordering)


@dataclass(eq=False, repr=False)
class RoadResult(Result):
    """ROAD curves of one method's maps: most relevant first (MoRF) and least relevant first (LeRF).

    Attributes:
        method: the attribution method the maps came from.
        percentages: [P] share of tokens (or pixels) removed and imputed.
        morf: [B, P] score with the most relevant units removed; lower is more faithful.
        lerf: [B, P] score with the least relevant units removed; higher is more faithful.
        score: "top-1 accuracy", "probability" or "cosine similarity to the prompt" (see ``perturbation_test``).
        noise_std: the imputation's noise, in normalised input units; granularity: "token" or "pixel".
        seed: the noise's seed.
        model_name: the model's name.
        protocol: "vitlens" (tokens) or "rong2022" (pixels, as Rong et al.); ordering: "signed" or "absolute".
    """

    kind = "road"
    method: str
    percentages: np.ndarray
    morf: np.ndarray
    lerf: np.ndarray
    score: str
    noise_std: float = 0.01
    granularity: str = "token"
    seed: int = 0
    model_name: str = ""
    protocol: str = "vitlens"
    ordering: str = "signed"

    def means(self) -> tuple[float, float]:
        """(MoRF, LeRF): the curves' mean over images and percentages (one number each, as a table column)."""
        return float(self.morf.mean()), float(self.lerf.mean())

    def summary(self) -> str:
        morf, lerf = self.means()
        return (f"{self.model_name or 'model'}: {self.method} ROAD over {counted(len(self.morf), 'image')}, mean MoRF "
                f"{significant(morf)} (lower is better), mean LeRF {significant(lerf)} (higher is better), "
                f"{self.score}, {self.granularity}s imputed, protocol {self.protocol}, ordered by "
                f"{_ordering_words(self.ordering)}")

    def to_rows(self) -> list[dict]:
        """One row per (order, percentage): the mean score over images."""
        return [{"method": self.method, "order": name, "percentage": float(p), "score": float(v),
                 "protocol": self.protocol, "ordering": self.ordering}
                for name, curve in (("MoRF", self.morf), ("LeRF", self.lerf))
                for p, v in zip(self.percentages, curve.mean(0))]


def road(m: LoadedModel, images: Images, attribution: AttributionResult, labels: np.ndarray | None = None,
         percentages: Sequence[float] = ROAD_PERCENTAGES, noise_std: float = 0.01, granularity: str | None = None,
         seed: int = 0, batch_size: int = 16, protocol: str = "vitlens", ordering: str | None = None) -> RoadResult:
    """ROAD (remove and debias) of ``attribution``'s maps: MoRF and LeRF curves with noisy linear imputation.

    Args:
        m: the model the maps explain.
        images: the images the maps were computed on, in the same order.
        attribution: the maps (``vl.attribute``).
        labels: [B] true classes: the curves are then top-1 accuracy, as in the paper; without, the target class's
            probability.
        percentages: shares removed, increasing in [0, 1) (default 0.1, .., 0.9).
        noise_std: noise of the imputation in normalised input units (the paper's 0.01).
        granularity: "token" (whole patches, imputed from their border) or "pixel" (the upsampled map's pixels);
            None for the protocol's.
        seed: seed of the noise (the curves are reproducible).
        batch_size: images per step: one sparse solve per (order, percentage) for the batch, then one forward pass
            over all its imputed images in chunks of ``batch_size`` x len(percentages).
        protocol: "vitlens" (tokens) or "rong2022" (pixels, as Rong et al.), see ``protocols``.
        ordering: "signed" (rank by R) or "absolute" (by |R|); None for the protocol's ("signed").

    Returns:
        A ``RoadResult``: ``morf`` (most relevant first; lower is better) and ``lerf`` (least relevant first;
            higher is better) curves over ``percentages``, as accuracy with ``labels`` or the target's
            probability without (``score`` says which).
    """
    run = _Setup.of("road", m, attribution, labels, percentages, "percentages", protocol, granularity, ordering)
    rng = np.random.default_rng(seed)

    def imputed(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        xs = x.detach().cpu().to(torch.float64).numpy()

        def perturb(masks: torch.Tensor) -> torch.Tensor:  # [b, S, H, W] -> [b * S, C, H, W], imputed in turn
            held = masks.numpy()
            filled = np.stack([noisy_linear_impute(xs, held[:, k], noise_std, rng) for k in range(held.shape[1])],
                              axis=1)
            return torch.as_tensor(filled.reshape(-1, *x.shape[1:]), dtype=x.dtype, device=m.device)
        return perturb

    morf, lerf = run.curves(m, images, attribution, batch_size, imputed)
    return RoadResult(method=attribution.method, percentages=run.points, morf=morf, lerf=lerf, score=run.scorer.name,
                      noise_std=float(noise_std), granularity=run.granularity, seed=int(seed), model_name=m.spec.name,
                      protocol=protocol, ordering=run.ordering)


def _ordering_words(ordering: str) -> str:
    return "|R|" if ordering == "absolute" else "signed R"
