"""The command line moved to its own package, ``vitlens.cli`` (issue 61): this module keeps old imports working, with
one ``FutureWarning`` naming the new place."""
from __future__ import annotations

import warnings

from ..cli import CliError, build_parser, main, report_methods, write_png

warnings.warn("vitlens.report.cli moved to vitlens.cli: import from vitlens.cli (from vitlens.cli import main).",
              FutureWarning, stacklevel=2)

__all__ = ["CliError", "build_parser", "main", "report_methods", "write_png"]
