"""The perturbation metrics, one registry: ``METRIC_TABLE`` is the one list ``compare_methods``, its
``ComparisonTable``, the report (its columns, its prose and its figures), ``vitlens report --metrics`` and the
app's Attributions view read.

Each ``Metric`` follows the three steps of Quantus's ``Metric`` base (Hedström et al. 2023): ``prepare``
resolves what every method's maps are scored under (the protocol, the ordering, the shared knobs), ``evaluate``
scores one method's maps on the images (a result of per-image curves, the instances), and ``columns``
aggregates that result into the table's numbers for the method's row. ``curves`` says what the result draws
(``figures.metric_figure`` draws any metric from it), ``about`` what its columns mean.

A new metric is its module (a function and its ``Result``) plus one entry here, or ``register_metric`` from
anywhere for a metric of one's own; nothing else names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..images import Images
from ..loading.model import LoadedModel
from ..results import Result
from .deletion import FaithfulnessResult, deletion_insertion
from .methods import AttributionResult
from .perturbation import PerturbationResult, RoadResult, perturbation_test, road
from .protocols import PROTOCOLS, PUBLISHED, Protocol, check_ordering, protocol as get_protocol


@dataclass(frozen=True)
class MetricSettings:
    """What one metric scores every method's maps under, resolved once per comparison (``Metric.prepare``).

    Attributes:
        protocol: the metric's protocol name (``protocols.PROTOCOLS``), e.g. "vitlens" or "chefer2021".
        ordering: "signed" (rank by R) or "absolute" (by |R|).
        batch_size: images per step.
        steps: curve points beyond the first, for a metric with a step count (deletion/insertion).
        baseline: what removed tokens become, for a metric with a baseline ("mean" or "blur").
        labels: [B] true classes (the curves are then accuracy, where the metric supports it), or None.
    """

    protocol: str
    ordering: str
    batch_size: int = 16
    steps: int = 16
    baseline: str = "mean"
    labels: np.ndarray | None = None


@dataclass(frozen=True)
class Curve:
    """One panel of a metric's figure: a curve per image over the share removed.

    Attributes:
        title: the panel's title, with which way is better ("Deletion (lower is more faithful)").
        x: [S] the share of the input removed (or inserted) at each point.
        y: [B, S] the score at each point, one row per image.
    """

    title: str
    x: np.ndarray
    y: np.ndarray


MetricFn = Callable[[LoadedModel, Images, AttributionResult, MetricSettings], Result]


@dataclass(frozen=True)
class Metric:
    """One perturbation metric: how it scores a method's maps, what it adds to the table, what it draws.

    Attributes:
        name: the name ``compare_methods(metrics=...)``, ``vitlens report --metrics`` and the app take.
        evaluate: (model, images, maps, settings) -> the metric's result for one method (per-image curves).
        columns: the aggregate: the result -> the table's columns for the method's row ({column: number}).
        curves: the result -> the panels it draws (``Curve``), for ``figures.metric_figure``.
        about: one sentence on what the columns mean and which way is more faithful (the report and the app
            show it).
        default: scored by ``compare_methods`` (and the report, and the app) unless metrics are chosen.
        published: the protocol of the metric's paper, what ``compare_methods(protocol="published")`` runs
            ("vitlens" when it has none of its own).
        cost: the model forwards (and other work) it takes per image, for the choices' help.
        title: the heading of its figure.
        label: its short name, for a button or a legend ("Perturbation"); ``title`` is the long one.
        column_labels: each of its columns (``columns``' keys) as a person reads it ("positive perturbation
            AUC"; which way is better is ``about``'s); a column without one reads as its name with spaces
            (``column_label``).
    """

    name: str
    evaluate: MetricFn
    columns: Callable[[Any], dict[str, float]]
    curves: Callable[[Any], Sequence[Curve]]
    about: str
    default: bool = False
    published: str = "vitlens"
    cost: str = ""
    title: str = ""
    label: str = ""
    column_labels: dict[str, str] = field(default_factory=dict)

    def prepare(self, protocol: str = "vitlens", ordering: str | None = None, batch_size: int = 16, steps: int = 16,
                baseline: str = "mean", labels: np.ndarray | None = None) -> MetricSettings:
        """The settings every method's maps are scored under (Quantus's preprocess step).

        Args:
            protocol: "vitlens" (the metric's token default) or "published" (its paper's, ``published``).
            ordering: "signed" or "absolute"; None for the protocol's own.
            batch_size: images per step.
            steps: curve points beyond the first, for a metric with a step count.
            baseline: what removed tokens become, for a metric with a baseline.
            labels: [B] true classes, or None.

        Returns:
            The resolved ``MetricSettings``.

        Raises:
            InvalidParameterError: an unknown protocol or ordering.
        """
        if protocol not in ("vitlens", "published"):
            raise InvalidParameterError(f"protocol must be 'vitlens' or 'published'; got {protocol!r}.")
        name = "vitlens" if protocol == "vitlens" else self.published
        ordering = check_ordering(get_protocol(self.name, name).ordering if ordering is None else ordering)
        return MetricSettings(protocol=name, ordering=ordering, batch_size=batch_size, steps=steps, baseline=baseline,
                              labels=labels)


def _deletion_insertion(m: LoadedModel, images: Images, a: AttributionResult, s: MetricSettings) -> FaithfulnessResult:
    return deletion_insertion(m, images, a, steps=s.steps, baseline=s.baseline, batch_size=s.batch_size,
                              protocol=s.protocol, ordering=s.ordering)


def _perturbation(m: LoadedModel, images: Images, a: AttributionResult, s: MetricSettings) -> PerturbationResult:
    return perturbation_test(m, images, a, labels=s.labels, batch_size=s.batch_size, protocol=s.protocol,
                             ordering=s.ordering)


def _road(m: LoadedModel, images: Images, a: AttributionResult, s: MetricSettings) -> RoadResult:
    return road(m, images, a, labels=s.labels, batch_size=s.batch_size, protocol=s.protocol, ordering=s.ordering)


METRIC_TABLE: dict[str, Metric] = {mt.name: mt for mt in (
    Metric("deletion_insertion", _deletion_insertion,
           lambda r: {"deletion_auc": float(r.deletion_auc.mean()), "insertion_auc": float(r.insertion_auc.mean())},
           lambda r: (Curve("Deletion (lower is more faithful)", r.fractions, r.deletion),
                      Curve("Insertion (higher is more faithful)", r.fractions, r.insertion)),
           "deletion AUC: lower is more faithful, insertion AUC: higher is more faithful (the target's probability "
           "as the tokens the map ranks first are removed / put back)",
           default=True, published=PUBLISHED["deletion_insertion"], cost="2 x (steps + 1) forwards per image",
           title="Deletion and insertion", label="Deletion/insertion",
           column_labels={"deletion_auc": "deletion AUC", "insertion_auc": "insertion AUC"}),
    Metric("perturbation", _perturbation,
           lambda r: {"chefer_positive_auc": float(r.positive_auc.mean()),
                      "chefer_negative_auc": float(r.negative_auc.mean())},
           lambda r: (Curve("Positive perturbation (lower is better)", r.fractions, r.positive),
                      Curve("Negative perturbation (higher is better)", r.fractions, r.negative)),
           "Chefer et al.'s positive / negative perturbation AUC (top-1 accuracy with labels, else the target's "
           "probability, over 0-90% of tokens removed to black): lower / higher is more faithful",
           default=True, published=PUBLISHED["perturbation"], cost="20 forwards per image",
           title="Positive and negative perturbation", label="Perturbation",
           column_labels={"chefer_positive_auc": "positive perturbation AUC",
                          "chefer_negative_auc": "negative perturbation AUC"}),
    Metric("road", _road,
           lambda r: dict(zip(("road_morf", "road_lerf"), r.means())),
           lambda r: (Curve("ROAD MoRF (lower is better)", r.percentages, r.morf),
                      Curve("ROAD LeRF (higher is better)", r.percentages, r.lerf)),
           "ROAD's mean MoRF / LeRF (removed tokens filled by noisy linear imputation): lower / higher is more "
           "faithful", published=PUBLISHED["road"], cost="18 forwards and 18 sparse solves per image",
           title="ROAD", label="ROAD",
           column_labels={"road_morf": "ROAD MoRF", "road_lerf": "ROAD LeRF"}),
)}


def register_metric(metric: Metric, protocols: Sequence[Protocol] = ()) -> Metric:
    """Add ``metric`` to ``METRIC_TABLE``; ``compare_methods``, the report, the CLI and the app read it from there.

    Args:
        metric: the metric's entry.
        protocols: its named protocols (``protocols.Protocol`` with ``metric=metric.name``); a "vitlens" one on
            whole tokens, signed, is added when none is given, and ``metric.published`` must be one of them.

    Returns:
        ``metric``.

    Raises:
        InvalidParameterError: the name is taken, a protocol names another metric, or ``published`` is not one of
            its protocols.
    """
    if metric.name in METRIC_TABLE:
        raise InvalidParameterError(f"a perturbation metric named {metric.name!r} exists already.")
    wrong = [p.name for p in protocols if p.metric != metric.name]
    if wrong:
        raise InvalidParameterError(f"protocols {', '.join(wrong)} are not for {metric.name!r}; give Protocol("
                                    f"{metric.name!r}, ...).")
    named = {p.name: p for p in protocols}
    named.setdefault("vitlens", Protocol(metric.name, "vitlens", "token", "signed", f"vitlens: {metric.name}"))
    if metric.published not in named:
        raise InvalidParameterError(f"{metric.name}'s published protocol {metric.published!r} is not one of its "
                                    f"protocols ({', '.join(named)}).")
    PROTOCOLS.update({(metric.name, k): p for k, p in named.items()})
    METRIC_TABLE[metric.name] = metric
    return metric


def column_label(column: str) -> str:
    """How a person reads a metric's column: the ``column_labels`` of the entry that makes it, else the name with
    spaces ("mass ratio").

    Args:
        column: a column of a ``ComparisonTable`` row.

    Returns:
        The label.
    """
    for mt in METRIC_TABLE.values():
        if column in mt.column_labels:
            return mt.column_labels[column]
    return column.replace("_", " ")


def metric_label(metric: str) -> str:
    """A metric's short name (``Metric.label``, else its title, else its name with spaces).

    Args:
        metric: a name in ``METRIC_TABLE``.

    Returns:
        The label.
    """
    mt = METRIC_TABLE.get(metric)
    return (mt.label or mt.title) if mt is not None and (mt.label or mt.title) else metric.replace("_", " ")


def metric_names() -> tuple[str, ...]:
    """Every registered metric's name, in the table's order (what ``compare_methods`` accepts).

    Returns:
        The names.
    """
    return tuple(METRIC_TABLE)


def default_metrics() -> tuple[str, ...]:
    """The metrics ``compare_methods`` scores unless told (``Metric.default``).

    Returns:
        The names.
    """
    return tuple(name for name, mt in METRIC_TABLE.items() if mt.default)


def check_metrics(metrics: Sequence[str]) -> list[Metric]:
    """The entries of ``metrics``, in the order given.

    Args:
        metrics: metric names.

    Returns:
        Their ``Metric`` entries.

    Raises:
        InvalidParameterError: a name that is not in ``METRIC_TABLE``.
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    bad = [k for k in metrics if k not in METRIC_TABLE]
    if bad:
        raise InvalidParameterError(f"metrics must be names from {', '.join(METRIC_TABLE)}; "
                                    f"got {', '.join(map(repr, bad))}.")
    return [METRIC_TABLE[k] for k in dict.fromkeys(metrics)]
