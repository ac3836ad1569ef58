"""Issue 35's measurement of attention distance's reduction on one block of query rows: the eager kernel
(``per_query_distance`` with ``VITLENS_COMPILE=0``: the products A x d into a scratch buffer summed over blocks of
``KEY_BLOCK`` keys, then A summed again for the renormalisation) against the compiled one (``vitlens.views.kernels``:
one pass, the same key-block sums, so the same ``FLOAT32_RTOL`` bound), and a plain ``sum`` over the same maps (one
read of them: the floor of any reduction).

    python analyses/distance_kernel.py [--img-size 768] [--batch 4] [--heads 12] [--rows 113] [--reps 9]

Prints the compile time, the largest relative difference between the two kernels (against ``FLOAT32_RTOL``) and,
for interleaved repetitions, each one's milliseconds per block of ``--rows`` queries (median and range). The
default ``--rows`` is the views' block at 768 px, batch 4 (``query_rows_for_budget`` with ``ROW_BLOCK_MB``). Run
it alone.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from vitlens.views import kernels
from vitlens.views.distance import FLOAT32_RTOL, per_query_distance, token_distance_matrix


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--img-size", type=int, default=768)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rows", type=int, default=113, help="queries per block of rows (the views' at 768 px, batch 4)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = args.img_size // args.patch
    n, p = g * g, 1
    gen = torch.Generator().manual_seed(0)
    attn = torch.softmax(3 * torch.randn(args.batch, args.heads, args.rows, n + p, generator=gen), -1)
    d = token_distance_matrix((g, g), (args.patch, args.patch), torch.device("cpu"), queries=slice(0, args.rows)).float()
    workspace: dict = {}

    def run(choice: str) -> torch.Tensor:
        os.environ[kernels.COMPILE_ENV] = choice
        return per_query_distance(attn, d, p, True, workspace)

    t0 = time.perf_counter()
    compiled = run("1")
    compile_s = time.perf_counter() - t0
    if kernels.compile_failure():
        raise SystemExit(f"the kernel did not compile here: {kernels.compile_failure()}")
    eager = run("0")
    rel = float(((compiled - eager).abs() / eager.abs()).max())
    times = []
    for _ in range(args.reps):  # interleaved: every kernel sees the same machine
        times.append((timed(run, "0"), timed(run, "1"), timed(attn.sum, -1)))
    t = np.array(times) * 1e3
    print(f"maps [{args.batch}, {args.heads}, {args.rows}, {n + p}] float32, {args.threads} threads; first compiled call "
          f"(the compile) {compile_s:.1f} s; largest relative difference {rel:.2e} (bound FLOAT32_RTOL {FLOAT32_RTOL:.1e})")
    for name, col in (("eager (two passes + scratch)", t[:, 0]), ("compiled (one pass)", t[:, 1]),
                      ("one read of the maps (sum)", t[:, 2])):
        print(f"{name:30s} median {np.median(col):7.1f} ms  range {col.min():.1f}-{col.max():.1f} ms")
    print(f"ratio compiled / eager per repetition: median {np.median(t[:, 1] / t[:, 0]):.2f} "
          f"(range {np.min(t[:, 1] / t[:, 0]):.2f}-{np.max(t[:, 1] / t[:, 0]):.2f})")


if __name__ == "__main__":
    main()
