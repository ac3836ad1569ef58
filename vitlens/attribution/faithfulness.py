"""How faithful is a map? The comparison table of methods x metrics: every method's maps scored by the
perturbation metrics of ``METRIC_TABLE`` (``vitlens.attribution.metrics``: deletion/insertion, Chefer et al.'s
perturbation test, ROAD, and any metric registered there), and by mask metrics (``vitlens.attribution.masks``)
where masks exist.

``deletion_insertion`` and ``FaithfulnessResult`` live in ``vitlens.attribution.deletion`` and are importable
from here as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..images import Images, image_list
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result
from .baselines import BASELINES
from .deletion import FaithfulnessResult, deletion_insertion
from .masks import mask_scores, masks_at_input
from .methods import AttributionResult, attribute, default_methods, method_label
from .metrics import METRIC_TABLE, check_metrics, column_label, default_metrics
from ..words import counted

__all__ = ["BASELINES", "ComparisonTable", "FaithfulnessResult", "compare_methods", "deletion_insertion"]

#: the table's two time columns and what each times; both are wall time per image of the method's own work in
#: this call, its first call in the process included (one-time setup such as a library's first import shows in
#: the first method to need it), so they add up to what the user waits for, not to a warmed-up benchmark's speed
TIME_COLUMNS = {
    "map_seconds_per_image": "the method's maps alone (attribute)",
    "total_seconds_per_image": "its maps and every score of them: what you wait for per method",
}


def timing_note() -> str:
    """The time columns in one sentence, by their shown labels, for the report and the app beside the table."""
    return ("; ".join(f"{COLUMN_LABELS[k]}: {v}" for k, v in TIME_COLUMNS.items())
            + " (wall time per image in this run, a method's first call included: a first run reads higher than a "
            "warm one)")


#: ``ComparisonTable``'s fields before the metrics had one registry: field -> the metric whose results it held
#: (tables saved then still load, and these names still read the table)
_FIELDS_BEFORE_THE_REGISTRY = {"faithfulness": "deletion_insertion", "perturbations": "perturbation", "roads": "road"}


#: the table's own columns (those no metric of ``METRIC_TABLE`` makes) as a person reads them; a metric's columns
#: read from its entry (``metrics.column_label``)
COLUMN_LABELS = {"seconds_per_image": "seconds per image", "map_seconds_per_image": "map seconds per image",
                 "total_seconds_per_image": "total seconds per image", "pointing_game": "pointing game",
                 "mass_in_mask": "mass in mask", "mass_ratio": "mass ratio (1: uniform)",
                 "mask_iou": "IoU (map above its mean)"}


def readable_rows(rows: Sequence[dict], labels: dict[str, str] | None = None) -> list[dict]:
    """Rows as a person reads them: each column by its label (``labels``, then ``COLUMN_LABELS``, then the metrics'
    ``column_label``) and the ``method`` column by the methods' labels (``methods.method_label``).

    Args:
        rows: one dict per method, keyed by the columns' names.
        labels: labels of columns of one's own (the sanity table's).

    Returns:
        The same rows, relabelled (the values untouched but the method names).
    """
    own = {**COLUMN_LABELS, **(labels or {})}
    return [{own.get(k) or column_label(k): (method_label(v) if k == "method" else v) for k, v in row.items()}
            for row in rows]


@dataclass(eq=False, repr=False)
class ComparisonTable(Result):
    """Methods x metrics over one image set.

    Attributes:
        rows: one dict per method: its metrics' columns (``Metric.columns``: deletion/insertion AUC, Chefer et
            al.'s positive/negative perturbation AUC, ROAD's mean MoRF/LeRF, ...), with masks the pointing-game
            hit rate and share of map mass inside the mask, then the time columns (``TIME_COLUMNS``):
            ``map_seconds_per_image`` (the maps alone) and ``total_seconds_per_image`` (maps and scores, what the
            user waits for), wall time per image with the method's first call included. Tables saved before
            have one ``seconds_per_image`` column, the maps alone.
        n_images: images compared.
        attributions: the maps of every method.
        model_name: the model's name.
        sanity: a ``sanity.SanityTable`` of some of the methods on some of the images, when one was attached
            (``vitlens report --attributions`` does); None otherwise.
        protocols: metric -> "protocol, ordering" that made its columns (e.g. ``{"perturbation": "chefer2021,
            signed"}``); empty for tables saved before protocols were recorded.
        ledger: an ``lrp_ledger.ConservationLedger`` of AttnLRP on some of the images, when one was attached
            (``vitlens report --attributions`` does when attnlrp runs); None otherwise.
        scores: metric name -> its result for every method, in the order of the rows (the curves), for the
            metrics scored; ``faithfulness``, ``perturbations`` and ``roads`` read the built-in three.
    """

    kind = "attribution_comparison"
    rows: list[dict]
    n_images: int
    attributions: list[AttributionResult] = field(default_factory=list)
    model_name: str = ""
    sanity: Any = None
    protocols: dict = field(default_factory=dict)
    ledger: Any = None
    scores: dict[str, list] = field(default_factory=dict)

    @property
    def faithfulness(self) -> list:
        """The deletion/insertion curves of every method (``scores["deletion_insertion"]``), or []."""
        return self.scores.get("deletion_insertion", [])

    @property
    def perturbations(self) -> list:
        """Chefer et al.'s perturbation curves of every method (``scores["perturbation"]``), or []."""
        return self.scores.get("perturbation", [])

    @property
    def roads(self) -> list:
        """The ROAD curves of every method (``scores["road"]``), or []."""
        return self.scores.get("road", [])

    @classmethod
    def _from_older(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A table saved with one field per metric (``faithfulness``, ``perturbations``, ``roads``) as ``scores``."""
        if "scores" in d or not any(k in d for k in _FIELDS_BEFORE_THE_REGISTRY):
            return d
        d = dict(d)
        d["scores"] = {metric: d.pop(old) for old, metric in _FIELDS_BEFORE_THE_REGISTRY.items() if d.get(old)}
        return d

    def summary(self) -> str:
        made = "; ".join(f"{k}: {v}" for k, v in self.protocols.items())
        return (f"{self.model_name or 'model'}: {counted(len(self.rows), 'method')} x "
                f"{counted(self.n_images, 'image')}" + (f" (protocols {made})" if made else ""))

    def to_rows(self) -> list[dict]:
        """One row per method: its scores, keyed by the columns' names (what the CSV and JSON hold)."""
        return [dict(r) for r in self.rows]

    def readable_rows(self) -> list[dict]:
        """The rows as the app and the report show them (``readable_rows``: labels, not identifiers)."""
        return readable_rows(self.rows)

    @classmethod
    def concat(cls, tables: Sequence["ComparisonTable"]) -> "ComparisonTable":
        """One table of the methods of several tables over the same images (e.g. one method each).

        Args:
            tables: the tables, over the same images.

        Returns:
            The methods of every table, in order, with every metric's results.

        Raises:
            InvalidParameterError: no tables, or tables over different image sets.
        """
        if not tables:
            raise InvalidParameterError("concat needs at least one table.")
        if len({t.n_images for t in tables}) != 1:
            raise InvalidParameterError("Only tables over the same images concatenate.")
        metrics = dict.fromkeys(k for t in tables for k in t.scores)
        return cls(rows=[r for t in tables for r in t.rows], n_images=tables[0].n_images,
                   attributions=[a for t in tables for a in t.attributions], model_name=tables[0].model_name,
                   scores={k: [r for t in tables for r in t.scores.get(k, [])] for k in metrics},
                   protocols=dict(tables[0].protocols))


def compare_methods(m: LoadedModel, images: Images, methods: Sequence[str] | None = None,
                    masks: np.ndarray | None = None, target: Any = None, steps: int = 16, baseline: str = "mean",
                    batch_size: int = 16,
                    progress: ProgressArg = None, method_params: dict[str, dict] | None = None,
                    metrics: Sequence[str] | None = None, labels: np.ndarray | None = None,
                    protocol: str = "vitlens", ordering: str | None = None) -> ComparisonTable:
    """Every method's maps, their faithfulness scores and (with masks) mask metrics, timed.

    Args:
        m: the model.
        images: the images (read once into a list unless a tensor).
        methods: names from ``METHODS``; None for ``default_methods(m)`` (every available method defined for the
            model's kind but scorecam and the named variants).
        masks: [B, h, w] bool object masks of the images, for pointing game and mass in mask (brought
            through the images' own resize and crop, so masks of 64 px scenes serve a 224 px model). With
            masks the table gains pointing_game (share of images whose map's top patch hits the object),
            mass_in_mask (share of a map's non-negative mass on object pixels) and mass_ratio (mass_in_mask
            / the object's share of the image, per image, then averaged: 1 = no better than a uniform map) and
            mask_iou (the mean IoU of the cells above each map's mean with the object: ``masks.segmentation_iou``).
        target: class to explain (one for all, one per image, or None for the predictions), or for a model
            with a text tower a prompt (one for all or one per image): the curves then follow the similarity.
        steps: deletion/insertion steps.
        baseline: what removed patches become in deletion/insertion ("mean" or "blur").
        batch_size: images per step.
        progress: True for one progress bar over the whole table (tqdm's time left; its description names the
            method being computed), or a callable ``f(done, total)``; both count two steps per method and image:
            its map, then its scores.
        method_params: per-method parameters, e.g. ``{"integrated_gradients": {"n_steps": 32}}``.
        metrics: which faithfulness scores, names from ``METRIC_TABLE`` (``Metric.columns`` says each one's
            columns, ``Metric.cost`` its forwards); None for ``metrics.default_metrics()``: "deletion_insertion"
            (deletion_auc, insertion_auc; 2 x (steps + 1) forwards per image) and "perturbation" (Chefer et al.'s
            positive and negative perturbation with ``perturbation_test``'s defaults: chefer_positive_auc,
            chefer_negative_auc; 20 forwards per image); "road" is opt-in (road_morf, road_lerf, the curves'
            means; 18 forwards and 18 sparse solves per image, the solves dominating).
        labels: [B] true classes: the perturbation and ROAD curves are then top-1 accuracy, as in their papers;
            without, the target class's probability. Deletion/insertion always follow the probability.
        protocol: "vitlens" (every metric's token default) or "published" (each metric's paper: petsiuk2018,
            chefer2021, rong2022; ``Metric.published``); the table's ``protocols`` records which.
        ordering: "signed" or "absolute" for every metric; None for each protocol's own ("signed").

    Returns:
        A ``ComparisonTable``: one row per method (its metrics' scores, then ``map_seconds_per_image`` and
            ``total_seconds_per_image``: ``TIME_COLUMNS``), with every method's maps and curves.

    Raises:
        InvalidParameterError: an unknown metric, protocol or ordering.
    """
    chosen = check_metrics(default_metrics() if metrics is None else metrics)
    if protocol not in ("vitlens", "published"):
        raise InvalidParameterError(f"protocol must be 'vitlens' or 'published'; got {protocol!r}.")
    # Quantus's preprocess step, once per comparison: each metric's protocol and ordering
    settings = {mt.name: mt.prepare(protocol, ordering, batch_size=batch_size, steps=steps, baseline=baseline,
                                    labels=labels) for mt in chosen}
    methods = default_methods(m) if methods is None else methods
    images = image_list(images)
    if masks is not None:
        masks = masks_at_input(masks, m.data_config, images)
    rows, attrs = [], []
    scores: dict[str, list] = {mt.name: [] for mt in chosen}
    n = len(images)
    # two steps per image of a method: its map, then its scores (deletion/insertion and perturbation forwards
    # outweigh a quick method's map many times on a large model)
    with Progress(progress, 2 * len(methods) * n, desc="attributions", unit="step") as bar:
        for i, method in enumerate(methods):
            bar.describe(f"attributions: {method}")

            def mapped(done: int, _total: int | None, before: int = 2 * i * n) -> None:  # within this method's maps
                bar.update(before + min(done, n))

            started = time.perf_counter()
            a = attribute(m, images, method=method, target=target, batch_size=batch_size,
                          progress=mapped if progress else None, **(method_params or {}).get(method, {}))
            bar.describe(f"attributions: {method} (scores)")
            row: dict[str, Any] = {"method": method}
            for mt in chosen:  # evaluate the maps, then aggregate them into the row's columns
                result = mt.evaluate(m, images, a, settings[mt.name])
                row.update(mt.columns(result))
                scores[mt.name].append(result)
            if masks is not None:
                s = mask_scores(a.maps, masks).summary()
                row.update({"pointing_game": s["pointing_game"], "mass_in_mask": s["mass_in_mask"],
                            "mass_ratio": s["ratio_mean"], "mask_iou": s["iou"]})
            row["map_seconds_per_image"] = a.seconds_per_image
            row["total_seconds_per_image"] = (time.perf_counter() - started) / max(len(a.maps), 1)
            rows.append(row)
            attrs.append(a)
            bar.update(2 * (i + 1) * n)
    return ComparisonTable(rows=rows, n_images=len(attrs[0].maps) if attrs else 0, attributions=attrs,
                           model_name=m.spec.name, scores=scores,
                           protocols={k: f"{s.protocol}, {s.ordering}" for k, s in settings.items()})


def __getattr__(name: str) -> Any:
    """``METRICS`` and ``DEFAULT_METRICS`` (names before the registry) are read from ``METRIC_TABLE`` at call time.

    Args:
        name: the attribute asked for.

    Returns:
        Its value.

    Raises:
        AttributeError: any other name.
    """
    if name == "METRICS":
        return tuple(METRIC_TABLE)
    if name == "DEFAULT_METRICS":
        return default_metrics()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
