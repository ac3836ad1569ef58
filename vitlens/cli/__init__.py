"""The command line, ``vitlens report|compare|models|survey|survey-report`` (also ``python -m vitlens``), above the
library's public face (it imports the library inside each command):

report        — every view (paper Fig. 6, 7) for one or more models, one offline HTML file plus data.
compare       — Fig. 11: attention distance per head by layer for several models in one chart.
(both take ``--video CLIP`` for video models: the views in space and time of one clip, ``report.video``)
models        — the presets and the model families vitlens reads.
survey        — a model zoo x an image set on Ray, resumable, one tidy table (Fig. 11 across a zoo).
survey-report — one offline HTML page of a survey folder.

Bad input ends with a one-line message on stderr and exit code 2 (1 for unexpected errors), no traceback unless
--debug; a bad argument is refused before torch or any analysis module is imported (the parser reads the registries
behind ``--methods``, ``--metrics`` and ``--views`` only when one of them is given or help is shown). Every model is
loaded (and so checked) before the first is analysed. Output files are written atomically, only once everything
succeeded: a failure never leaves half a report or replaces a good one.

- ``main``: the entry point; ``parser``: the commands and options; ``common``: what every command shares;
  ``report``: report, compare, models; ``survey``: survey, survey-report.
"""
from __future__ import annotations

from .common import CliError, write_png
from .main import main
from .parser import build_parser
from .report import report_methods


__all__ = ["CliError", "build_parser", "main", "report_methods", "write_png"]
