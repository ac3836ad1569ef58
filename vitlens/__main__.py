"""``python -m vitlens``: the command line (see ``vitlens.report.cli``)."""
from .report.cli import main

raise SystemExit(main())
