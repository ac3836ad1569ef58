"""The GPU table of the performance page: throughput of the views against a plain fused forward, per input size
and precision, at the largest batch that fits, with the peak from ``torch.cuda.max_memory_allocated``.

Usage (one prepared script; a few minutes on one GPU):
    python analyses/gpu_table.py [--device cuda] [--model vit_base_patch16_224] [--dtypes float32 bfloat16]
        [--sizes 224:256 768:64 1024:32] [--reps 5] [--json gpu_table.json]

For every size and dtype, ``analyses/bench.py``'s speed rows run in their own process (plain fused forward,
``vl.analyze(views=("distance", "rollout"))``, distance alone and the plain forward again for the noise, interleaved
in each repetition): first at the batch given, and, if that runs out of memory, at half of it, until one fits
(the batch reported is the one that ran). At the first size, a second process also times the peers at that batch
(timm's AttentionExtract + torch, and the per-image hook loop), so the table gives vitlens against the plain
forward (goal: at least 0.9x its throughput at 224 px) and against the per-image loop (goal: at least 10x). In
low precision each cell also gives the views' error against float32 on the same weights and images.

On a machine without a GPU (``--device cpu``, a small ``--model`` and ``--sizes``) the same script is a smoke
run of itself; the table's figures are for CUDA.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().with_name("bench.py")
OOM_WORDS = ("out of memory", "CUDA error: out of memory", "OutOfMemoryError")


def run_speed(device: str, model: str, dtype: str, img: int, batch: int, reps: int, peers: bool) -> dict | None:
    """One ``bench.py`` speed run in its own process; None when it ran out of memory.

    Args:
        device: "cuda" (or "cpu" for a smoke run).
        model: a timm architecture name (random init).
        dtype: "float32", "bfloat16" or "float16".
        img: the input size in pixels (square).
        batch: images per forward.
        reps: interleaved repetitions.
        peers: also time the peers (AttentionExtract + torch, the per-image loop) and check their numbers.

    Returns:
        The speed section of bench.py's JSON, or None for an out-of-memory run.

    Raises:
        RuntimeError: the run failed for another reason (its last lines of output).
    """
    rows = [] if peers else ["--rows", "distance_rollout", "distance"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speed.json"
        proc = subprocess.run([sys.executable, str(BENCH), "--device", device, "--model", model, "--dtype", dtype,
                               "--img-size", str(img), "--batch", str(batch), "--reps", str(reps), "--skip-memory",
                               "--loop-images", "8", *rows, "--json", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            text = proc.stdout + proc.stderr
            if any(word in text for word in OOM_WORDS):
                return None
            raise RuntimeError(f"bench.py failed at {img} px, batch {batch}, {dtype}:\n" + "\n".join(
                text.strip().splitlines()[-15:]))
        return json.loads(out.read_text())["speed"]


def largest_fitting(args: argparse.Namespace, dtype: str, img: int, batch: int) -> tuple[int, dict]:
    """Halve the batch from ``batch`` until the rows run; returns (batch, speed result)."""
    while batch >= 1:
        result = run_speed(args.device, args.model, dtype, img, batch, args.reps, peers=False)
        if result is not None:
            return batch, result
        print(f"  {img} px {dtype}: batch {batch} ran out of memory; trying {batch // 2}", file=sys.stderr)
        batch //= 2
    raise RuntimeError(f"{img} px {dtype}: not even one image fits")


def cell(size: int, dtype: str, batch: int, speed: dict, peer: dict | None) -> dict[str, Any]:
    """One row of the table from a speed result (and the peers' run at the first size)."""
    sec, ratios = speed["seconds"], speed["ratios"]
    row: dict[str, Any] = {
        "img": size, "dtype": dtype, "batch": batch,
        "plain_img_per_s": round(batch / sec["plain_forward"], 1),
        "distance_rollout_img_per_s": round(batch / sec["distance_rollout"], 1),
        "throughput_vs_plain": round(1 / ratios["distance_rollout / plain forward"], 3),
        "spread_of_time_ratio": speed["ratio_spread"]["distance_rollout / plain forward"],
        "noise_plain_again": speed["noise"]["plain again / plain forward"],
        "distance_alone_time_ratio": ratios["distance / plain forward"],
        "peak_mb": speed.get("peak_cuda_mb"),
        "low_precision_error": speed.get(f"{dtype}_vs_float32"),
    }
    if peer is not None:
        pr = peer["ratios"]
        row["attention_extract_time_ratio"] = pr["(a) AttentionExtract + torch / plain forward"]
        row["per_image_loop_vs_vitlens"] = pr["(b) per-image loop / vitlens, per image"]
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the table and print it as Markdown (and JSON with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--sizes", nargs="*", default=["224:256", "768:64", "1024:32"],
                   help="PX:BATCH, the batch to start from (halved until it fits)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for i, spec in enumerate(args.sizes):
        size, start = (int(v) for v in spec.split(":"))
        for dtype in args.dtypes:
            batch, speed = largest_fitting(args, dtype, size, start)
            peer = run_speed(args.device, args.model, dtype, size, batch, args.reps, peers=True) if i == 0 else None
            rows.append(cell(size, dtype, batch, speed, peer))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"\n{args.model} on {args.device}; time ratios are medians of {args.reps} interleaved repetitions\n")
    print("| px | dtype | batch | plain img/s | distance+rollout img/s | throughput vs plain | time ratio spread "
          "| noise | peak MB | (a) AttentionExtract / plain | (b) loop / vitlens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["spread_of_time_ratio"]
        print(f"| {r['img']} | {r['dtype']} | {r['batch']} | {r['plain_img_per_s']} | {r['distance_rollout_img_per_s']}"
              f" | {r['throughput_vs_plain']:.3f} | {lo:.2f}-{hi:.2f} | {r['noise_plain_again']:.3f} | "
              f"{r['peak_mb'] if r['peak_mb'] is not None else '-'} | {r.get('attention_extract_time_ratio', '-')} | "
              f"{r.get('per_image_loop_vs_vitlens', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
