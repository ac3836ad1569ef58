"""The report's SAE section (issue 66; ``vitlens report --sae FILE`` or ``--train-sae``; docs/definitions.md, "SAE
feature views", "SAE feature interventions"): a sparse autoencoder's features over the report's images (their
frequencies, the most frequent ones' top images, statistics and writer heads) and the most frequent feature ablated
on its top images (the logits' and the rollout's change).

The numbers travel in the report's data file as the results themselves (``ReportData.sae``: per model a dict of a
``SAEFeaturesResult``, a ``SAEInterventionResult``, the features shown and the display images their figures overlay,
or None where the SAE does not fit the model); this module computes them, draws their figures and lays out their HTML.
"""
from __future__ import annotations

import html
from typing import Any, Callable

import numpy as np
import plotly.graph_objects as go

from .. import figures
from ..errors import InvalidParameterError, UnsupportedModelError
from ..sae.features import sae_features
from ..sae.interventions import sae_intervene

#: features the section shows (the most frequent), and images kept per feature
SHOWN, TOP = 3, 4


def sae_section(m: Any, images: list, sae: Any, labels: np.ndarray | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The section's numbers on ``images``: None, said through ``log``, where the SAE does not fit the model (another
    width or site) or the model gives no logits to edit.

    Args:
        m: a ``LoadedModel``.
        images: the images (anything ``vl.preprocess`` reads).
        sae: a ``SparseAutoencoder``, a ``train_sae`` result or an SAE file's path.
        labels: the images' labels (each feature's mean per class), or None.
        log: where a refusal is said (one line).

    Returns:
        ``{"features", "intervention", "shown" [k], "image_index" [n], "display" uint8 [n, H, W, 3]}`` or None.
    """
    try:
        r = sae_features(m, sae, images, labels=labels, top=TOP)
        shown = [int(f) for f in r.order("frequency")[:SHOWN]]
        picked = sorted({int(i) for f in shown for i in r.top_images[r.row(f)] if i >= 0})
        first = [int(i) for i in r.top_images[r.row(shown[0])] if i >= 0] if shown else []
        edit = sae_intervene(m, sae, [images[i] for i in first], shown[0]) if first else None
    except (InvalidParameterError, UnsupportedModelError) as e:
        if log is not None:
            log(f"{m.spec.name}: no SAE section ({e})")
        return None
    display = np.stack(m.display([images[i] for i in picked])) if picked else np.zeros((0, 1, 1, 3), np.uint8)
    return {"features": r, "intervention": edit, "shown": np.asarray(shown, dtype=np.int64),
            "image_index": np.asarray(picked, dtype=np.int64), "display": display}


def sae_figures(section: dict[str, Any]) -> dict[str, go.Figure]:
    """The frequencies; per shown feature its top images, its statistics and its writers; the ablation."""
    r = section["features"]
    images = {int(i): section["display"][j] for j, i in enumerate(section["image_index"])}
    figs = {"frequency": figures.sae_frequency_figure(r)}
    for f in (int(f) for f in section["shown"]):
        figs[f"top-{f}"] = figures.sae_top_images_figure(r, f, images)
        figs[f"stats-{f}"] = figures.sae_feature_figure(r, f)
        figs[f"writers-{f}"] = figures.sae_writers_figure(r, f)
    edit = section["intervention"]
    if edit is not None:
        top = [images[int(i)] for i in r.top_images[r.row(edit.feature)] if i >= 0]
        figs["intervention"] = figures.sae_intervention_figure(edit, top)
    return figs


def sae_html(section: dict[str, Any], figs: dict[str, go.Figure], table: Callable[[list], str],
             figure: Callable[[go.Figure], str]) -> str:
    """The section: what it is, the features' table, each shown feature's figures and the ablation.

    Args:
        section: ``sae_section``'s numbers.
        figs: ``sae_figures``'s figures.
        table: rows -> an HTML table (the report's own).
        figure: a figure -> its HTML (the report's own).

    Returns:
        The section's HTML.
    """
    r = section["features"]
    rows = [{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}
            for row in r.to_rows() if row["feature"] in set(int(f) for f in section["shown"])]
    parts = ["<h3>Features of the residual stream (sparse autoencoder)</h3>",
             f"<p class='muted'>{html.escape(r.summary())}. Each token of {html.escape(r.site)} written as a few "
             "features (docs/definitions.md, \"SAE feature views\"); the most frequent are shown with their top "
             "images, statistics and the heads that write them against the heads' mean attention distance.</p>",
             figure(figs["frequency"]), table(rows)]
    for f in (int(f) for f in section["shown"]):
        parts += [f"<h4>Feature {f}</h4>", figure(figs[f"top-{f}"]), figure(figs[f"stats-{f}"]),
                  figure(figs[f"writers-{f}"])]
    edit = section["intervention"]
    if edit is not None:
        parts += [f"<p class='muted'>{html.escape(edit.summary())}</p>", figure(figs["intervention"])]
    return "".join(parts)


__all__ = ["SHOWN", "TOP", "sae_figures", "sae_html", "sae_section"]
