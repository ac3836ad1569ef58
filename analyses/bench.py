"""Benchmark: what capture + attention distance + rollout cost over a plain timm forward, and
whether attention-distance memory stays flat as the number of images grows.

Usage:
    python analyses/bench.py [--model vit_base_patch16_224] [--batch 32] [--reps 3]
        [--mem-images 64 1024] [--device cpu]

Prints, for one batch of random images on a random-init model:
- the median time of a plain ``model(x)`` and of ``vl.analyze`` (capture + distance + rollout
  from the same single forward, plus the two weight-only views), and their ratio; and the
  ratio of the streaming part alone in both capture modes;
- peak resident memory of a process that runs ``vl.attention_distance`` over N images fed
  batch by batch, for each N in --mem-images.
Targets (issue 2): ratio <= 1.10; peak memory for 1,024 images within 10% of that for 64.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(model: str, batch: int, reps: int, device: str | None) -> dict:
    import torch

    import vitlens as vl

    m = vl.load_model(model, pretrained=False, device=device)
    x = torch.randn(batch, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(0)).to(m.device)

    def plain() -> None:
        with torch.no_grad():
            m.model(x)
        if m.device.type == "cuda":
            torch.cuda.synchronize()

    def analyzed() -> None:
        vl.analyze(m, x, batch_size=batch)
        if m.device.type == "cuda":
            torch.cuda.synchronize()

    def streamed(mode: str) -> None:
        # capture + attention distance + rollout from one forward: analyze without the weight-only views
        consumers = [vl.AttentionDistanceAccumulator.for_model(m.spec), vl.RolloutAccumulator.for_model(m)]
        vl.stream_attention(m, x, consumers, batch_size=batch, capture_mode=mode)
        if m.device.type == "cuda":
            torch.cuda.synchronize()

    t_plain, t_analyze = _timed(plain, reps), _timed(analyzed, reps)
    t_inline, t_side = _timed(lambda: streamed("inline"), reps), _timed(lambda: streamed("side"), reps)
    return {"model": model, "batch": batch, "device": str(m.device), "threads": torch.get_num_threads(),
            "plain_forward_s": round(t_plain, 3), "analyze_s": round(t_analyze, 3),
            "ratio": round(t_analyze / t_plain, 3),
            "stream_inline_ratio": round(t_inline / t_plain, 3), "stream_side_ratio": round(t_side / t_plain, 3)}


def memory_child(model: str, n_images: int, batch: int, device: str | None) -> dict:
    import torch

    import vitlens as vl

    m = vl.load_model(model, pretrained=False, device=device)
    gen = torch.Generator().manual_seed(0)

    def batches():
        for start in range(0, n_images, batch):
            yield torch.randn(min(batch, n_images - start), 3, *m.spec.image_size, generator=gen)

    t0 = time.perf_counter()
    r = vl.attention_distance(m, batches(), batch_size=batch)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"n_images": r.n_images, "peak_rss_mb": round(peak_mb, 1), "seconds": round(time.perf_counter() - t0, 1)}
    if m.device.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mem-images", type=int, nargs="*", default=[64, 1024])
    p.add_argument("--device", default=None)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(memory_child(args.model, args.child, args.batch, args.device)))
        return 0
    if not args.skip_speed:
        s = speed(args.model, args.batch, args.reps, args.device)
        print(f"speed: {json.dumps(s)}")
        print(f"  plain forward {s['plain_forward_s']:.3f} s, analyze {s['analyze_s']:.3f} s, "
              f"ratio {s['ratio']:.3f} (target <= 1.10); capture + distance + rollout alone: "
              f"{s['stream_inline_ratio']:.3f} (inline capture), "
              f"{s['stream_side_ratio']:.3f} (side capture, the views' default: bit-identical logits)")
    peaks = []
    for n in args.mem_images:
        cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--child", str(n)]
        if args.device:
            cmd += ["--device", args.device]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        peaks.append(res["peak_rss_mb"])
        print(f"memory: {json.dumps(res)}")
    if len(peaks) >= 2:
        print(f"  peak RSS {peaks[0]:.0f} MB for {args.mem_images[0]} images vs {peaks[-1]:.0f} MB for "
              f"{args.mem_images[-1]}: {100 * (peaks[-1] / peaks[0] - 1):+.1f}% (target within 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
