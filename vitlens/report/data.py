"""The numbers behind a report and a comparison, as result objects that save and load back.

``comparison`` turns several models' attention distances (paper Fig. 7 right, Fig. 11) into
the comparison the command line, the app and the HTML page all show: the per-layer table and
the share of local heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..kinds import HYBRID, VIT, find_kind, kind_of
from ..results import Result
from ..views.analyze import AnalysisResult
from ..views.distance import LOCAL_OF_UNIFORM, AttentionDistanceResult, local_rule
from ..views.windowed import WindowedDistanceResult
from ..reference import REFERENCE_NAMES


#: a model's curve is "flat" when this share of its heads sits within FLAT_TOLERANCE of the uniform distance
FLAT_SHARE, FLAT_TOLERANCE = 0.9, 0.1


@dataclass(eq=False, repr=False)
class ReportData(Result):
    """The numbers behind a report: one AnalysisResult per model and how they were made."""

    kind = "report"
    models: list[str]
    analyses: list[AnalysisResult]
    image_set: dict
    environment: dict
    timings: dict = field(default_factory=dict)
    command: str = ""
    attributions: list = field(default_factory=list)  # one ComparisonTable (or None) per model
    notes: dict = field(default_factory=dict)  # model name -> a caveat to show (e.g. predictions mean nothing)
    heads: list = field(default_factory=list)  # one HeadImportanceResult (or None) per model, with --heads
    weights: dict = field(default_factory=dict)  # model name -> kind of weights (LoadedModel.weights)
    # one dict of DecompositionResult, LogitLensResult, TokenNormsResult (or None) per model, with --components
    components: list = field(default_factory=list)
    # one dict of SAEFeaturesResult, SAEInterventionResult, the features shown and their display images (or None) per
    # model, with --sae or --train-sae (vitlens.report.sae)
    sae: list = field(default_factory=list)

    def summary(self) -> str:
        return f"{len(self.models)} model(s) ({', '.join(self.models)}) over {self.image_set.get('count', '?')} images"

    def to_rows(self) -> list[dict]:
        """Attention distance of every head of every model, one row each (a video model's in space and time)."""
        found = [(a, a.distance if a.distance is not None else a.others.get("spacetime_distance"))
                 for a in self.analyses]
        return [{"model": a.spec.name, **row} for a, d in found if d is not None for row in d.to_rows()]


@dataclass(eq=False, repr=False)
class ComparisonData(Result):
    """The numbers behind a comparison (Fig. 11): distance per head for each model, per-layer
    min/median/max and the share of local heads in the first layers.

    ``units`` is "px" when all models share an input width, else "width" (fractions of it).
    """

    kind = "comparison"
    models: list[str]
    distances: list[AttentionDistanceResult | WindowedDistanceResult]  # a windowed model: per block and stage
    units: str
    local_threshold: float  # a head is local at or below this multiple of the uniform distance (LOCAL_OF_UNIFORM)
    first_layers: int
    table: list[dict]
    local_share: list[float]
    image_set: dict
    environment: dict
    timings: dict = field(default_factory=dict)
    command: str = ""
    cka: list = field(default_factory=list)  # CKAResult of each further model against the first, with --cka
    weights: list = field(default_factory=list)  # kind of weights of each model (LoadedModel.weights), "" unknown
    kinds: list = field(default_factory=list)  # each model's ModelSpec.kind ("vit" or "hybrid"), "" unknown

    def summary(self) -> str:
        return (f"{' vs '.join(self.models)} over {self.distances[0].n_images if self.distances else 0} images; "
                + self.local_statement())

    def local_statement(self) -> str:
        """The share of local heads in words, with the one definition of a local head (``local_rule``):
        what the command line, the app's Compare view and compare.html all print."""
        shares = ", ".join(f"{n} {100 * s:.0f}%" for n, s in zip(self.models, self.local_share))
        return f"local heads ({local_rule(self.local_threshold)}) in layers 1-{self.first_layers}: {shares}"

    def to_rows(self) -> list[dict]:
        """The per-layer table: model, layer, min, median, max (in ``units``)."""
        return [dict(r) for r in self.table]

    def unit_label(self) -> str:
        """The distances' unit in words: "px", or "× image width" when the models' input widths differ."""
        return "px" if self.units == "px" else "× image width"

    def table_with_units(self) -> Any:
        """The per-layer table as a DataFrame whose distance columns name their unit ("median (px)")."""
        unit = self.unit_label()
        return self.to_pandas().rename(columns={c: f"{c} ({unit})" for c in ("min", "median", "max")})

    def layer1_median_ratio(self) -> float:
        """Second model's layer-1 median distance / the first model's (e.g. hybrid / ViT, Fig. 11)."""
        first = [r["median"] for r in self.table if r["layer"] == 1]
        if len(first) < 2:
            raise InvalidParameterError("The ratio needs two models.")
        return first[1] / first[0]

    def near_uniform_share(self, tolerance: float = FLAT_TOLERANCE) -> list[float]:
        """Per model, the share of heads (all layers) within ``tolerance`` of the distance of uniform
        attention on its grid: near 1 means the curves of Fig. 11 are flat at the dotted line."""
        return [near_uniform_share(d, tolerance) for d in self.distances]

    def reading(self) -> str:
        """One sentence on what the comparison shows (Fig. 11), from the numbers and what is known
        of the models' weights (``weights``; the embedded pair is known by name)."""
        near = self.near_uniform_share()
        if min(near) >= FLAT_SHARE:
            why = why_flat(self.models, self.weights)
            return (f"Flat: at least {FLAT_SHARE:.0%} of every model's heads sit within {FLAT_TOLERANCE:.0%} of the "
                    "uniform-attention distance, "
                    f"so no model has local heads and the paper's contrast cannot show here ({why}"
                    f"{'; ' if why else ''}hub checkpoints show Fig. 11).")
        ratio = self.layer1_median_ratio()
        first, second = self.models[0], self.models[1]
        if 1 / 1.15 < ratio < 1.15:
            return (f"Layer 1 alike: median distance ratio {second} / {first} = {ratio:.2f} "
                    f"(Fig. 11 shows a hybrid well above its ViT){self._window_note()}{self._random_note()}.")
        far, close, x = (1, 0, ratio) if ratio >= 1.15 else (0, 1, 1 / ratio)
        said = f"{self.models[far]}'s layer-1 heads attend {x:.2f}x as far as {self.models[close]}'s (median)"
        # Fig. 11's contrast is a CNN stem's against a patch embedding's (``Kind.stem``)
        kinds = (list(self.kinds) + [""] * 2)[:2]
        stems = [(k.stem if k is not None else "") for k in map(find_kind, kinds)]
        if stems[far] == "cnn" and stems[close] == "patch":  # exactly one hybrid, and it is the far one
            said = f"Fig. 11's contrast: {said}, as when a CNN stem has already done the local work"
        elif stems[far] == "patch" and stems[close] == "cnn":
            said += " (the hybrid attends nearer than the ViT: the reverse of Fig. 11)"
        elif kinds[0] == kinds[1] and stems[0]:
            said += f" (both are {kind_of(kinds[0]).plural}: not Fig. 11's contrast)"
        return said + self._window_note() + self._random_note() + "."

    def layer1_of_uniform(self) -> list[float]:
        """Each model's layer-1 median head as a multiple of the distance of uniform attention over what its heads
        may attend (``of_uniform``: the whole grid for a ViT, each head's window for a windowed model)."""
        return [float(np.nanmedian(d.of_uniform[0])) for d in self.distances]

    def _window_note(self) -> str:
        """Where a model attends within windows, that the distance ratio mostly measures its windows, and the
        layer-1 median heads against the uniform distance over what each may attend ("" when no model is windowed)."""
        windowed = [n for n, d in zip(self.models, self.distances) if isinstance(d, WindowedDistanceResult)]
        if not windowed:
            return ""
        each = ", ".join(f"{n} {r:.2f}x" for n, r in zip(self.models, self.layer1_of_uniform()))
        return (f"; but {_listed(windowed)} attend{'s' if len(windowed) == 1 else ''} within windows, so that ratio "
                "mostly measures the windows. Against uniform attention over what each head may attend (its window, "
                f"or the whole grid), the median layer-1 head sits at {each}")

    def _random_note(self) -> str:
        """What random weights mean for a comparison ("" when no model has them)."""
        random = [n for n, w in zip(self.models, _weights_or_guess(self.models, self.weights)) if w == "random init"]
        if not random:
            return ""
        return (f"; {_listed(random)} {'has' if len(random) == 1 else 'have'} random weights: its distances show the "
                "untrained architecture, not what training learns")


def near_uniform_share(d: AttentionDistanceResult | WindowedDistanceResult,
                       tolerance: float = FLAT_TOLERANCE) -> float:
    """Share of the heads (all layers) whose mean distance is within ``tolerance`` of the distance
    of uniform attention on the model's grid (the dotted line of Fig. 7 right and Fig. 11)."""
    ratio = d.of_uniform  # a windowed model's against each block's window-uniform distance; NaN: a missing head
    return float((np.abs(ratio[~np.isnan(ratio)] - 1) <= tolerance).mean())


def _weights_or_guess(names: Sequence[str], weights: Sequence[str] | None) -> list[str]:
    """The given kind of weights per model; where unknown, "embedded" for the reference names, else ""."""
    given = list(weights or [])
    given += [""] * (len(names) - len(given))
    return [w or ("embedded" if n in REFERENCE_NAMES else "") for n, w in zip(names, given)]


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def why_flat(names: Sequence[str], weights: Sequence[str] | None = None) -> str:
    """Why these models' heads may all sit at the uniform distance, saying only what is true of
    them: embedded models trained briefly on shapes, random weights, or trained weights where a
    flat curve is unusual ("" when nothing is known of any of them)."""
    kinds = _weights_or_guess(names, weights)
    groups: dict[str, list[str]] = {}
    for name, kind in zip(names, kinds):
        groups.setdefault(kind, []).append(name)
    parts = []
    if "embedded" in groups:
        e = groups.pop("embedded")
        parts.append("the embedded pair, trained for minutes on shapes (MODEL_CARD.md), is flat on these images"
                     if len(e) == 2 and set(e) == {"ref-vit", "ref-hybrid"} and len(names) == 2 else
                     f"{_listed(e)} {'is an embedded model' if len(e) == 1 else 'are embedded models'}, trained "
                     "briefly on shapes: MODEL_CARD.md")
    if "random init" in groups:
        r = groups.pop("random init")
        parts.append(f"{_listed(r)} {'has' if len(r) == 1 else 'have'} random weights, whose attention is close to "
                     "uniform")
    groups.pop("", None)
    trained = [n for names_ in groups.values() for n in names_]
    if trained:
        parts.append(f"for the trained weights of {_listed(trained)} a flat curve is unusual: check the images")
    return "; ".join(parts)


def distance_reading(d: AttentionDistanceResult, name: str | None = None, weights: str | None = None) -> str:
    """One sentence on one model's attention distance (Fig. 7 right), from the numbers: flat at
    the uniform-attention distance (and why, as ``ComparisonData.reading`` says it), or how many
    layer-1 heads are local and how the median distance changes with depth. The report page
    shows it under the distance figure; the app's Attention distance view can show it too.

    Args:
        d: the model's attention distance.
        name: the model's name (default ``d.model_name``).
        weights: its kind of weights (``LoadedModel.weights``: "pretrained", "random init",
            "embedded", ...); unknown when None (the embedded pair is known by name).
    """
    name = name or d.model_name or "this model"
    if isinstance(d, WindowedDistanceResult):
        return windowed_distance_reading(d, name, weights)
    near = near_uniform_share(d)
    if near >= FLAT_SHARE:
        why = why_flat([name], [weights or ""])
        tail = ("" if weights in ("pretrained", "checkpoint") else
                "; hub checkpoints show local heads in the first layers")
        return (f"Flat: {100 * near:.0f}% of {name}'s heads sit within 10% of the uniform-attention distance "
                f"({d.uniform_px:.1f} px), so it has no local heads and no rise with depth here (Fig. 7 right)"
                f"{f': {why}' if why else ''}{tail}.")
    widths = d.mean_fraction_of_width
    first, last = float(np.median(widths[0])), float(np.median(widths[-1]))
    local = int(d.local_heads()[0].sum())
    trend = ("rising with depth, as in Fig. 7 (right)" if last > 1.15 * first else
             "falling with depth" if last < first / 1.15 else "about level across depth")
    return (f"{name}: {local} of {widths.shape[1]} layer-1 heads are local ({local_rule()}, "
            f"{d.uniform_px:.1f} px); the median head attends {first:.2f} of the width "
            f"in layer 1 and {last:.2f} in layer {widths.shape[0]}, {trend}.")


def windowed_distance_reading(d: WindowedDistanceResult, name: str | None = None, weights: str | None = None) -> str:
    """One sentence on a windowed, hierarchical model's attention distance: per stage, the median head as a
    multiple of its window's uniform distance and how many heads are local (``LOCAL_OF_UNIFORM`` of the window).

    Args:
        d: the model's windowed attention distance.
        name: the model's name (default ``d.model_name``).
        weights: its kind of weights (``LoadedModel.weights``); random weights are named.

    Returns:
        The sentence.
    """
    name = name or d.model_name or "this model"
    parts = []
    for stage in sorted(set(d.stages.tolist())):
        ratio = d.of_window[d.stages == stage]
        ratio = ratio[~np.isnan(ratio)]
        local = int((ratio <= LOCAL_OF_UNIFORM).sum())
        parts.append(f"stage {stage + 1}: median head {np.median(ratio):.2f}x its window's uniform distance, "
                     f"{local} of {ratio.size} heads local")
    tail = "; random weights: the untrained architecture" if weights == "random init" else ""
    return (f"{name} ({local_rule()} of its window): " + "; ".join(parts) + f"{tail}.")


def comparison_units(distances: Sequence[AttentionDistanceResult | WindowedDistanceResult]) -> str:
    """Pixels when every model sees the same input width, else fractions of the image width.

    Args:
        distances: one attention distance per model.

    Returns:
        "px" or "width".
    """
    return "px" if len({d.image_size[1] for d in distances}) == 1 else "width"


def layer_table(distances: Sequence[AttentionDistanceResult | WindowedDistanceResult], names: Sequence[str],
                units: str) -> list[dict]:
    """Rows of (model, layer (1-based), min, median, max) of the heads' mean distance, in ``units``.

    Args:
        distances: one attention distance per model.
        names: the models' names.
        units: "px" or "width" (``comparison_units``).

    Returns:
        One dict per (model, layer).
    """
    rows = []
    for d, name in zip(distances, names):
        values = d.mean_px if units == "px" else d.mean_fraction_of_width
        for layer, heads in enumerate(values):
            heads = heads[~np.isnan(heads)]  # a windowed model's block has its own number of heads
            rows.append({"model": name, "layer": layer + 1, "min": float(heads.min()),
                         "median": float(np.median(heads)), "max": float(heads.max())})
    return rows


def local_head_share(d: AttentionDistanceResult | WindowedDistanceResult, local_of_uniform: float = LOCAL_OF_UNIFORM,
                     first_layers: int = 4) -> float:
    """Share of heads in the first ``first_layers`` layers that are local (Fig. 7 right): mean distance at
    most ``local_of_uniform`` x the uniform-attention distance, the one rule of
    ``vitlens.views.distance.LOCAL_OF_UNIFORM`` (``AttentionDistanceResult.local_heads``).

    Args:
        d: the attention distances of one model.
        local_of_uniform: a head is local at most this fraction of the uniform-attention distance.
        first_layers: how many of the first layers count.

    Returns:
        The share of local heads in ``[0, 1]``.
    """
    exists = ~np.isnan(d.mean_px[:first_layers])  # a windowed model's blocks differ in their number of heads
    return float(d.local_heads(local_of_uniform)[:first_layers][exists].mean())


def comparison(distances: Sequence[AttentionDistanceResult | WindowedDistanceResult],
               names: Sequence[str] | None = None,
               local_threshold: float = LOCAL_OF_UNIFORM, first_layers: int = 4, image_set: dict | None = None,
               environment: dict | None = None, timings: dict | None = None, command: str = "",
               weights: Sequence[str] | None = None, kinds: Sequence[str] | None = None) -> ComparisonData:
    """Compare the attention distances of several models over the same images (Fig. 11).

    Args:
        distances: one result per model.
        names: model names (default: the results' own).
        local_threshold: a head is local at or below this multiple of the uniform-attention distance on
            its grid (default ``LOCAL_OF_UNIFORM``, the one definition every view uses).
        first_layers: layers counted for the share of local heads.
        image_set: which images (kind, count), stored with the numbers.
        environment: the versions record (``vitlens.environment``).
        timings: seconds per step.
        command: the command line that made it.
        weights: each model's kind of weights (``LoadedModel.weights``), so that ``reading()``
            says what is true of them; unknown when omitted (the embedded pair is known by name).
        kinds: each model's ``ModelSpec.kind`` ("vit" or "hybrid"): the reading names a CNN stem only when
            exactly one model is a hybrid and the other a plain ViT (``Kind.stem``); unknown when omitted (the
            embedded pair is known by name).

    Returns:
        A ``ComparisonData``: the per-layer table (min, median, max of the heads' mean distance) and each
            model's share of local heads, in pixels or fractions of the image width (``comparison_units``).
    """
    distances = list(distances)
    if len(distances) < 2:
        raise InvalidParameterError("A comparison needs at least two models.")
    names = list(names) if names is not None else [d.model_name or f"model {i + 1}" for i, d in enumerate(distances)]
    units = comparison_units(distances)
    return ComparisonData(
        models=names, distances=distances, units=units, local_threshold=local_threshold, first_layers=first_layers,
        table=layer_table(distances, names, units),
        local_share=[local_head_share(d, local_threshold, first_layers) for d in distances],
        image_set=dict(image_set or {}), environment=dict(environment or {}), timings=dict(timings or {}),
        command=command, weights=list(weights or []), kinds=_kinds_or_guess(names, kinds))


def _kinds_or_guess(names: Sequence[str], kinds: Sequence[str] | None) -> list[str]:
    """The given spec kind per model; where unknown, the embedded pair's by name, else ""."""
    known = {"ref-vit": VIT.name, "ref-hybrid": HYBRID.name}
    given = list(kinds or []) + [""] * len(names)
    return [k or known.get(n, "") for n, k in zip(names, given)]


__all__ = ["ComparisonData", "ReportData", "comparison", "comparison_units", "distance_reading", "layer_table",
           "local_head_share", "near_uniform_share", "why_flat"]
