"""Per-image cost of every attribution method (issue 22's benchmark; ``bench.py --attributions`` runs it).

Usage:
    python analyses/attribution_cost.py [--models ref-vit vit_base_patch16_224] [--batch 16] [--json cost.json]

Each method explains one batch of ``--batch`` images (held-out shapes scenes for the embedded models,
the same scenes resized by the model's own preprocessing for a random-init timm model) after a warm-up
on two images; the figure is wall seconds per image of ``vl.attribute`` on this machine, batched as
the method allows. Methods whose cost grows with the number of tokens or channels (occlusion: one
forward per token; ScoreCAM: one forward per channel) can be skipped per model with ``--skip``: the
default skips them on vit_base, where a batch would take many minutes on a CPU (the printout says so).
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

import torch  # noqa: E402

import vitlens as vl  # noqa: E402
from vitlens.attribution import METHODS  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402

#: per model: methods left out by default, and why
DEFAULT_SKIP = {"vit_base_patch16_224": {
    "occlusion": "one forward per token: 196 / 16 forwards of 16 images per image",
    "scorecam": "one forward per channel: 768 / 64 forwards of 64 masked images per image"}}


def method_costs(name: str, batch: int, skip: dict[str, str]) -> list[dict]:
    """Seconds per image of every method on one model (a row per method)."""
    torch.manual_seed(0)
    m = vl.load_model(name, pretrained=False) if name not in ("ref-vit", "ref-hybrid") else vl.load_model(name)
    images = list(generate(batch, seed=HELD_OUT_SEED).images)
    rows = []
    for method in METHODS:
        if method in skip:
            rows.append({"model": name, "method": method, "seconds_per_image": None, "note": f"not run: {skip[method]}"})
            continue
        try:
            vl.attribute(m, images[:2], method=method, batch_size=batch)  # warm-up
            t0 = time.perf_counter()
            vl.attribute(m, images, method=method, batch_size=batch)
            rows.append({"model": name, "method": method, "seconds_per_image": (time.perf_counter() - t0) / batch,
                         "note": ""})
        except vl.VitlensError as e:  # a method this family does not support says so
            rows.append({"model": name, "method": method, "seconds_per_image": None, "note": e.message_for("cli")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "vit_base_patch16_224"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-skip", action="store_true", help="run every method on every model")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        rows += method_costs(name, args.batch, {} if args.no_skip else DEFAULT_SKIP.get(name, {}))
    print(f"\nseconds per image, batch {args.batch}, {args.threads} threads, {torch.__version__}")
    print(f"{'method':22s} " + " ".join(f"{n:>22s}" for n in args.models))
    for method in METHODS:
        cells = []
        for name in args.models:
            r = next(r for r in rows if r["model"] == name and r["method"] == method)
            cells.append(f"{r['seconds_per_image']:22.4f}" if r["seconds_per_image"] is not None else f"{'—':>22s}")
        print(f"{method:22s} " + " ".join(cells))
    for r in rows:
        if r["note"]:
            print(f"  {r['model']} {r['method']}: {r['note']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
