"""``python -m vitlens``: the command line (see ``vitlens.cli``)."""
from .cli import main

raise SystemExit(main())
