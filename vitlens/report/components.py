"""The report's components section (issue 51; ``vitlens report --components``; docs/definitions.md, "Direct
contributions", "The ledger", "Logit lens", "Token norms"): on the first ``--component-images`` images, each
image's predicted-class logit as an exact sum of parts (the layer x head table, the top heads and the ledger that
closes the sum), the logit lens by depth and the token norms by depth.

The numbers travel in the report's data file as the results themselves (``ReportData.components``: per model a
dict of a ``DecompositionResult``, a ``LogitLensResult`` and a ``TokenNormsResult``, or None where the components
refuse the model); this module computes them, draws their figures and lays out their HTML.
"""
from __future__ import annotations

import html
from typing import Any, Callable

import numpy as np
import plotly.graph_objects as go

from .. import figures
from ..components import LEDGER_RTOL, decompose, logit_lens, token_norms
from ..errors import UnsupportedModelError
from ..results import significant

#: the section's three results, by their name in the data file
PARTS = ("decomposition", "logit_lens", "token_norms")


def components_section(m: Any, images: list, log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The section's numbers on ``images`` (each image's predicted class): None, said through ``log``, where the
    components refuse the model (a hierarchical model, a tower without classes).

    Args:
        m: a ``LoadedModel``.
        images: the images (anything ``vl.preprocess`` reads).
        log: where a refusal is said (one line).

    Returns:
        ``{"decomposition": DecompositionResult, "logit_lens": LogitLensResult, "token_norms": TokenNormsResult}``,
            or None.
    """
    try:
        return {"decomposition": decompose(m, images), "logit_lens": logit_lens(m, images),
                "token_norms": token_norms(m, images)}
    except UnsupportedModelError as e:
        if log is not None:
            log(f"{m.spec.name}: no components section ({e})")
        return None


def components_figures(section: dict[str, Any]) -> dict[str, go.Figure]:
    """The layer x head table (mean over the images), the logit lens and the first image's token norms."""
    d = section["decomposition"]
    table = figures.contributions_figure(d, title=f"{d.model_name}: heads' parts of the predicted class's logit, "
                                                  f"mean over {len(d.output)} images (ledger max "
                                                  f"{d.ledger().max():.1e})")
    table.data[0].z = d.head_table(None)
    top = float(np.abs(d.head_table(None)).max()) or 1.0
    table.data[0].update(zmin=-top, zmax=top)
    return {"contributions": table, "logit_lens": figures.logit_lens_figure(section["logit_lens"]),
            "token_norms": figures.token_norms_figure(section["token_norms"])}


def ledger_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per image: the class read, the output, the sum of parts and the ledger."""
    d = section["decomposition"]
    total, ledger = d.total(), d.ledger()
    return [{"image": b, "class": int(d.target[b]), "output": significant(float(d.output[b]), 6),
             "sum of parts": significant(float(total[b]), 6), "ledger": f"{ledger[b]:.1e}"}
            for b in range(len(d.output))]


def parts_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    """Each part summed over its layers, heads and tokens, mean over the images."""
    return [{"part": name, "mean": significant(float(np.asarray(v).reshape(len(v), -1).sum(-1).mean()))}
            for name, v in section["decomposition"].parts().items()]


def components_html(section: dict[str, Any], figs: dict[str, go.Figure], table: Callable[[list], str],
                    figure: Callable[[go.Figure], str]) -> str:
    """The section: what it is, the ledger, the parts, the top heads and the three figures.

    Args:
        section: ``components_section``'s numbers.
        figs: ``components_figures``'s figures.
        table: rows -> an HTML table (the report's own).
        figure: a figure -> its HTML (the report's own).

    Returns:
        The section's HTML.
    """
    d, lens, norms = (section[k] for k in PARTS)
    heads = [{"layer": l + 1, "head": h + 1, "mean part": significant(v)} for l, h, v in d.top_heads(5, None)]
    closes = "closes" if d.closes() else "does NOT close"
    return ("<h3>Components: the output as an exact sum</h3>"
            f"<p class='muted'>Each of {len(d.output)} images' predicted-class logit written as the sum of the "
            "embeddings, each head per source token, each MLP and the biases, the final norm's scale held at the "
            "forward's value (docs/definitions.md, \"Direct contributions\"). The ledger is |output - sum of parts| "
            f"/ scale; it {closes} within {LEDGER_RTOL:g} on every image.</p>"
            + table(ledger_rows(section)) + "<p class='muted'>Parts, mean over the images:</p>"
            + table(parts_rows(section)) + "<p class='muted'>Top heads (mean part over the images):</p>"
            + table(heads) + figure(figs["contributions"])
            + f"<p class='muted'>{html.escape(lens.summary())}</p>" + figure(figs["logit_lens"])
            + f"<p class='muted'>{html.escape(norms.summary())}</p>" + figure(figs["token_norms"]))
