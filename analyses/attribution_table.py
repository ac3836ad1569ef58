"""Methods x metrics for the embedded pair on held-out reference scenes (issue: attributions).

Usage:
    python analyses/attribution_table.py [--n 200] [--sanity-n 8] [--models ref-vit ref-hybrid] [--out table.json]
        [--methods rollout gradcam ...] [--metrics deletion_insertion ...]

For every method of ``vitlens.attribution``: deletion and insertion AUC of the target-class
probability (16 steps, mean baseline); Chefer et al. 2021's positive / negative perturbation AUC
(top-1 accuracy against the scenes' labels, tokens removed to black, trapezoid over 0-90%); ROAD's
mean MoRF / LeRF accuracy (noisy linear imputation, 10-90%); pointing game, map mass inside the
object mask and the IoU of the map's segmentation (cells above the map's mean) with the mask; seconds
per image on this machine; and Adebayo et al. 2018's sanity check on the first --sanity-n scenes
(mean Spearman of |maps| and SSIM at full randomisation, and the verdict).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vitlens as vl  # noqa: E402
from vitlens.attribution import METHODS, compare_methods, sanity_table  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402

COLUMNS = (("deletion_auc", "del", "9.3f"), ("insertion_auc", "ins", "9.3f"), ("chefer_positive_auc", "pos", "9.3f"),
           ("chefer_negative_auc", "neg", "9.3f"), ("road_morf", "MoRF", "9.3f"), ("road_lerf", "LeRF", "9.3f"),
           ("pointing_game", "pointing", "9.3f"), ("mass_in_mask", "in mask", "8.3f"), ("mass_ratio", "ratio", "6.2f"),
           ("mask_iou", "IoU", "6.3f"),
           ("sanity_spearman_abs", "rank |r|", "9.3f"), ("sanity_ssim", "SSIM", "6.3f"),
           ("map_seconds_per_image", "map s/img", "9.4f"), ("total_seconds_per_image", "total s/img", "11.4f"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--sanity-n", type=int, default=8, help="scenes for the sanity check (0: none)")
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--methods", nargs="+", default=None, help="methods (default: compare_methods's default)")
    p.add_argument("--metrics", nargs="*", default=["deletion_insertion", "perturbation", "road"],
                   help="faithfulness metrics (none: only the mask scores)")
    args = p.parse_args(argv)
    data = generate(args.n, seed=HELD_OUT_SEED)
    tables = {}
    for name in args.models:
        m = vl.load_model(name)
        t0 = time.perf_counter()
        table = compare_methods(m, list(data.images), methods=args.methods, masks=data.masks, labels=data.labels,
                                batch_size=50, metrics=tuple(args.metrics))
        rows = [dict(r) for r in table.rows]
        t1 = time.perf_counter()
        if args.sanity_n > 0:
            sanity = sanity_table(m, list(data.images[:args.sanity_n]), methods=args.methods or METHODS, batch_size=50)
            for row, s in zip(rows, sanity.to_rows()):
                row.update({"sanity_spearman_abs": s["spearman_abs"], "sanity_ssim": s["ssim"],
                            "sanity_verdict": s["verdict"]})
        tables[name] = rows
        print(f"\n{name} ({args.n} held-out scenes; sanity on {args.sanity_n}; table {t1 - t0:.0f} s, sanity "
              f"{time.perf_counter() - t1:.0f} s)")
        shown = [c for c in COLUMNS if c[0] in rows[0]]
        print(f"{'method':22s} " + " ".join(f"{label:>{int(fmt.split('.')[0])}s}" for _, label, fmt in shown)
              + ("  sanity verdict" if "sanity_verdict" in rows[0] else ""))
        for r in rows:
            print(f"{r['method']:22s} " + " ".join(f"{r[key]:{fmt}}" for key, _, fmt in shown)
                  + (f"  {r['sanity_verdict']}" if "sanity_verdict" in r else ""))
    if args.out:
        args.out.write_text(json.dumps(tables, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
