"""How faithful is a map? Deletion and insertion curves over patch tokens, and the comparison
table of methods x metrics (with Chefer et al.'s and ROAD's perturbation tests from
``vitlens.attribution.perturbation``, and mask metrics from ``vitlens.attribution.masks`` where masks exist).

Deletion: replace the tokens' pixel blocks by a baseline in the order of the map (highest
first) and follow the target-class probability; a faithful map makes it fall fast (low area
under the curve). Insertion: start from the baseline image and put the blocks back in the same
order; a faithful map makes it rise fast (high area).

``protocol="petsiuk2018"`` runs Petsiuk et al. 2018's (RISE, section 4.1) own procedure instead: pixels
of the upsampled map, W a step, deletion to 0 in the normalised input, insertion from their blur
(``protocols``); ``ordering="absolute"`` ranks by |R|. The result records protocol and ordering.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result, significant
from .baselines import BASELINES, baseline_image, prompt_embeddings
from .masks import mask_scores, masks_at_input
from .methods import AttributionResult, attribute, default_methods
from ..words import counted



@dataclass(eq=False, repr=False)
class FaithfulnessResult(Result):
    """Deletion/insertion curves of one method's maps.

    Attributes:
        method: the attribution method the maps came from.
        fractions: [S + 1] share of tokens removed (deletion) or inserted (insertion), 0 to 1.
        deletion: [B, S + 1] target-class probability as tokens are removed.
        insertion: [B, S + 1] target-class probability as tokens are inserted.
        deletion_auc, insertion_auc: [B] trapezoidal areas under the curves.
        baseline: "mean" (each channel's image mean) or "blur" (Gaussian blur of the image).
        model_name: the model's name.
        score: what the curves follow: "probability" (of the target class), or, for maps of a text
            target, "cosine similarity to the prompt" (the image-text similarity the maps explain).
    """

    kind = "faithfulness"
    method: str
    fractions: np.ndarray
    deletion: np.ndarray
    insertion: np.ndarray
    deletion_auc: np.ndarray
    insertion_auc: np.ndarray
    baseline: str
    model_name: str = ""
    score: str = "probability"
    protocol: str = "vitlens"
    ordering: str = "signed"

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}: {self.method} over {counted(len(self.deletion), 'image')}, deletion AUC "
                f"{significant(self.deletion_auc.mean())}, insertion AUC {significant(self.insertion_auc.mean())} ({self.baseline} "
                f"baseline), protocol {self.protocol}, ordered by {'|R|' if self.ordering == 'absolute' else 'signed R'}")

    def to_rows(self) -> list[dict]:
        """One row per image: its deletion and insertion AUC."""
        return [{"method": self.method, "image": i, "deletion_auc": float(d), "insertion_auc": float(n),
                 "protocol": self.protocol, "ordering": self.ordering}
                for i, (d, n) in enumerate(zip(self.deletion_auc, self.insertion_auc))]


def _token_masks(order: np.ndarray, grid: tuple[int, int], stride: tuple[int, int], counts: Sequence[int],
                 size: tuple[int, int]) -> torch.Tensor:
    """[S + 1, H, W] masks, True where the first ``counts[s]`` tokens of ``order`` lie."""
    gh, gw = grid
    sy, sx = stride
    out = torch.zeros(len(counts), *size, dtype=torch.bool)
    for s, c in enumerate(counts):
        for tok in order[:c]:
            r, col = divmod(int(tok), gw)
            out[s, r * sy:(r + 1) * sy, col * sx:(col + 1) * sx] = True
    return out


def rise_blur(x: torch.Tensor, klen: int = 11, nsig: float = 5.0) -> torch.Tensor:
    """Petsiuk et al.'s insertion substrate: each channel convolved (zero padding ``klen // 2``) with their
    kernel, ``scipy.ndimage.gaussian_filter`` of a ``klen`` x ``klen`` delta with sigma ``nsig`` (its default
    reflect mode folds the tails back in, so the kernel sums to 1)."""
    from scipy.ndimage import gaussian_filter

    delta = np.zeros((klen, klen))
    delta[klen // 2, klen // 2] = 1.0
    k = torch.as_tensor(gaussian_filter(delta, nsig), dtype=x.dtype, device=x.device)
    c = x.shape[1]
    return torch.nn.functional.conv2d(x, k.expand(c, 1, klen, klen), padding=klen // 2, groups=c)


@torch.no_grad()
def _petsiuk(m: LoadedModel, images: Images, attribution: AttributionResult, ordering: str,
             batch_size: int) -> FaithfulnessResult:
    """RISE's CausalMetric (Petsiuk et al. 2018): W pixels a step over H steps of the upsampled map's pixel order,
    deletion to 0 (normalised), insertion from ``rise_blur``; score the target's probability (or prompt
    similarity); AUC the trapezoid over i / n_steps."""
    from .perturbation import removal_masks

    text = prompt_embeddings(m, attribution)
    dels, ins, offset, fractions = [], [], 0, np.zeros(1)
    for x in iter_batches(images, m.data_config, batch_size):
        x = x.to(m.device)
        h, w = x.shape[-2:]
        n_steps = (h * w + w - 1) // w
        counts = [min(w * i, h * w) for i in range(n_steps + 1)]
        fractions = np.arange(n_steps + 1, dtype=np.float64) / n_steps
        blurred = rise_blur(x)
        for i in range(x.shape[0]):
            j = offset + i
            masks = removal_masks(attribution.maps[j:j + 1], None, True, m.spec.stride_px, (h, w), "pixel", ordering,
                                  counts=counts)[0].to(x.device)[:, None]  # [S, 1, H, W]
            deleted = torch.where(masks, torch.zeros_like(x[i:i + 1]), x[i:i + 1])
            inserted = torch.where(masks, x[i:i + 1], blurred[i:i + 1])
            both = torch.cat([deleted, inserted])
            out = torch.cat([m.logits(both[k:k + batch_size * 8]) for k in range(0, len(both), batch_size * 8)])
            if text is None:
                probs = out.softmax(-1)[:, int(attribution.targets[j])]
            else:
                probs = torch.nn.functional.normalize(out, dim=-1) @ text[int(attribution.targets[j])]
            probs = probs.cpu().numpy().astype(np.float64)
            dels.append(probs[: n_steps + 1])
            ins.append(probs[n_steps + 1:])
        offset += x.shape[0]
    deletion, insertion = np.stack(dels), np.stack(ins)
    return FaithfulnessResult(method=attribution.method, fractions=fractions, deletion=deletion, insertion=insertion,
                              deletion_auc=np.trapezoid(deletion, fractions, axis=1),
                              insertion_auc=np.trapezoid(insertion, fractions, axis=1), baseline="zero/blur",
                              model_name=m.spec.name,
                              score="probability" if text is None else "cosine similarity to the prompt",
                              protocol="petsiuk2018", ordering=ordering)


@torch.no_grad()
def deletion_insertion(m: LoadedModel, images: Images, attribution: AttributionResult, steps: int = 16,
                       baseline: str = "mean", batch_size: int = 16, protocol: str = "vitlens",
                       ordering: str | None = None) -> FaithfulnessResult:
    """Deletion and insertion curves of ``attribution``'s maps on the same images and targets.

    Deletion replaces the tokens the map ranks highest first by the baseline and follows the target's
    probability (lower area is more faithful); insertion starts from the baseline image and puts the
    highest-ranked tokens back first (higher area is more faithful).

    Args:
        m: the model the maps explain.
        images: the images the maps were made on.
        attribution: the maps (and their targets: a class, or a prompt for a text tower).
        steps: curve points beyond the first (the share of tokens changed goes 0, 1/steps, .., 1).
        baseline: what removed tokens become: "mean" (the image's mean colour) or "blur".
        batch_size: images per step.
        protocol: "vitlens" (tokens, ``steps`` steps, one ``baseline``) or "petsiuk2018" (RISE's own procedure,
            ``protocols``; ``steps`` and ``baseline`` are then theirs).
        ordering: "signed" (rank by R) or "absolute" (by |R|); None for the protocol's ("signed").

    Returns:
        A ``FaithfulnessResult``: ``deletion`` and ``insertion`` [B, steps + 1] curves (probabilities, or
        cosine similarities for a prompt), their AUCs [B] over the fractions in [0, 1].

    Raises:
        InvalidParameterError: ``steps`` < 1 or an unknown baseline.
    """
    from .protocols import check_ordering, protocol as get_protocol

    ordering = check_ordering(get_protocol("deletion_insertion", protocol).ordering if ordering is None else ordering)
    if protocol == "petsiuk2018":
        return _petsiuk(m, images, attribution, ordering, batch_size)
    if steps < 1:
        raise InvalidParameterError(f"steps must be >= 1; got {steps}.")
    text = prompt_embeddings(m, attribution)
    grid = attribution.grid
    n_tok = grid[0] * grid[1]
    counts = [round(n_tok * s / steps) for s in range(steps + 1)]
    fractions = np.asarray(counts, dtype=np.float64) / n_tok
    dels, ins, offset = [], [], 0
    for x in iter_batches(images, m.data_config, batch_size):
        x = x.to(m.device)
        base = baseline_image(x, baseline)
        for i in range(x.shape[0]):
            j = offset + i
            values = attribution.maps[j].reshape(-1)
            order = np.argsort(-(np.abs(values) if ordering == "absolute" else values), kind="stable")
            masks = _token_masks(order, grid, m.spec.stride_px, counts, tuple(x.shape[-2:])).to(x.device)[:, None]
            deleted = torch.where(masks, base[i:i + 1], x[i:i + 1])
            inserted = torch.where(masks, x[i:i + 1], base[i:i + 1])
            out = m.logits(torch.cat([deleted, inserted]))
            if text is None:
                probs = out.softmax(-1)[:, int(attribution.targets[j])]
            else:  # the cosine similarity to the image's prompt, the score the maps explain
                probs = torch.nn.functional.normalize(out, dim=-1) @ text[int(attribution.targets[j])]
            dels.append(probs[: steps + 1].cpu().numpy().astype(np.float64))
            ins.append(probs[steps + 1:].cpu().numpy().astype(np.float64))
        offset += x.shape[0]
    deletion, insertion = np.stack(dels), np.stack(ins)
    return FaithfulnessResult(method=attribution.method, fractions=fractions, deletion=deletion, insertion=insertion,
                              deletion_auc=np.trapezoid(deletion, fractions, axis=1),
                              insertion_auc=np.trapezoid(insertion, fractions, axis=1), baseline=baseline,
                              model_name=m.spec.name,
                              score="probability" if text is None else "cosine similarity to the prompt",
                              ordering=ordering)


METRICS = ("deletion_insertion", "perturbation", "road")
DEFAULT_METRICS = ("deletion_insertion", "perturbation")


@dataclass(eq=False, repr=False)
class ComparisonTable(Result):
    """Methods x metrics over one image set.

    Attributes:
        rows: one dict per method: deletion/insertion AUC (mean), Chefer et al.'s positive/negative perturbation
            AUC, ROAD's mean MoRF/LeRF (when asked for), seconds per image, and with masks the pointing-game hit
            rate and share of map mass inside the mask.
        n_images: images compared.
        attributions: the maps of every method; faithfulness: the deletion/insertion curves of every method;
        perturbations: Chefer et al.'s curves; roads: the ROAD curves (empty when those metrics were not asked for).
        sanity: a ``sanity.SanityTable`` of some of the methods on some of the images, when one was attached
            (``vitlens report --attributions`` does); None otherwise.
        ledger: an ``lrp_ledger.ConservationLedger`` of AttnLRP on some of the images, when one was attached
            (``vitlens report --attributions`` does when attnlrp runs); None otherwise.
        protocols: metric -> "protocol, ordering" that made its columns (e.g. ``{"perturbation": "chefer2021,
            signed"}``); empty for tables saved before protocols were recorded.
    """

    kind = "attribution_comparison"
    rows: list[dict]
    n_images: int
    attributions: list[AttributionResult] = field(default_factory=list)
    faithfulness: list[FaithfulnessResult] = field(default_factory=list)
    model_name: str = ""
    perturbations: list = field(default_factory=list)
    roads: list = field(default_factory=list)
    sanity: Any = None
    protocols: dict = field(default_factory=dict)
    ledger: Any = None

    def summary(self) -> str:
        made = "; ".join(f"{k}: {v}" for k, v in self.protocols.items())
        return f"{self.model_name or 'model'}: {counted(len(self.rows), 'method')} x {counted(self.n_images, 'image')}" + (
            f" (protocols {made})" if made else "")

    def to_rows(self) -> list[dict]:
        """One row per method: its scores (the table as shown)."""
        return [dict(r) for r in self.rows]

    @classmethod
    def concat(cls, tables: Sequence["ComparisonTable"]) -> "ComparisonTable":
        """One table of the methods of several tables over the same images (e.g. one method each)."""
        if not tables:
            raise InvalidParameterError("concat needs at least one table.")
        if len({t.n_images for t in tables}) != 1:
            raise InvalidParameterError("Only tables over the same images concatenate.")
        return cls(rows=[r for t in tables for r in t.rows], n_images=tables[0].n_images,
                   attributions=[a for t in tables for a in t.attributions],
                   faithfulness=[f for t in tables for f in t.faithfulness], model_name=tables[0].model_name,
                   perturbations=[p for t in tables for p in t.perturbations], roads=[r for t in tables for r in t.roads],
                   protocols=dict(tables[0].protocols))


def compare_methods(m: LoadedModel, images: Images, methods: Sequence[str] | None = None, masks: np.ndarray | None = None,
                    target: Any = None, steps: int = 16, baseline: str = "mean", batch_size: int = 16,
                    progress: ProgressArg = None, method_params: dict[str, dict] | None = None,
                    metrics: Sequence[str] = DEFAULT_METRICS, labels: np.ndarray | None = None,
                    protocol: str = "vitlens", ordering: str | None = None) -> ComparisonTable:
    """Every method's maps, their faithfulness scores and (with masks) mask metrics, timed.

    Args:
        m: the model.
        images: the images (read once into a list unless a tensor).
        methods: names from ``METHODS``; None for ``default_methods()`` (every available method but scorecam).
        masks: [B, h, w] bool object masks of the images, for pointing game and mass in mask (brought
            through the images' own resize and crop, so masks of 64 px scenes serve a 224 px model). With
            masks the table gains pointing_game (share of images whose map's top patch hits the object),
            mass_in_mask (share of a map's non-negative mass on object pixels) and mass_ratio (mass_in_mask
            / the object's share of the image, per image, then averaged: 1 = no better than a uniform map).
        target: class to explain (one for all, one per image, or None for the predictions), or for a model
            with a text tower a prompt (one for all or one per image): the curves then follow the similarity.
        steps: deletion/insertion steps.
        baseline: what removed patches become in deletion/insertion ("mean" or "blur").
        batch_size: images per step.
        progress: True for one progress bar over the whole table (tqdm's time left; its description names the
            method being computed), or a callable ``f(done, total)``; both count two steps per method and image:
            its map, then its scores.
        method_params: per-method parameters, e.g. ``{"integrated_gradients": {"n_steps": 32}}``.
        metrics: which faithfulness scores, from ``METRICS``: "deletion_insertion" (columns deletion_auc,
            insertion_auc; 2 x (steps + 1) forwards per image), "perturbation" (Chefer et al.'s positive and
            negative perturbation, ``perturbation.perturbation_test`` with its defaults: chefer_positive_auc,
            chefer_negative_auc; 20 forwards per image), both by default, and "road" (opt-in: road_morf,
            road_lerf, the curves' means; 18 forwards and 18 sparse solves per image, the solves dominating).
        labels: [B] true classes: the perturbation and ROAD curves are then top-1 accuracy, as in their papers;
            without, the target class's probability. Deletion/insertion always follow the probability.
        protocol: "vitlens" (every metric's token default) or "published" (each metric's paper: petsiuk2018,
            chefer2021, rong2022; ``protocols.PUBLISHED``); the table's ``protocols`` records which.
        ordering: "signed" or "absolute" for every metric; None for each protocol's own ("signed").

    Returns:
        A ``ComparisonTable``: one row per method (its metrics' scores and seconds per image), with every
        method's maps and curves.
    """
    from .perturbation import perturbation_test, road
    from .protocols import PUBLISHED, check_ordering, protocol as get_protocol

    if protocol not in ("vitlens", "published"):
        raise InvalidParameterError(f"protocol must be 'vitlens' or 'published'; got {protocol!r}.")
    names = {k: ("vitlens" if protocol == "vitlens" else PUBLISHED[k]) for k in METRICS}
    orders = {k: check_ordering(get_protocol(k, names[k]).ordering if ordering is None else ordering) for k in METRICS}

    methods = default_methods() if methods is None else methods
    bad = [k for k in metrics if k not in METRICS]
    if bad:
        raise InvalidParameterError(f"metrics must be names from {', '.join(METRICS)}; got {', '.join(map(repr, bad))}.")
    images = list(images) if not isinstance(images, torch.Tensor) else images
    if masks is not None:
        masks = masks_at_input(masks, m.data_config, images)
    rows, attrs, faiths, perts, roads = [], [], [], [], []
    n = len(images)
    # two steps per image of a method: its map, then its scores (deletion/insertion and perturbation forwards
    # outweigh a quick method's map many times on a large model)
    with Progress(progress, 2 * len(methods) * n, desc="attributions", unit="step") as bar:
        for i, method in enumerate(methods):
            bar.describe(f"attributions: {method}")

            def mapped(done: int, _total: int | None, before: int = 2 * i * n) -> None:  # within this method's maps
                bar.update(before + min(done, n))

            a = attribute(m, images, method=method, target=target, batch_size=batch_size,
                          progress=mapped if progress else None, **(method_params or {}).get(method, {}))
            bar.describe(f"attributions: {method} (scores)")
            row: dict[str, Any] = {"method": method}
            if "deletion_insertion" in metrics:
                f = deletion_insertion(m, images, a, steps=steps, baseline=baseline, batch_size=batch_size,
                                       protocol=names["deletion_insertion"], ordering=orders["deletion_insertion"])
                row.update({"deletion_auc": float(f.deletion_auc.mean()), "insertion_auc": float(f.insertion_auc.mean())})
                faiths.append(f)
            if "perturbation" in metrics:
                pt = perturbation_test(m, images, a, labels=labels, batch_size=batch_size, protocol=names["perturbation"],
                                       ordering=orders["perturbation"])
                row.update({"chefer_positive_auc": float(pt.positive_auc.mean()),
                            "chefer_negative_auc": float(pt.negative_auc.mean())})
                perts.append(pt)
            if "road" in metrics:
                rd = road(m, images, a, labels=labels, batch_size=batch_size, protocol=names["road"], ordering=orders["road"])
                morf, lerf = rd.means()
                row.update({"road_morf": morf, "road_lerf": lerf})
                roads.append(rd)
            row["seconds_per_image"] = a.seconds_per_image
            if masks is not None:
                s = mask_scores(a.maps, masks).summary()
                row.update({"pointing_game": s["pointing_game"], "mass_in_mask": s["mass_in_mask"],
                            "mass_ratio": s["ratio_mean"]})
            rows.append(row)
            attrs.append(a)
            bar.update(2 * (i + 1) * n)
    return ComparisonTable(rows=rows, n_images=len(attrs[0].maps) if attrs else 0, attributions=attrs,
                           faithfulness=faiths, model_name=m.spec.name, perturbations=perts, roads=roads,
                           protocols={k: f"{names[k]}, {orders[k]}" for k in metrics})
