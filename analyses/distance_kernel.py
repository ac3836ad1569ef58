"""Issue 35's experiment on attention distance's reduction: the landed kernel (``per_query_distance``: the products
A x d into a scratch buffer summed over blocks of ``KEY_BLOCK`` keys, then A summed again for the renormalisation: two
passes over the maps and one over the scratch) against the same sums fused into one pass by ``torch.compile``
(the float32 partial sums over the same key blocks, added in float64: the ``FLOAT32_RTOL`` bound holds for both).

    python analyses/distance_kernel.py [--img-size 768] [--batch 4] [--heads 12] [--rows 256] [--reps 9]

Prints the compile time, the largest relative difference between the two (against ``FLOAT32_RTOL``) and, for
interleaved repetitions, each kernel's seconds per block of ``--rows`` queries (median and range). Run it alone.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from vitlens.views.distance import FLOAT32_RTOL, KEY_BLOCK, per_query_distance, token_distance_matrix


def fused_sums(rows: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[BH, q] sum_k A d / sum_k A over the patch keys of ``rows`` [BH, q, N] (N a multiple of ``KEY_BLOCK``), the
    partial sums over blocks of ``KEY_BLOCK`` keys in float32 and added in float64 (one pass under compile)."""
    x = rows.unflatten(-1, (rows.shape[-1] // KEY_BLOCK, KEY_BLOCK))
    num = (x * d.unflatten(-1, (d.shape[-1] // KEY_BLOCK, KEY_BLOCK))).sum(-1).sum(-1, dtype=torch.float64)
    return num / x.sum(-1).sum(-1, dtype=torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--img-size", type=int, default=768)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rows", type=int, default=256, help="queries per block of rows (the row-block capture's)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = args.img_size // args.patch
    n, p = g * g, 1
    if n % KEY_BLOCK:
        raise SystemExit(f"{n} patch keys are not a multiple of KEY_BLOCK={KEY_BLOCK}; pick another --img-size")
    gen = torch.Generator().manual_seed(0)
    attn = torch.softmax(3 * torch.randn(args.batch, args.heads, args.rows, n + p, generator=gen), -1)
    d = token_distance_matrix((g, g), (args.patch, args.patch), torch.device("cpu"), queries=slice(0, args.rows)).float()
    compiled = torch.compile(fused_sums, dynamic=False)
    rows = attn.reshape(-1, args.rows, n + p)[..., p:]
    t0 = time.perf_counter()
    fused = compiled(rows, d)
    compile_s = time.perf_counter() - t0
    workspace: dict = {}
    landed = per_query_distance(attn, d, p, True, workspace)  # [q, B, H]
    fused = fused.transpose(0, 1).reshape(args.rows, args.batch, args.heads)
    rel = float(((landed - fused).abs() / landed.abs()).max())
    times = []
    for _ in range(args.reps):  # interleaved: the two kernels see the same machine
        t0 = time.perf_counter()
        per_query_distance(attn, d, p, True, workspace)
        t1 = time.perf_counter()
        compiled(rows, d)
        t2 = time.perf_counter()
        times.append((t1 - t0, t2 - t1))
    t = np.array(times)
    print(f"maps [{args.batch}, {args.heads}, {args.rows}, {n + p}] float32, {args.threads} threads; compile "
          f"{compile_s:.1f} s; largest relative difference {rel:.2e} (bound FLOAT32_RTOL {FLOAT32_RTOL:.1e})")
    for name, col in (("landed (two passes + scratch)", t[:, 0]), ("torch.compile (one pass)", t[:, 1])):
        print(f"{name:32s} median {np.median(col) * 1e3:7.1f} ms  range {col.min() * 1e3:.1f}-{col.max() * 1e3:.1f} ms")
    print(f"ratio compiled / landed per repetition: median {np.median(t[:, 1] / t[:, 0]):.2f} "
          f"(range {np.min(t[:, 1] / t[:, 0]):.2f}-{np.max(t[:, 1] / t[:, 0]):.2f})")


if __name__ == "__main__":
    main()
