"""Paper Fig. 7 for one model: embedding filters (left), position-embedding similarity (centre)
and mean attention distance by head (right), as one offline HTML file plus its numbers.

Usage:
    python analyses/figure7.py [--model ref-vit] [--images DIR|GLOB | --samples] [--n-images 128]
        [--out figure7.html] [--random-init] [--device cuda]

The paper's own model for the left and centre panels is ViT-L/32
(``vit_large_patch32_384.orig_in21k_ft_in1k``) and ViT-L/16 for the right; offline, the embedded
``ref-vit`` stands in. This is ``vitlens report`` for a single model; see ``vitlens report --help``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vitlens.cli import main as cli_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in args:
        args = ["--model", "ref-vit", *args]
    if "--out" not in args:
        args += ["--out", "figure7.html"]
    return cli_main(["report", *args])


if __name__ == "__main__":
    raise SystemExit(main())
