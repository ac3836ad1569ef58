"""A finished survey folder as the library hands it out: ``SurveyResult`` (the table, the manifest, the failed and
damaged models, one model's attention distance merged from its shards) and ``load_survey``."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidParameterError
from ..views.distance import AttentionDistanceAccumulator, AttentionDistanceResult
from ..views.windowed import WindowedDistanceAccumulator, WindowedDistanceResult
from .entries import source_count, weights_of
from .shard_store import DamagedSurveyWarning, SurveyStore
from .sources import ImageSource
from .table import _split_weights, read_table, table_row_bound


def distance_result(states: dict[str, dict[str, Any]], spec: dict[str, Any], name: str,
                    renormalize: bool = True) -> AttentionDistanceResult | WindowedDistanceResult | None:
    """The merged attention-distance state as the same result ``vl.attention_distance`` returns."""
    d = states.get("distance")
    if d is not None and "window_uniform_px" in d:  # a hierarchical model's: per block and stage in pixels
        return WindowedDistanceAccumulator.from_state(d).result(name) if int(np.asarray(d["n"])) else None
    if d is None or int(np.min(d["counts"])) == 0:
        return None
    return AttentionDistanceAccumulator.from_state(d, tuple(spec["stride_px"]), int(spec.get("num_prefix_tokens", 0)),
                                                   renormalize).result(name)


@dataclass
class SurveyResult:
    """A finished (or partly finished) survey: the tidy table and the manifest.

    ``table`` is a pandas DataFrame with one row per (model, weights, layer, head, metric[, class]);
    ``manifest`` says which models were surveyed, with their spec, status and failure reason;
    ``failed`` maps the name of each failed model to its reason;
    ``damaged`` maps the label of each finished model with damaged shard files to {shard: what is
    wrong} (the table was written from them before the damage; a rerun recomputes them).
    """

    path: Path
    table: Any
    manifest: dict[str, Any]
    failed: dict[str, str] = field(default_factory=dict)
    damaged: dict[str, dict[str, str]] = field(default_factory=dict)

    def __repr__(self) -> str:
        models = self.manifest.get("models", {})
        done = sum(m.get("status") == "done" for m in models.values())
        bad = sum(len(v) for v in self.damaged.values())
        return (f"SurveyResult({self.path}: {done}/{len(models)} models done, {len(self.table)} rows, "
                f"{source_count(self.manifest.get('source', {}))} images"
                + (f", {bad} damaged shard{'s' * (bad != 1)}" if bad else "") + ")")

    def _repr_html_(self) -> str:
        import html

        return f"<div><b>{html.escape(repr(self))}</b>{self.table.head(10).to_html()}</div>"

    def models(self) -> list[str]:
        """The finished models, by the names they were surveyed under (their weights are the table's
        ``weights`` column)."""
        return list(dict.fromkeys(m["name"] for m in self.manifest.get("models", {}).values()
                                  if m.get("status") == "done"))

    def _entry(self, model: str, weights: str | None) -> dict[str, Any]:
        entries = [m for m in self.manifest["models"].values()
                   if model in (m["name"], m.get("label")) and (weights is None or weights_of(m) == weights)]
        done = [m for m in entries if m.get("status") == "done"]
        if not done:
            surveyed = ", ".join(f"{m['name']} ({weights_of(m)})" for m in self.manifest["models"].values()
                                 if m.get("status") == "done") or "none"
            which = f"{model!r}" + (f" with {weights} weights" if weights else "")
            raise InvalidParameterError(f"{which} has no finished survey in {self.path} (finished: {surveyed}).")
        if len(done) > 1:
            kinds = ", ".join(repr(weights_of(m)) for m in done)
            raise InvalidParameterError(f"{model!r} was surveyed with several weights ({kinds}): pass weights=.")
        return done[0]

    def distance(self, model: str, weights: str | None = None) -> AttentionDistanceResult | WindowedDistanceResult:
        """One model's attention distance over the whole image set, from its shards (a hierarchical model's per
        block and stage in image pixels, ``WindowedDistanceResult``).

        Args:
            model: the name it was surveyed under (as ``models()`` lists it).
            weights: "pretrained", "random init", ... (the table's ``weights`` column); needed only
                when the folder holds the same model with several kinds of weights.
        """
        entry = self._entry(model, weights)
        store = SurveyStore(self.path)
        store.bind(self.manifest)
        source = ImageSource.from_dict(self.manifest["source"])
        states, _, _ = store.merged(entry["key"], source.shards(self.manifest["settings"]["shard_size"]))
        result = distance_result(states, entry["spec"], entry["name"],
                                 self.manifest["settings"].get("renormalize", True))
        if result is None:
            raise InvalidParameterError(f"The survey of {model!r} has no attention distance.")
        return result


def load_survey(path: str | Path) -> SurveyResult:
    """A survey folder written by ``vl.survey`` / ``vitlens survey``.

    Args:
        path: the survey folder (with ``manifest.json`` and ``table.parquet``).

    Returns:
        A ``SurveyResult``: ``table`` (pandas DataFrame), the manifest, and ``distance(model)`` for one
            model's ``AttentionDistanceResult``. Damaged shards are named, not fatal.

    Raises:
        InvalidParameterError: no survey folder at ``path`` (missing, or no manifest.json).
    """
    import pandas as pd

    store = SurveyStore(path)
    if not Path(path).exists():
        raise InvalidParameterError(f"{path} does not exist; give the folder a survey was written to "
                                    "(vitlens survey --out).")
    manifest = store.manifest()
    if manifest is None:
        raise InvalidParameterError(f"{path} is not a survey folder (no manifest.json); run vitlens survey first.")
    store.bind(manifest)
    table = read_table(Path(path) / "table.parquet", table_row_bound(manifest))
    if "weights" not in table.columns:  # folders written before the weights had their own column
        table = _split_weights(table, manifest)
    if "stage" not in table.columns:  # folders written before hierarchical models had stages
        table["stage"] = pd.Series([pd.NA] * len(table), dtype="Int64", index=table.index)
    failed = {m["name"]: m.get("reason", "") for m in manifest["models"].values() if m.get("status") == "failed"}
    damaged = damaged_shards(store, manifest)
    if damaged:
        warnings.warn(damage_message(Path(path), damaged), DamagedSurveyWarning, stacklevel=2)
    return SurveyResult(path=Path(path), table=table, manifest=manifest, failed=failed, damaged=damaged)


def damaged_shards(store: SurveyStore, manifest: dict[str, Any]) -> dict[str, dict[str, str]]:
    """{model label: {shard: what is wrong}} over the finished models of a folder."""
    try:
        shards = ImageSource.from_dict(manifest["source"]).shards(manifest["settings"]["shard_size"])
    except Exception:  # a source this version cannot rebuild: nothing to check against
        return {}
    out: dict[str, dict[str, str]] = {}
    for entry in manifest.get("models", {}).values():
        if entry.get("status") == "done":
            bad = store.damaged(entry["key"], shards)
            if bad:
                out[entry.get("label", entry["name"])] = bad
    return out


def damage_message(path: Path, damaged: dict[str, dict[str, str]]) -> str:
    """One sentence naming the damaged shards of a folder and what to do."""
    parts = [f"{label}: " + ", ".join(f"{name} ({why})" for name, why in bad.items())
             for label, bad in damaged.items()]
    return (f"{path} has damaged shard files ({'; '.join(parts)}); the table was written before the damage, "
            "but they are not trusted: rerun the same vitlens survey command to set them aside and recompute them.")
