"""Issue 35's measurement of vitlens's native CPU kernels (``vitlens.core.native``) on one block of query rows,
each against the eager code it replaces (``VITLENS_COMPILE=0``), interleaved:

- the block's softmax with the views' taps (attention distance's key-block sums, rollout's head mean) in one pass,
  against ``torch.softmax`` then distance's eager sums then ``torch.mean`` over heads;
- distance's sums on given maps (``per_query_distance``), native against eager;
- one float64 step of rollout's chain (``rollout_row`` of one map), native against eager.

    python analyses/native_kernels.py [--img-size 768] [--batch 4] [--heads 12] [--rows 113] [--reps 9]

Prints the first call's time (the build, when this machine has none in its cache), the largest differences
between native and eager (against ``FLOAT32_RTOL`` for the distance) and each row's milliseconds (median and
range). The default ``--rows`` is the views' block at 768 px, batch 4 (``query_rows_for_budget`` with
``ROW_BLOCK_MB``). Run it alone.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import numpy as np
import torch

from vitlens.core import native
from vitlens.views.distance import (FLOAT32_RTOL, KEY_BLOCK, distance_from_sums, per_query_distance,
                                    token_distance_matrix)
from vitlens.views.rollout_math import rollout_row


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
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
    n, p, b, h, r = g * g, 1, args.batch, args.heads, args.rows
    gen = torch.Generator().manual_seed(0)
    scores = 3 * torch.randn(b, h, r, n + p, generator=gen)
    d = token_distance_matrix((g, g), (args.patch, args.patch), torch.device("cpu"), queries=slice(0, r - p)).float()
    block, workspace = scores.clone(), {}
    fused = torch.rand(b, n + p, n + p, generator=gen)
    fused /= fused.sum(-1, keepdim=True)
    v = torch.rand(b, n + p, dtype=torch.float64, generator=gen)
    taps = native.SoftmaxTaps(distances=d.contiguous(), first=p, prefix=p, key_block=KEY_BLOCK,
                              sums=torch.empty(2, b * h, r - p, dtype=torch.float64), mean=torch.empty(b, r, n + p))
    mean = torch.empty(b, r, n + p)

    def choose(choice: str) -> None:
        os.environ[native.COMPILE_ENV] = choice

    def eager_pass() -> torch.Tensor:
        block.copy_(scores)
        torch.softmax(block, -1, out=block)
        out = per_query_distance(block[:, :, p:], d, p, True, workspace)
        torch.mean(block, 1, out=mean)
        return out

    def native_pass() -> torch.Tensor:
        block.copy_(scores)
        taps.filled = False
        if not native.softmax_taps(block, taps):
            raise SystemExit(f"the native kernels are not available here: {native.compile_failure()}")
        return distance_from_sums(taps.sums, True, r - p, b, h)

    choose("1")
    t0 = time.perf_counter()
    native_pass()
    first_s = time.perf_counter() - t0
    got = native_pass()
    native_mean = taps.mean.clone()
    choose("0")
    want = eager_pass()
    rel = float(((got - want).abs() / want.abs()).max())
    mean_diff = float((native_mean - mean).abs().max())
    probs = block.clone()
    choose("1")
    chain_native = rollout_row([fused], p, True, v)
    choose("0")
    chain_rel = float(((chain_native - rollout_row([fused], p, True, v)).abs() / chain_native.abs()).max())
    rows = {"softmax + views, eager": ("0", eager_pass), "softmax + views, native (one pass)": ("1", native_pass),
            "softmax alone (torch)": ("0", lambda: torch.softmax(block.copy_(scores), -1, out=block)),
            "distance sums on maps, eager": ("0", lambda: per_query_distance(probs[:, :, p:], d, p, True, workspace)),
            "distance sums on maps, native": ("1", lambda: per_query_distance(probs[:, :, p:], d, p, True, workspace)),
            "rollout chain step, eager": ("0", lambda: rollout_row([fused], p, True, v)),
            "rollout chain step, native": ("1", lambda: rollout_row([fused], p, True, v))}
    times = {name: [] for name in rows}
    for _ in range(args.reps):  # interleaved: every row sees the same machine
        for name, (choice, fn) in rows.items():
            choose(choice)
            times[name].append(timed(fn) * 1e3)
    print(f"block [{b}, {h}, {r}, {n + p}] float32, {args.threads} threads; first native call {first_s:.1f} s "
          f"(a build when this machine's cache has none); distance: largest relative difference {rel:.2e} (bound "
          f"FLOAT32_RTOL {FLOAT32_RTOL:.1e}); head mean: largest difference {mean_diff:.1e}; chain step: largest "
          f"relative difference {chain_rel:.1e}")
    for name, ms in times.items():
        print(f"{name:36s} median {np.median(ms):7.1f} ms  range {min(ms):.1f}-{max(ms):.1f} ms")


if __name__ == "__main__":
    main()
