"""Peak memory of attention distance at high resolution: whole maps against query-chunked side capture.

Usage:
    python analyses/highres_memory.py [--model vit_base_patch16_224] [--img-size 768] [--batch 4]
        [--budget-mb 256] [--rows plain inline chunked]

Paper Fig. 7 (right) at the resolutions people analyse today (518-1024 px). Each row runs in its own
process (a fresh interpreter) on one random batch of a random-init model built at ``--img-size``; the
peak is VmHWM above the process's size before the first forward (imports and the model loaded):

- ``plain``: the model's fused forward alone (the floor);
- ``inline``: ``vl.attention_distance`` as the views run it at 224 px (the family's non-fused path:
  every block's whole [B, heads, T, T] map exists at once);
- ``chunked``: ``vl.stream_attention(..., query_rows=...)`` with the rows from ``--budget-mb``
  (``query_rows_for_budget``): the fused forward untouched, the probabilities computed a block of
  queries at a time beside it, the consumer fed row blocks.

The distances of ``inline`` and ``chunked`` are checked equal (to the float32 bound) in the parent.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_row(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import vitlens as vl
    from vitlens.memory import peak_rss_mb
    from vitlens.views.engine import query_rows_for_budget

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = vl.load_model(args.model, pretrained=False, device="cpu", img_size=args.img_size)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(0))
    t = m.spec.num_prefix_tokens + m.spec.grid[0] * m.spec.grid[1]
    before = peak_rss_mb()
    start = time.perf_counter()
    out: dict = {"row": args.child, "tokens": t}
    if args.child == "plain":
        with torch.no_grad():
            m.model(x)
    elif args.child == "inline":
        out["mean_px"] = vl.attention_distance(m, x, batch_size=args.batch).mean_px.tolist()
    else:
        rows = query_rows_for_budget(args.batch, m.spec.num_heads, t, args.budget_mb)
        acc = vl.AttentionDistanceAccumulator.for_model(m.spec)
        vl.stream_attention(m, x, [acc], batch_size=args.batch, query_rows=rows)
        out.update(query_rows=rows, mean_px=acc.result(m.spec).mean_px.tolist())
    out.update(seconds=round(time.perf_counter() - start, 2), peak_above_model_mb=round(peak_rss_mb() - before, 1),
               model_mb=round(before, 1))
    if "mean_px" in out:
        out["mean_px"] = np.round(out["mean_px"], 9).tolist()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--img-size", type=int, default=768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget-mb", type=float, default=256.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", nargs="+", default=["plain", "inline", "chunked"], choices=["plain", "inline", "chunked"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_row(args)))
        return 0
    results = []
    for row in args.rows:
        cmd = [sys.executable, __file__, "--child", row, "--model", args.model, "--img-size", str(args.img_size),
               "--batch", str(args.batch), "--budget-mb", str(args.budget_mb), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            results.append({"row": row, "failed": f"exit {proc.returncode}: {tail[0][:200]}"})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "mean_px"}), flush=True)
    got = {r["row"]: r for r in results if "mean_px" in r}
    if {"inline", "chunked"} <= set(got):
        import numpy as np

        from vitlens.views.distance import FLOAT32_RTOL

        a, b = np.asarray(got["inline"]["mean_px"]), np.asarray(got["chunked"]["mean_px"])
        print(f"inline vs chunked: max relative difference {float(np.max(np.abs(a - b) / a)):.2e} "
              f"(bound 2 x {FLOAT32_RTOL:.1e})")
        assert np.allclose(a, b, rtol=2 * FLOAT32_RTOL, atol=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
