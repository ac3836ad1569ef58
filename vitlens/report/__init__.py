"""Reports: the command line and the offline HTML pages it writes, with the numbers beside them.

- ``cli``: the five commands, ``vitlens report|compare|survey|survey-report|models``;
- ``data``: the result objects behind a report and a comparison (Fig. 11's table and shares);
- ``html``: the pages, each figure built once from the results (the page and ``--png`` share them);
- ``video``: ``report --video`` and ``compare --video``, the views of video models on one clip.

The names below are imported on first use (``vitlens._lazy``), so the command line starts without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exported_names, lazy_names

if TYPE_CHECKING:
    from .data import ComparisonData, ReportData, comparison, comparison_units, layer_table, local_head_share
    from .html import (
        attribution_figures, comparison_figures, comparison_html, model_figures, report_figures, report_html)

__getattr__, __dir__ = lazy_names(__name__, __file__, globals())
__all__ = exported_names(__file__)
