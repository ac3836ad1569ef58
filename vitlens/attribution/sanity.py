"""Sanity checks for saliency maps (Adebayo et al. 2018, "Sanity Checks for Saliency Maps", section 3.1,
Fig. 2): cascading model-parameter randomisation. If a map barely changes when the weights that make the
prediction are destroyed, it shows the input (an edge detector would pass as an explanation), not the model.

The cascade, on a deep copy of the model (the user's model is never touched), from the top down, each step
keeping what the steps before it randomised:

1. ``head``: every parameter registered after the last block (timm: the final ``norm``, ``fc_norm``, ``head``);
2. ``blocks.L-1`` .. ``blocks.0``: every parameter of that block (attention, MLP, norms, layer scales);
3. ``embedding``: every parameter registered before the first block (the patch embedding, a hybrid's CNN
   backbone, class/register tokens, position embedding).

Re-initialisation: each parameter tensor is redrawn from a Gaussian with that tensor's own mean and standard
deviation (seeded, one ``torch.Generator`` drawn in cascade order), so activations keep their scale and a
changed map means lost structure rather than a dead network. A tensor whose values are all equal (std 0: an
untrained bias, a LayerNorm gain left at 1) holds no learned structure and stays as it is. Buffers (a
hybrid's BatchNorm running statistics) are kept.

At every step the maps are recomputed for the original model's targets, so the maps compare the same question.
Similarity to the original maps, per image: Spearman rank correlation of the absolute-value maps and of the
signed maps (Adebayo's two rank correlations), and SSIM (``skimage.metrics.structural_similarity``) of the
absolute-value maps normalised as the paper's figures are (divided by their 99th percentile, clipped to
[0, 1]; ``data_range`` = 1; a uniform window of ``min(7, grid)`` tokens, odd). A constant map has no ranks, so
its Spearman is NaN, and means skip NaNs.

Verdict: one rule over the whole cascade (``verdict_rule`` says it in words; the figure draws its one cutoff),
read as Adebayo et al. read their Fig. 2 (Guided BackProp and Guided GradCAM fail because their maps survive the
randomisation of the top layers, not only of all of them). The curve is the mean Spearman of |maps| after each
step; the map decorrelates at the first step where that mean falls below ``threshold`` (0.5):

- it decorrelates at the first step (the head; a model without one: its top block): "depends on the weights";
- it decorrelates further down: "survives the head" (and "N top blocks", the steps before the one that
  decorrelates it), e.g. attention rollout, which reads no head, or a gradient that keeps the input's edges;
- it never does, the embedding included: "barely changes".

So equal curves get equal verdicts, and a curve's verdict changes only where it crosses the drawn cutoff. Steps are
named for people by ``step_label`` ("block 6" for the module ``blocks.5``: blocks counted from 1, as everywhere
else); the module's name stays in the table's ``module`` column.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..images import Images, image_list
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result, significant
from .methods import METHOD_TABLE, attribute, preselected_methods
from ..words import counted
from .faithfulness import readable_rows

#: the verdict's one cutoff on the mean Spearman of |maps| (drawn on ``figures.sanity_figure``'s first panel)
THRESHOLD = 0.5
#: the table's columns as a person reads them (``SanityTable.readable_rows``)
COLUMN_LABELS = {"spearman_abs": "Spearman |maps|, all randomised", "spearman": "Spearman signed, all randomised",
                 "ssim": "SSIM, all randomised", "first_decorrelated": "first below the cutoff at",
                 "survives": "survives"}
#: the steps of the cascade that are not blocks (every other step is a block, named by its module)
NOT_BLOCKS = ("head", "embedding")
#: the built-in methods cheap enough to run L + 2 times in a report (``Method.quick``: one forward and at most
#: one backward per image); ``quick_methods()`` reads the table at call time
QUICK_METHODS = tuple(name for name, mt in METHOD_TABLE.items() if mt.quick)


def quick_methods() -> tuple[str, ...]:
    """Every method of ``METHOD_TABLE`` marked ``quick`` (one registered later too)."""
    return tuple(name for name, mt in METHOD_TABLE.items() if mt.quick)


def parameter_groups(m: LoadedModel) -> list[tuple[str, list[str]]]:
    """The cascade's steps, top down: (step name, parameter names it re-initialises). Steps without parameters
    (a model with no head) are left out."""
    names = [n for n, _ in m.model.named_parameters()]
    blocks = m.block_names()
    of_block = {n: b for n in names for b in blocks if n.startswith(b + ".")}
    inside = [i for i, n in enumerate(names) if n in of_block]
    if not inside:
        raise InvalidParameterError(f"{m.spec.name}: no parameter lies in its blocks ({', '.join(blocks)}); "
                                    "the cascade needs the blocks' parameters.")
    first, last = inside[0], inside[-1]
    steps = [("head", [n for i, n in enumerate(names) if i > last and n not in of_block])]
    steps += [(b, [n for n in names if of_block.get(n) == b]) for b in reversed(blocks)]
    steps.append(("embedding", [n for i, n in enumerate(names) if i < first and n not in of_block]))
    return [(s, ps) for s, ps in steps if ps]


@torch.no_grad()
def randomise_(module: torch.nn.Module, names: Sequence[str], generator: torch.Generator) -> None:
    """Redraw the named parameters in place from a Gaussian with each tensor's own mean and std (see module doc)."""
    params = dict(module.named_parameters())
    for n in names:
        p = params[n]
        flat = p.detach().to(torch.float64).reshape(-1)
        std = float(flat.std()) if flat.numel() > 1 else 0.0
        if std == 0.0:
            continue
        z = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        p.copy_((float(flat.mean()) + std * z).to(p.dtype))


