"""Paper Fig. 11: mean attention distance of a ViT and its R50 hybrid, layer by layer.

Usage:
    python analyses/vit_vs_hybrid.py [--images DIR|GLOB | --samples] [--n-images 128] [--out vit_vs_hybrid.html]
        [--models A B]

Defaults to the paper's timm pair (ViT-B/16 and R50+ViT-B/16, ImageNet-21k) when their weights
are in the local Hugging Face cache or downloadable, and to the embedded pair (ref-vit,
ref-hybrid) otherwise, saying which it used. This is ``vitlens compare``; see its --help.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vitlens.cli import main as cli_main  # noqa: E402

PAPER_PAIR = ("vit_base_patch16_224.orig_in21k", "vit_base_r50_s16_224.orig_in21k")
EMBEDDED_PAIR = ("ref-vit", "ref-hybrid")


def paper_pair_available() -> bool:
    """Whether both checkpoints of the paper's pair can be loaded (cached, or the hub answers)."""
    import timm

    from vitlens.errors import WeightsUnavailableError
    from vitlens.loading.hub import resolve_pretrained_source

    try:
        for name in PAPER_PAIR:
            resolve_pretrained_source(name, timm.models.get_pretrained_cfg(name).to_dict())
    except WeightsUnavailableError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--models" not in args:
        pair = PAPER_PAIR if paper_pair_available() else EMBEDDED_PAIR
        if pair == EMBEDDED_PAIR:
            print("vit_vs_hybrid: the paper's checkpoints are not available offline; comparing the embedded "
                  "pair ref-vit / ref-hybrid instead.", file=sys.stderr)
        args = ["--models", *pair, *args]
    if "--out" not in args:
        args += ["--out", "vit_vs_hybrid.html"]
    return cli_main(["compare", *args])


if __name__ == "__main__":
    raise SystemExit(main())
