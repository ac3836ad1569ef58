"""Static figure files: one export path for the app's "Figure" downloads and the command line's ``--png``.

A figure is exported with Plotly's own ``"plotly"`` template whatever the running process's default is.
That matters in the app: importing Streamlit sets ``plotly.io.templates.default`` to its ``"streamlit"``
template, whose colours are placeholders for the browser to replace and whose axes have no automargin,
so a figure rendered there by kaleido clips its tick labels and puts the axis titles on them.
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

#: the template of every exported figure (what ``vitlens report --png`` has always rendered with)
EXPORT_TEMPLATE = "plotly"
#: the width of every exported PNG in pixels (its height is the figure's own), and its scale
PNG_WIDTH = 1000
PNG_SCALE = 1


def export_figure(fig: Any) -> go.Figure:
    """A copy of ``fig`` with the export template set (the figure passed in is left as it is)."""
    out = go.Figure(fig)
    out.update_layout(template=pio.templates[EXPORT_TEMPLATE])
    return out


def figure_png(fig: Any, width: int = PNG_WIDTH, scale: float = PNG_SCALE) -> bytes:
    """The figure as PNG bytes through kaleido (needs Chrome or Chromium)."""
    return export_figure(fig).to_image(format="png", width=width, scale=scale)


def figure_html(fig: Any) -> bytes:
    """The figure as one self-contained HTML file (plotly.js inlined; opens without network)."""
    return export_figure(fig).to_html(include_plotlyjs=True, full_html=True).encode()
