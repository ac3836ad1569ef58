"""Benchmark: vitlens against what a user would otherwise write, side by side on one model and batch.

Usage:
    python analyses/bench.py [--model vit_base_patch16_224] [--batch 32] [--reps 5] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--loop-images 8] [--mem-images 64 1024] [--skip-memory] [--json out.json]

Rows on one random batch of a random-init model. Shared machines drift by 10-20% over a minute,
so every repetition runs each row once, one after the other, and a ratio is the median over
repetitions of that repetition's row time / its plain-forward time (seconds: the median):

- plain forward: ``model(x)`` with timm's fused attention (the baseline of every ratio);
- ``vl.analyze``: attention distance + rollout from one forward, plus the two weight-only views;
- vitlens distance + rollout: ``vl.analyze(views=("distance", "rollout"))`` (inline capture, the
  views' default for timm models), and the same streams with side capture;
- two views called one after the other: ``attention_distance`` then ``attention_rollout`` (two
  passes: nothing is kept between calls), against ``vl.analyze`` of both (one pass);
- (a) timm's ``AttentionExtract`` (fused attention off, every map kept) + batched torch code for
  distance and rollout; its numbers are checked against vitlens's (so the race is fair);
- (b) a per-image loop with hooks on ``attn_drop`` and numpy rollout, as vit-explain does
  (timed on ``--loop-images`` images, reported per image).

Memory: peak resident memory of a process computing attention distance over 64 and over 1,024
images (it must not grow), and of one batch of ``vl.analyze`` against one batch of (a) (which
keeps every map); on CUDA, peak GPU memory instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def peer_attention_extract(extractor: Any, x: Any, stride: int, prefix: int = 1) -> tuple[Any, Any, Any]:
    """(a) What a user writes with timm's AttentionExtract (built once, over the non-fused model):
    every map kept, then batched torch for distance and rollout."""
    import torch

    with torch.no_grad():
        maps = list(extractor(x).values())  # [B, H, T, T] per block
        b, _, t, _ = maps[0].shape
        n = t - prefix
        side = int(round(n ** 0.5))
        yy, xx = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        pos = torch.stack([yy.reshape(-1), xx.reshape(-1)], -1).float().to(x.device) * stride
        dist = torch.cdist(pos, pos)
        distances = []
        for a in maps:
            p = a[:, :, prefix:, prefix:]
            w = p / p.sum(-1, keepdim=True)
            distances.append((w * dist).sum(-1).mean(-1).mean(0))
        eye = torch.eye(t, device=x.device)
        r = eye.expand(b, t, t)
        for a in maps:
            f = a.mean(1) + eye
            f = f / f.sum(-1, keepdim=True)
            r = f @ r
        rollout = r[:, 0, prefix:]
        rollout = rollout / rollout.amax(-1, keepdim=True)
    return torch.stack(distances), rollout.reshape(b, side, side), maps


def peer_per_image_loop(model: Any, images: Any) -> list[Any]:
    """(b) What vit-explain does: hooks on attn_drop, one image at a time, rollout in numpy."""
    import numpy as np
    import torch

    maps: list[Any] = []
    hooks = [blk.attn.attn_drop.register_forward_hook(lambda _m, _i, out: maps.append(out.cpu().numpy()))
             for blk in model.blocks]
    out = []
    try:
        with torch.no_grad():
            for img in images:
                maps.clear()
                model(img[None])
                t = maps[0].shape[-1]
                result = np.eye(t)
                for a in maps:
                    fused = a.mean(axis=1)[0]
                    a2 = fused + np.eye(t)
                    a2 = a2 / a2.sum(axis=-1, keepdims=True)
                    result = a2 @ result
                mask = result[0, 1:]
                side = int(round(mask.size ** 0.5))
                out.append((mask / mask.max()).reshape(side, side))
    finally:
        for h in hooks:
            h.remove()
    return out


def speed(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import vitlens as vl

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    m = vl.load_model(args.model, pretrained=False, device=args.device, dtype=dtype)
    x = torch.randn(args.batch, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(0)).to(m.device)
    cuda = m.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stride = m.spec.stride_px[0]
    out: dict[str, Any] = {"model": args.model, "batch": args.batch, "device": str(m.device), "dtype": args.dtype,
                           "threads": torch.get_num_threads()}

    def plain() -> None:
        with torch.no_grad(), m.autocast():
            m.model(x)

    def streamed(mode: str) -> None:
        consumers = [vl.AttentionDistanceAccumulator.for_model(m.spec), vl.RolloutAccumulator.for_model(m)]
        vl.stream_attention(m, x, consumers, batch_size=args.batch, capture_mode=mode)

    def separately() -> None:
        vl.attention_distance(m, x, batch_size=args.batch)
        vl.attention_rollout(m, x, batch_size=args.batch)

    import copy

    from timm.utils import AttentionExtract

    ref = copy.deepcopy(m.model)  # the peers' own copy, with fused attention off
    for blk in ref.blocks:
        blk.attn.fused_attn = False
    extractor = AttentionExtract(ref, method="fx")

    def peer() -> None:  # (a): timm's non-fused path, every map kept, batched torch
        with m.autocast():
            peer_attention_extract(extractor, x, stride, m.spec.num_prefix_tokens)

    rows = {
        "plain_forward": plain,
        "analyze": lambda: vl.analyze(m, x, batch_size=args.batch),
        "distance_rollout": lambda: vl.analyze(m, x, batch_size=args.batch, views=("distance", "rollout")),
        "stream_side": lambda: streamed("side"),
        "stream_inline": lambda: streamed("inline"),
        "peer_attention_extract": peer,
        "two_views_called_separately": separately,
    }
    rows_all = list(rows)
    if args.rows:
        rows = {k: v for k, v in rows.items() if k in ("plain_forward", "analyze") or k in args.rows}
    for fn in rows.values():  # warm-up
        fn()
    sync()
    runs: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.reps):
        for k, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            sync()
            runs[k].append(time.perf_counter() - t0)
    t = {k: statistics.median(v) for k, v in runs.items()}
    out["runs_seconds"] = {k: [round(x, 3) for x in v] for k, v in runs.items()}

    def ratio(k: str, base: str = "plain_forward") -> float:
        if k not in runs or base not in runs:
            return float("nan")
        return round(statistics.median(a / b for a, b in zip(runs[k], runs[base])), 3)

    d_peer, r_peer, _ = peer_attention_extract(extractor, x, stride, m.spec.num_prefix_tokens)
    k = min(args.loop_images, args.batch)
    peer_per_image_loop(ref, x[:1])  # warm-up
    t0 = time.perf_counter()
    loop_maps = peer_per_image_loop(ref, x[:k])
    sync()
    t["peer_loop_per_image"] = (time.perf_counter() - t0) / k
    a = vl.analyze(m, x, batch_size=args.batch)
    # the race is fair: the peers compute the same numbers (float32 peers, so float32 tolerances)
    np.testing.assert_allclose(d_peer.float().cpu().numpy(), a.distance.mean_px, rtol=2e-3 if cuda else 1e-4)
    np.testing.assert_allclose(r_peer.float().cpu().numpy(), a.rollout.maps, rtol=2e-3 if cuda else 1e-3, atol=1e-4)
    np.testing.assert_allclose(np.stack(loop_maps), a.rollout.maps[:len(loop_maps)], rtol=2e-3 if cuda else 1e-3,
                               atol=1e-4)
    t["vitlens_per_image"] = t["analyze"] / args.batch
    out["seconds"] = {k: round(v, 4) for k, v in t.items()}
    for k in rows_all:
        out["seconds"].setdefault(k, float("nan"))
    out["ratios"] = {
        "analyze / plain forward": ratio("analyze"),
        "distance + rollout / plain forward": ratio("distance_rollout"),
        "stream side / plain forward": ratio("stream_side"),
        "stream inline / plain forward": ratio("stream_inline"),
        "(a) AttentionExtract + torch / plain forward": ratio("peer_attention_extract"),
        "distance + rollout / (a)": ratio("distance_rollout", "peer_attention_extract"),
        "analyze / (a)": ratio("analyze", "peer_attention_extract"),
        "(b) per-image loop / vitlens, per image": round(t["peer_loop_per_image"] / t["vitlens_per_image"], 2),
        "two views separately / plain forward": ratio("two_views_called_separately"),
    }
    out["same_numbers_as_peers"] = True
    if cuda:
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
        if args.dtype != "float32":
            m32 = vl.load_model(args.model, pretrained=False, device=args.device)
            m32.model.load_state_dict(m.model.state_dict())
            a32 = vl.analyze(m32, x.float(), batch_size=args.batch)
            out["bf16_vs_fp32"] = {
                "distance_max_rel": float(np.max(np.abs(a.distance.mean_px - a32.distance.mean_px) / a32.distance.mean_px)),
                "rollout_max_abs": float(np.max(np.abs(a.rollout.maps - a32.rollout.maps)))}
    return out


def memory_child(kind: str, model: str, n: int, batch: int, device: str | None) -> dict:
    import torch

    import vitlens as vl

    torch.manual_seed(0)
    m = vl.load_model(model, pretrained=False, device=device)
    gen = torch.Generator().manual_seed(0)

    def batches():
        for start in range(0, n, batch):
            yield torch.randn(min(batch, n - start), 3, *m.spec.image_size, generator=gen)

    from vitlens.memory import peak_rss_mb

    before = peak_rss_mb()
    if kind == "distance":
        vl.attention_distance(m, batches(), batch_size=batch)
    elif kind == "analyze":
        vl.analyze(m, next(batches()).to(m.device), batch_size=batch)
    else:
        from timm.utils import AttentionExtract

        for blk in m.model.blocks:
            blk.attn.fused_attn = False
        peer_attention_extract(AttentionExtract(m.model, method="fx"), next(batches()).to(m.device),
                               m.spec.stride_px[0], m.spec.num_prefix_tokens)
    peak = peak_rss_mb()
    out = {"kind": kind, "n_images": n, "peak_rss_mb": round(peak, 1), "rss_before_mb": round(before, 1)}
    if m.device.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def child(args: argparse.Namespace, kind: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--child", kind, str(n)]
    if args.device:
        cmd += ["--device", args.device]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--loop-images", type=int, default=8)
    p.add_argument("--mem-images", type=int, nargs="*", default=[64, 1024])
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--rows", nargs="*", default=None, help="time only these rows (plain_forward always)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(memory_child(args.child[0], args.model, int(args.child[1]), args.batch, args.device)))
        return 0
    report: dict[str, Any] = {}
    if not args.skip_speed:
        report["speed"] = s = speed(args)
        print(json.dumps(s, indent=1))
        sec, r = s["seconds"], s["ratios"]
        print(f"\n| what | seconds | ratio to the plain forward |\n|---|---|---|\n| plain fused forward, batch "
              f"{args.batch} | {sec['plain_forward']:.3f} | 1.00 |\n| vl.analyze (distance + rollout + weight views) | "
              f"{sec['analyze']:.3f} | {r['analyze / plain forward']:.3f} |\n| vl.analyze(views=(distance, rollout)) | "
              f"{sec['distance_rollout']:.3f} | {r['distance + rollout / plain forward']:.3f} |\n| stream, side capture "
              f"| {sec['stream_side']:.3f} | {r['stream side / plain forward']:.3f} |\n| stream, inline capture | "
              f"{sec['stream_inline']:.3f} | {r['stream inline / plain forward']:.3f} |\n| (a) AttentionExtract + "
              f"torch | {sec['peer_attention_extract']:.3f} | {r['(a) AttentionExtract + torch / plain forward']:.3f}; "
              f"vitlens distance + rollout / (a) = {r['distance + rollout / (a)']:.3f}, analyze / (a) = "
              f"{r['analyze / (a)']:.3f} |\n| (b) per-image loop + numpy, per image | "
              f"{sec['peer_loop_per_image']:.3f} | (b)/vitlens = {r['(b) per-image loop / vitlens, per image']:.2f}x |"
              f"\n| distance then rollout, called separately | {sec['two_views_called_separately']:.3f} | "
              f"{r['two views separately / plain forward']:.3f} (two passes; analyze of both is one) |")
    if not args.skip_memory:
        report["memory"] = mem = [child(args, "distance", n) for n in args.mem_images]
        report["batch_memory"] = [child(args, "analyze", args.batch), child(args, "peer", args.batch)]
        print(json.dumps(report["memory"] + report["batch_memory"], indent=1))
        if len(mem) >= 2:
            print(f"peak RSS of attention distance: {mem[0]['peak_rss_mb']:.0f} MB for {mem[0]['n_images']} images, "
                  f"{mem[-1]['peak_rss_mb']:.0f} MB for {mem[-1]['n_images']} "
                  f"({100 * (mem[-1]['peak_rss_mb'] / mem[0]['peak_rss_mb'] - 1):+.1f}%)")
        a, b = report["batch_memory"]
        print(f"one batch of {args.batch}: vl.analyze peak {a['peak_rss_mb']:.0f} MB, (a) keeping every map "
              f"{b['peak_rss_mb']:.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