def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of each row of a and b ([B, N] each; average ranks for ties): [B], NaN where
    a row is constant."""
    from scipy.stats import rankdata

    ra = rankdata(np.asarray(a, dtype=np.float64), axis=1)
    rb = rankdata(np.asarray(b, dtype=np.float64), axis=1)
    ra -= ra.mean(1, keepdims=True)
    rb -= rb.mean(1, keepdims=True)
    den = np.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(1) / np.where(den > 0, den, 1.0), np.nan)


def normalise_abs(maps: np.ndarray) -> np.ndarray:
    """Adebayo et al.'s display normalisation: |map| divided by its 99th percentile, clipped to [0, 1] ([B, ...])."""
    a = np.abs(np.asarray(maps, dtype=np.float64))
    p99 = np.percentile(a.reshape(len(a), -1), 99, axis=1).reshape(-1, *([1] * (a.ndim - 1)))
    return np.clip(a / np.where(p99 > 0, p99, 1.0), 0.0, 1.0)


def ssim_maps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SSIM of each pair of [B, gh, gw] maps after ``normalise_abs`` (data_range 1, uniform window of the largest
    odd size <= min(7, gh, gw)): [B]."""
    from skimage.metrics import structural_similarity

    na, nb = normalise_abs(a), normalise_abs(b)
    side = min(7, *na.shape[1:])
    win = side if side % 2 else side - 1
    if win < 3:
        raise InvalidParameterError(f"SSIM needs maps of at least 3x3 tokens; these are {na.shape[1]}x{na.shape[2]}.")
    return np.array([structural_similarity(x, y, data_range=1.0, win_size=win) for x, y in zip(na, nb)])


def _nanmean(values: np.ndarray) -> float:
    """Mean without NaNs; NaN (no warning) when every value is NaN."""
    v = np.asarray(values, dtype=np.float64)
    return float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")


def step_label(step: str, steps: Sequence[str]) -> str:
    """How a person reads a step of the cascade: "head", "embedding", or "block k" for a block, counted from 1 in
    the model's order (``blocks.5`` of six blocks: "block 6"), as the app counts layers.

    Args:
        step: one of ``steps``.
        steps: the cascade's steps, top down (``SanityResult.steps``: the blocks from the last to the first).

    Returns:
        The label.
    """
    if step in NOT_BLOCKS:
        return step
    blocks = [s for s in steps if s not in NOT_BLOCKS]
    return f"block {len(blocks) - blocks.index(step)}"


def verdict_of(means: Sequence[float] | np.ndarray, steps: Sequence[str], threshold: float = THRESHOLD) -> str:
    """The verdict word of one curve: the one rule of the module docstring (``verdict_rule`` in words).

    Args:
        means: [S] the mean Spearman of |maps| after each step (NaN: constant maps).
        steps: the cascade's steps, top down.
        threshold: the cutoff.

    Returns:
        "depends on the weights", "survives the head and N top blocks" (or "survives the head", or "survives N
            top blocks" for a model without a head), "barely changes", or "undefined" (constant maps at the end).
    """
    v = np.asarray(means, dtype=np.float64)
    if not len(v) or not np.isfinite(v[-1]):
        return "undefined"
    below = np.flatnonzero(v < threshold)
    if not len(below):
        return "barely changes"
    if below[0] == 0:
        return "depends on the weights"
    kept = list(steps[:below[0]])
    head = kept[0] == "head"
    blocks = len(kept) - head
    parts = (["the head"] if head else []) + ([f"{blocks} top block{'s' if blocks > 1 else ''}"] if blocks else [])
    return "survives " + " and ".join(parts)


def verdict_rule(threshold: float = THRESHOLD) -> str:
    """The verdict's rule in words, the same wherever a verdict is shown (the app, the report, the tutorial).

    Args:
        threshold: the cutoff (``SanityResult.threshold``).

    Returns:
        One paragraph.
    """
    t = significant(threshold)
    return (f"Verdict, one rule for every method: a map decorrelates at the first step where the mean Spearman of "
            f"|maps| with the original model's falls below {t} (the dotted line on the left panel). \"depends on the "
            f"weights\": it decorrelates as soon as the head is randomised. \"survives the head and N top blocks\": "
            f"it stays at or above {t} until further down; a map that outlives the weights that make the prediction "
            f"shows the input or the architecture more than the classifier (Adebayo et al. 2018 fault Guided "
            f"BackProp for this). \"barely changes\": it stays at or above {t} through the whole cascade, the "
            f"embedding included. The signed Spearman and the SSIM are shown beside it, not used by the verdict.")


@dataclass(eq=False, repr=False)
class SanityResult(Result):
    """Cascading randomisation of one method (Adebayo et al. 2018, Fig. 2).

    Attributes:
        method: the attribution method.
        steps: [S] the cascade's steps, top down ("head", "blocks.5", .., "blocks.0", "embedding"); step s has
            every step up to s randomised.
        parameters: [S] names of the parameters each step re-initialised (its own, not the earlier steps').
        spearman_abs: [B, S] Spearman of |original map| and |map at step s|.
        spearman: [B, S] the same on the signed maps.
        ssim: [B, S] SSIM of the normalised absolute-value maps.
        maps: [S + 1, B, gh, gw] the original maps, then the maps at each step.
        targets: [B] the classes explained (the original model's).
        seed: the re-initialisation's seed; threshold: the verdict's threshold.
        model_name: the model's name.
    """

    kind = "sanity"
    method: str
    steps: list
    parameters: list
    spearman_abs: np.ndarray
    spearman: np.ndarray
    ssim: np.ndarray
    maps: np.ndarray
    targets: np.ndarray
    seed: int = 0
    threshold: float = THRESHOLD
    model_name: str = ""

    def final(self) -> dict[str, float]:
        """Mean (over images, NaNs skipped) of every similarity at full randomisation (the last step)."""
        return {"spearman_abs": _nanmean(self.spearman_abs[:, -1]), "spearman": _nanmean(self.spearman[:, -1]),
                "ssim": _nanmean(self.ssim[:, -1])}

    def step_means(self) -> np.ndarray:
        """[S] mean Spearman of |maps| after each step (NaNs skipped)."""
        return np.array([_nanmean(self.spearman_abs[:, i]) for i in range(len(self.steps))])

    def first_decorrelated(self) -> int | None:
        """Index of the first step whose mean Spearman of |maps| is below ``threshold``; None if none is."""
        below = np.flatnonzero(self.step_means() < self.threshold)
        return int(below[0]) if len(below) else None

    def n_blocks(self) -> int:
        """How many of the steps are blocks."""
        return sum(s not in NOT_BLOCKS for s in self.steps)

    def step_labels(self) -> list[str]:
        """[S] the steps as a person reads them (``step_label``: "head", "block 6", .., "block 1", "embedding")."""
        return [step_label(s, self.steps) for s in self.steps]

    def survives(self) -> list[str]:
        """The leading steps after which the map is still at least ``threshold`` similar (mean Spearman of |maps|):
        the weights it outlives, as Adebayo et al. read Fig. 2 (labels, ``step_labels``)."""
        first = self.first_decorrelated()
        return self.step_labels()[:len(self.steps) if first is None else first]

    def verdict_word(self) -> str:
        """The verdict of ``verdict_of`` (the module's one rule) on this result's curve."""
        return verdict_of(self.step_means(), self.steps, self.threshold)

    def verdict(self) -> str:
        """The verdict word, then the numbers that decided it: the step at which the map first decorrelates
        (mean Spearman of |maps| below ``threshold``) and the curve before it."""
        word = self.verdict_word()
        if word == "undefined":
            return f"{self.method}: undefined (constant maps have no rank correlation)"
        means, n, labels = self.step_means(), len(self.steps), self.step_labels()
        t = significant(self.threshold)
        first = self.first_decorrelated()
        if first is None:
            return (f"{self.method}: {word} (mean Spearman of |maps| at full randomisation {significant(means[-1])} >= "
                    f"{t}; no step of {n} decorrelates it)")
        parts = [f"first decorrelates at step {first + 1} of {n}, {labels[first]} (mean Spearman of |maps| "
                 f"{significant(means[first])} < {t})"]
        if first:
            parts.append(f"still >= {t} after randomising " + ", ".join(
                f"{name} ({significant(v)})" for name, v in zip(labels[:first], means)))
        return f"{self.method}: {word} ({'; '.join(parts)})"

    def summary(self) -> str:
        return (f"{self.model_name or 'model'}, {counted(len(self.targets), 'image')}, "
                f"{counted(len(self.steps), 'step')}: {self.verdict()}")

    def to_rows(self) -> list[dict]:
        """One row per step: the mean similarities to the original maps (NaNs skipped); ``randomised`` as a person
        reads it ("block 6"), ``module`` the step's name in the model ("blocks.5")."""
        return [{"method": self.method, "step": i + 1, "randomised": label, "module": s,
                 "parameters": len(self.parameters[i]),
                 "spearman_abs": _nanmean(self.spearman_abs[:, i]), "spearman": _nanmean(self.spearman[:, i]),
                 "ssim": _nanmean(self.ssim[:, i])} for i, (s, label) in enumerate(zip(self.steps, self.step_labels()))]


@dataclass(eq=False, repr=False)
class SanityTable(Result):
    """Several methods' sanity checks on the same images and cascade: one row per method (at full randomisation)."""

    kind = "sanity_table"
    results: list = field(default_factory=list)
    model_name: str = ""

    def summary(self) -> str:
        return f"{self.model_name or 'model'}: sanity checks of {len(self.results)} methods"

    def readable_rows(self) -> list[dict]:
        """The rows as the app and the report show them (``faithfulness.readable_rows`` with ``COLUMN_LABELS``)."""
        return readable_rows(self.to_rows(), COLUMN_LABELS)

    def to_rows(self) -> list[dict]:
        rows = []
        for r in self.results:
            f = r.final()
            first = r.first_decorrelated()
            rows.append({"method": r.method, **f, "verdict": r.verdict_word(),
                         "first_decorrelated": "" if first is None else r.step_labels()[first],
                         "survives": ", ".join(r.survives())})
        return rows


def sanity_table(m: LoadedModel, images: Images, methods: Sequence[str] | None = None,
                 target: Any = None, seed: int = 0, threshold: float = THRESHOLD, batch_size: int = 16,
                 progress: ProgressArg = None, method_params: dict[str, dict] | None = None) -> SanityTable:
    """Cascading randomisation of several methods at once: one deep copy, randomised step by step, every method's
    maps recomputed at each step.

    Args:
        m: the model (never modified: the cascade runs on a deep copy).
        images: the images (read once into a list unless a tensor).
        methods: names from ``METHOD_TABLE``; None for ``preselected_methods(m)`` (rollout, grad_rollout, saliency;
            those defined for the model's kind).
        target: class to explain (one for all, one per image, or None for the original model's predictions);
            the same targets are explained at every step; for a tower without classes, None (its output's norm)
            or a direction (``tower_targets``).
        seed: seed of the re-initialisation.
        threshold: the verdict's cutoff on the mean Spearman of |maps| (``verdict_of``).
        batch_size: images per step of each method.
        progress: True for one progress bar over the cascade (tqdm's time left), or a callable
            ``f(done, total)``: both count method x step computations (the original maps, then each step).
        method_params: per-method parameters, e.g. ``{"integrated_gradients": {"n_steps": 8}}``.

    Returns:
        A ``SanityTable``: one ``SanityResult`` per method (``results``), each with its verdict.
    """
    methods = preselected_methods(m) if methods is None else methods
    bad = [mt for mt in methods if mt not in METHOD_TABLE]
    if bad or not methods:
        raise InvalidParameterError(f"methods must be names from {', '.join(METHOD_TABLE)}; got {list(methods)!r}.")
    if isinstance(target, str) or (isinstance(target, Sequence) and target and isinstance(target[0], str)):
        raise InvalidParameterError("sanity checks explain classes; a text prompt target is not supported here.")
    images = image_list(images)
    params = method_params or {}

    groups = parameter_groups(m)
    bar = Progress(progress, len(methods) * (len(groups) + 1), desc="sanity check", unit="map")
    done = [0]

    def maps_of(model: LoadedModel, method: str, t: Any) -> Any:
        t = t if METHOD_TABLE[method].needs_target else None
        out = attribute(model, images, method=method, target=t, batch_size=batch_size, **params.get(method, {}))
        done[0] += 1
        bar.update(done[0])
        return out

    with bar:
        first = {mt: maps_of(m, mt, target) for mt in methods}
        targets = {mt: a.targets for mt, a in first.items()}
        copy_m = dataclasses.replace(m, model=copy.deepcopy(m.model))
        gen = torch.Generator().manual_seed(int(seed))
        stepped: dict[str, list[np.ndarray]] = {mt: [] for mt in methods}
        for step, names in groups:
            bar.describe(f"sanity check: {step}")
            randomise_(copy_m.model, names, gen)
            for mt in methods:
                # the original's classes stay the targets; a tower's output norm is what it is on every copy
                again = targets[mt] if target is None and first[mt].target_kind == "class" else target
                stepped[mt].append(maps_of(copy_m, mt, again).maps)
    results = []
    for mt in methods:
        orig = first[mt].maps
        flat = orig.reshape(len(orig), -1)
        sa, ss, si = [], [], []
        for mp in stepped[mt]:
            f2 = mp.reshape(len(mp), -1)
            sa.append(spearman_rows(np.abs(flat), np.abs(f2)))
            ss.append(spearman_rows(flat, f2))
            si.append(ssim_maps(orig, mp))
        results.append(SanityResult(method=mt, steps=[s for s, _ in groups], parameters=[list(p) for _, p in groups],
                                    spearman_abs=np.stack(sa, 1), spearman=np.stack(ss, 1), ssim=np.stack(si, 1),
                                    maps=np.stack([orig, *stepped[mt]]), targets=np.asarray(targets[mt]),
                                    seed=int(seed), threshold=float(threshold), model_name=m.spec.name))
    return SanityTable(results=results, model_name=m.spec.name)


def sanity_check(m: LoadedModel, images: Images, method: str = "saliency", target: Any = None, seed: int = 0,
                 threshold: float = THRESHOLD, batch_size: int = 16, progress: ProgressArg = None,
                 **params: Any) -> SanityResult:
    """Cascading model-parameter randomisation of one method (Adebayo et al. 2018); see the module docstring.

    Args:
        m: the model (never modified: the cascade runs on a deep copy).
        images: the images.
        method: a name from ``METHODS``.
        target: class to explain (one for all, one per image, or None for the original model's predictions).
        seed: seed of the re-initialisation.
        threshold: the verdict's cutoff on the mean Spearman of |maps| (``verdict_of``).
        batch_size: images per step.
        progress: as ``sanity_table``'s.
        **params: the method's parameters.

    Returns:
        A ``SanityResult``: per image and step the Spearman (absolute and signed) and SSIM to the original maps,
            ``verdict()``, ``to_pandas()``, and ``vitlens.figures.sanity_figure`` for Adebayo's Fig. 2 curves.
    """
    return sanity_table(m, images, methods=[method], target=target, seed=seed, threshold=threshold,
                        batch_size=batch_size, progress=progress, method_params={method: params}).results[0]
