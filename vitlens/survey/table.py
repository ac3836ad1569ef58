"""A survey's tidy table, ``OUT/table.parquet``: its rows for one model (``table_rows``), written atomically
(``write_table``) and read back within a row bound the manifest sets, from the Parquet metadata before anything is
decoded (``read_table``, ``table_row_bound``); older tables' model column split into model and weights."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any


from ..errors import InvalidParameterError
from ..results import atomic_write_bytes
from . import stats
from .entries import weights_of
from .reading import RefusedFile, open_regular


def table_rows(name: str, spec: dict[str, Any], states: dict[str, dict[str, Any]], n_images: int,
               classes: list[str], weight_views: dict[str, Any], renormalize: bool = True,
               weights: str = "pretrained") -> list[dict[str, Any]]:
    """The tidy rows of one model: model (the name as given), weights (its kind: "pretrained",
    "random init", "embedded", ...), layer, head, metric, value, n_images, class."""
    rows: list[dict[str, Any]] = []

    def add(metric: str, value: float, n: int, layer: int | None = None, head: int | None = None,
            cls: str | None = None, stage: int | None = None) -> None:
        rows.append({"model": name, "weights": weights, "layer": layer, "head": head, "metric": metric,
                     "value": float(value), "n_images": int(n), "class": cls, "stage": stage})

    for stat in [k for k in stats.survey_views() if k in states]:  # each statistic says its rows, in the list's order
        for row in stats.read_state(stat, states[stat]).table_rows(spec, classes, renormalize):
            add(**row)
    for metric, value in weight_views.items():
        add(metric, value, 0)
    add("images_used", n_images, n_images)
    return rows


def _split_weights(table: Any, manifest: dict[str, Any]) -> Any:
    """An older table, whose model column held "name (random init)": the name, and a weights column."""
    by_label = {m.get("label", m["name"]): (m["name"], weights_of(m)) for m in manifest["models"].values()}
    pairs = [by_label.get(label, (label, "pretrained")) for label in table["model"]]
    table = table.copy()
    table["model"] = [p[0] for p in pairs]
    table.insert(1, "weights", [p[1] for p in pairs])
    table["model"] = table["model"].astype("string")
    table["weights"] = table["weights"].astype("string")
    return table


#: the tidy table's columns; ``stage`` (1-based) is a hierarchical model's stage, empty for a ViT
TABLE_COLUMNS = ["model", "weights", "layer", "head", "metric", "value", "n_images", "class", "stage"]


#: a ceiling on a model's rows per (layer + 1, head + 1, class + 2): the views write at most a few metrics per head
#: and class (the distance view two), so a table holds far fewer
ROWS_PER_HEAD_AND_CLASS = 16


#: rows a table may hold besides its models' (weight views, images_used)
TABLE_ROWS_SLACK = 4096


#: the most of a table.parquet that is read (its bytes; the row bound is checked from its metadata first)
MAX_TABLE_BYTES = 2**30


def table_row_bound(manifest: dict[str, Any]) -> int:
    """The most rows a folder's table can hold, from its manifest: per model surveyed, ``ROWS_PER_HEAD_AND_CLASS``
    for each (layer + 1) x (head + 1) x (class + 2) of its spec, plus ``TABLE_ROWS_SLACK``."""
    classes = len((manifest.get("source") or {}).get("classes") or ())
    bound = TABLE_ROWS_SLACK
    for entry in (manifest.get("models") or {}).values():
        spec = entry.get("spec") if isinstance(entry, dict) else None
        if isinstance(spec, dict):
            try:
                heads = (int(spec.get("num_layers", 0)) + 1) * (int(spec.get("num_heads", 0)) + 1)
            except (TypeError, ValueError):
                continue
            bound += ROWS_PER_HEAD_AND_CLASS * max(heads, 1) * (classes + 2)
    return bound


def read_table(path: Path, max_rows: int) -> Any:
    """A folder's ``table.parquet`` as a DataFrame (an empty one with ``TABLE_COLUMNS`` where there is none): read
    only as a regular file of at most ``MAX_TABLE_BYTES`` whose metadata counts at most ``max_rows`` rows (a small
    file of millions of constant rows is refused before it is decoded, issue 62, item 11).

    Raises:
        InvalidParameterError: not a regular file, too large, more rows than the manifest allows, not Parquet.
    """
    import pandas as pd
    import pyarrow.parquet as pq

    try:
        f = open_regular(path, MAX_TABLE_BYTES)
    except FileNotFoundError:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    except (RefusedFile, OSError) as e:
        raise InvalidParameterError(f"{path} {e}; not read as a survey table. Rerun the same vitlens survey "
                                    "command to write it again.") from e
    with f:
        try:
            rows = pq.ParquetFile(f).metadata.num_rows
            if rows > max_rows:
                raise InvalidParameterError(
                    f"{path} declares {rows:,} rows, more than its manifest's models and classes can have "
                    f"({max_rows:,}); not read. Rerun the same vitlens survey command to write it again.")
            f.seek(0)
            return pd.read_parquet(f)
        except InvalidParameterError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow's errors of a file that is not Parquet, or broken
            raise InvalidParameterError(f"{path} is not a readable survey table ({type(e).__name__}: {e}); rerun "
                                        "the same vitlens survey command to write it again.") from e


def write_table(out: Path, rows: list[dict[str, Any]]) -> None:
    """The tidy table as Parquet (nullable integer layer/head, string class), written atomically."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    frame["layer"] = frame["layer"].astype("Int64")
    frame["head"] = frame["head"].astype("Int64")
    frame["stage"] = frame["stage"].astype("Int64")
    frame["n_images"] = frame["n_images"].astype("int64")
    frame["model"] = frame["model"].astype("string")
    frame["weights"] = frame["weights"].astype("string")
    frame["metric"] = frame["metric"].astype("string")
    frame["class"] = frame["class"].astype("string")
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    atomic_write_bytes(out / "table.parquet", buf.getvalue())
