"""Methods x metrics for the embedded pair on held-out reference scenes (issue: attributions).

Usage:
    python analyses/attribution_table.py [--n 200] [--models ref-vit ref-hybrid] [--out attribution_table.json]

For every method of ``vitlens.attribution``: deletion and insertion AUC of the target-class
probability (16 steps, mean baseline), pointing game and map mass inside the object mask, and
seconds per image on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vitlens as vl  # noqa: E402
from vitlens.attribution import compare_methods  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    data = generate(args.n, seed=HELD_OUT_SEED)
    tables = {}
    for name in args.models:
        m = vl.load_model(name)
        table = compare_methods(m, list(data.images), masks=data.masks, batch_size=50)
        tables[name] = table.rows
        print(f"\n{name} ({args.n} held-out scenes)")
        print(f"{'method':22s} {'deletion':>9s} {'insertion':>9s} {'pointing':>9s} {'in mask':>8s} {'ratio':>6s} {'s/img':>7s}")
        for r in table.rows:
            print(f"{r['method']:22s} {r['deletion_auc']:9.3f} {r['insertion_auc']:9.3f} {r['pointing_game']:9.3f} "
                  f"{r['mass_in_mask']:8.3f} {r['mass_ratio']:6.2f} {r['seconds_per_image']:7.4f}")
    if args.out:
        args.out.write_text(json.dumps(tables, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
