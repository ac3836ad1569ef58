"""Benchmark: vitlens against what a user would otherwise write, side by side on one model and batch.

Usage:
    python analyses/bench.py [--model vit_base_patch16_224] [--batch 32] [--reps 5] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--loop-images 8] [--mem-images 64 1024] [--skip-memory] [--json out.json]
        [--img-size 768] [--rows distance_rollout stream_side_rows ...]

    the cold bench: one call per fresh process, plain and analyze(distance, rollout) alternating, the median of the
    pairs' ratios with their spread (``analyses/bench_cold.py``; ``--phases`` adds a first and a second call's phases):
    python analyses/bench.py --cold --img-size 768 --batch 4 --pairs 3 --goal distance_rollout=1.20
    (``--base plain_mlp_buffers``: the pairs' base is the plain forward with the MLP's buffers, the views' own cost)

    the views' own cost phase by phase, each phase beside its memory bound (``analyses/bench_phases.py``):
    python analyses/bench.py --phase-table --img-size 1024 --batch 2 --reps 2

    e.g. the views' capture against side capture by query rows at 768 px, interleaved (no peers run):
    python analyses/bench.py --skip-memory --img-size 768 --batch 4 --reps 3 --rows distance_rollout stream_side_rows

    the same rows in three runs (each its own process), each run's median and spread, and goals checked in
    every run (issue 35's repeatable measurement):
    python analyses/bench.py --img-size 768 --batch 4 --reps 5 --runs 3 --rows distance_rollout distance \
        --goal distance_rollout=1.20

Rows on one random batch of a random-init model. Shared machines drift by 10-20% over a minute,
so every repetition runs each row once, one after the other, and a ratio is the median over
repetitions of that repetition's row time / its plain-forward time (seconds: the median), given with
its spread (the lowest and highest repetition's ratio). The row ``plain_again`` times the same plain
forward a second time in each repetition: its ratio is the machine's noise. The row ``plain_mlp_buffers`` times the
plain forward with its MLPs in a workspace, as the views' inline capture runs a timm ViT's blocks
(``vitlens.families.timm_vit.mlp_in_workspace``); timed beside ``distance_rollout``, their ratio is the views' own cost
over a forward that has the same buffers.

- plain forward: ``model(x)`` with timm's fused attention (the baseline of every ratio);
- ``vl.analyze``: attention distance + rollout from one forward, plus the two weight-only views;
- vitlens distance + rollout: ``vl.analyze(views=("distance", "rollout"))`` (inline capture, the
  views' default for timm models), and the same streams with side capture; ``distance_rollout_eager``: the
  same with the compiled distance kernel off (``VITLENS_COMPILE=0``), what that kernel buys;
- two views called one after the other: ``attention_distance`` then ``attention_rollout`` (two
  passes: nothing is kept between calls), against ``vl.analyze`` of both (one pass);
- (a) timm's ``AttentionExtract`` (fused attention off, every map kept) + batched torch code for
  distance and rollout; its numbers are checked against vitlens's (so the race is fair);
- (b) a per-image loop with hooks on ``attn_drop`` and numpy rollout, as vit-explain does
  (timed on ``--loop-images`` images, reported per image).

Memory: peak resident memory of a process computing attention distance over 64 and over 1,024
images (it must not grow), and of one batch of ``vl.analyze`` against one batch of (a) (which
keeps every map); on CUDA, peak GPU memory instead.

Attribution methods (``--attributions``, ``analyses/attribution_cost.py``): seconds per image of every
method of ``vitlens.attribution`` on ref-vit and a random-init vit_base at batch 16.

The resolution table (``--table``; ``--quick`` for a smoke run at 224 px, batch 2):

    python analyses/bench.py --table [--sizes 224:16 768:4 1024:2] [--columns ...] [--mem-cap-gb 20]

Rows: random-init ``--model`` built at each input size, one random batch; every cell (input size x
column) runs in its own process: load, set up (a peer's own model), one warm-up image, then the timed
run; its peak is VmHWM above the process's resident size just before the timed run (``clear_refs``
restarts the high-water mark there); the timed run is repeated up to 3 times while the cell's runs took
under 75 s in all, and the median is reported (``CELL_RUNS``, ``CELL_SECONDS``). Columns: the plain
fused forward; ``vl.analyze(views=("distance", "rollout"))`` and distance alone, as the views choose their capture (``capture_plan``); (a) timm's
``AttentionExtract`` + batched torch; (b) the per-image hook loop (vit-explain); (c) Hugging Face
``ViTModel`` with eager attention and ``output_attentions=True``, the timm weights copied in. Every
peer's distance and rollout are checked against vitlens's. A cell estimated to need more than
``--mem-cap-gb`` above the model is reported as OOM with the estimate, not run; one that runs past
the cap (an address-space limit of the cap + 4 GB) is reported as OOM too. ``--columns plain
distance_whole distance_rows distance_inline_rows`` times whole maps (timm's own non-fused path) against
query-chunked side capture and inline capture by query rows (the crossover; the views use the last for
timm ViTs, one block when the whole map fits).
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


def plan_rows(m: Any, batch: int) -> int:
    """The query rows per block the views' capture plan takes at this batch (T when it makes whole maps): what
    the query-chunked rows and columns run, with whichever capture they time."""
    from vitlens.engine import capture_plan

    s = m.spec
    return capture_plan(m, batch).query_rows or s.num_prefix_tokens + s.grid[0] * s.grid[1]


def peer_attention_extract(extractor: Any, x: Any, stride: int, prefix: int = 1) -> tuple[Any, Any, Any]:
    """(a) What a user writes with timm's AttentionExtract (built once, over the non-fused model):
    every map kept, then batched torch for distance and rollout."""
    import torch

    with torch.no_grad():
        maps = list(extractor(x).values())  # [B, H, T, T] per block
        distances, rollout = peer_views(maps, stride, prefix)
    return distances, rollout, maps


def peer_views(maps: list[Any], stride: int, prefix: int = 1) -> tuple[Any, Any]:
    """Batched torch distance and rollout from every block's whole map, as a user writes them."""
    import torch

    with torch.no_grad():
        b, _, t, _ = maps[0].shape
        x = maps[0]
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
    return torch.stack(distances), rollout.reshape(b, side, side)


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


def eager_kernel(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn`` with the compiled distance kernel off (``VITLENS_COMPILE=0``): the row that says what it buys."""
    from vitlens.core.native import COMPILE_ENV

    before = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        if before is None:
            del os.environ[COMPILE_ENV]
        else:
            os.environ[COMPILE_ENV] = before


def ratio_spread(rows: list[float], base: list[float]) -> list[float]:
    """The lowest and highest of one row's per-repetition ratios to the base row (the rows were interleaved)."""
    ratios = [a / b for a, b in zip(rows, base)]
    return [round(min(ratios), 3), round(max(ratios), 3)]


def parse_goals(goals: list[str]) -> dict[str, float]:
    """``ROW=RATIO`` pairs (``distance_rollout=1.20``): a row meets its goal when its median ratio to the plain
    forward is at most RATIO."""
    out = {}
    for goal in goals:
        row, sep, value = goal.partition("=")
        if not sep:
            raise SystemExit(f"bench.py: a goal is ROW=RATIO (e.g. distance_rollout=1.20); got {goal!r}")
        out[row] = float(value)
    return out


def repeated_runs(args: argparse.Namespace, argv: list[str]) -> dict:
    """``--runs N``: the speed bench N times, each its own process (one after the other), and for every row the
    median ratio of each run with its spread; a goal (``--goal``) is met when it is met in every run.

    The rows are interleaved within each repetition of each run (``speed``), so drift over a minute falls on
    every row alike; the runs show what a single run cannot, whether the median repeats.
    """
    import tempfile

    goals = parse_goals(args.goal or [])
    timed = {"plain_again", *(args.rows or ())}
    if args.rows and set(goals) - timed:
        raise SystemExit(f"bench.py: a goal names a row not timed: {', '.join(sorted(set(goals) - timed))} "
                         f"(--rows {' '.join(args.rows)})")
    child_argv = []
    skip = False
    for a in argv:  # the same options, without --runs N, --goal ... and --json (each run writes its own)
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--runs", "--goal", "--json")
        if not skip:
            child_argv.append(a)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            subprocess.run([sys.executable, __file__, *child_argv, "--skip-memory", "--json", str(out)], check=True,
                           stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text())["speed"])
    rows = [k for k in runs[0]["runs_seconds"] if k != "plain_forward"]
    summary: dict[str, Any] = {"runs": args.runs, "reps_per_run": args.reps, "img_size": args.img_size,
                               "batch": args.batch, "rows": {}}
    print(f"\n{args.runs} runs of {args.reps} interleaved repetitions ({args.model}, batch {args.batch}, "
          f"{args.img_size or 'default'} px); each cell: median ratio to the plain forward [min, max]\n")
    print("| row | " + " | ".join(f"run {i + 1}" for i in range(args.runs)) + " | goal | met in every run |")
    print("|---|" + "---|" * (args.runs + 2))
    for row in rows:
        key = f"{row} / plain forward"
        medians = [statistics.median(a / b for a, b in zip(r["runs_seconds"][row], r["runs_seconds"]["plain_forward"]))
                   for r in runs]
        spreads = [r["ratio_spread"][key] for r in runs]
        goal = goals.get(row)
        met = None if goal is None else all(v <= goal for v in medians)
        summary["rows"][row] = {"medians": [round(v, 3) for v in medians], "spreads": spreads, "goal": goal,
                                "met_in_every_run": met}
        cells = " | ".join(f"{v:.3f} [{lo:.2f}, {hi:.2f}]" for v, (lo, hi) in zip(medians, spreads))
        print(f"| {row} | {cells} | {'' if goal is None else f'<= {goal:.2f}'} | "
              f"{'' if met is None else ('yes' if met else 'no')} |")
    missing = sorted(set(goals) - set(rows))
    if missing:
        raise SystemExit(f"bench.py: no row named {', '.join(missing)} was timed (rows: {', '.join(rows)})")
    return summary


def speed(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import vitlens as vl
    from vitlens.views.distance import AttentionDistanceAccumulator
    from vitlens.views.rollout import RolloutAccumulator

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    size = {"img_size": args.img_size} if args.img_size else {}
    m = vl.load_model(args.model, pretrained=False, device=args.device, dtype=dtype, **size)
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
        consumers = [AttentionDistanceAccumulator.for_model(m.spec), RolloutAccumulator.for_model(m)]
        vl.stream_attention(m, x, consumers, batch_size=args.batch, capture_mode=mode)

    def by_rows(mode: str) -> None:  # the views' blocks of query rows, with side or inline capture
        consumers = [AttentionDistanceAccumulator.for_model(m.spec), RolloutAccumulator.for_model(m)]
        vl.stream_attention(m, x, consumers, batch_size=args.batch, capture_mode=mode, query_rows=plan_rows(m, args.batch))

    def plain_mlp_buffers() -> None:  # the plain forward with its MLPs in a workspace, as the views' capture runs them
        from vitlens.families.base import Handles
        from vitlens.families.timm_vit import mlp_in_workspace

        handles = Handles()
        mlp_in_workspace(getattr(m.model, "blocks", ()), {}, handles)
        try:
            plain()
        finally:
            handles.remove()

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
        "plain_again": plain,  # the machine's noise: the same forward timed again in each repetition
        "plain_mlp_buffers": plain_mlp_buffers,
        "distance": lambda: vl.analyze(m, x, batch_size=args.batch, views=("distance",)),
        "analyze": lambda: vl.analyze(m, x, batch_size=args.batch),
        "distance_rollout": lambda: vl.analyze(m, x, batch_size=args.batch, views=("distance", "rollout")),
        "distance_rollout_eager": lambda: eager_kernel(vl.analyze, m, x, batch_size=args.batch,
                                                       views=("distance", "rollout")),
        "stream_side": lambda: streamed("side"),
        "stream_inline": lambda: streamed("inline"),
        "stream_side_rows": lambda: by_rows("side"),
        "stream_inline_rows": lambda: by_rows("inline"),
        "peer_attention_extract": peer,
        "two_views_called_separately": separately,
    }
    rows_all = list(rows)
    peers = True
    if args.rows:
        peers = any(r.startswith("peer") for r in args.rows)  # the peers' checks below compare with analyze
        rows = {k: v for k, v in rows.items()
                if k in ("plain_forward", "plain_again") or k in args.rows or (peers and k == "analyze")}
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

    out["ratio_spread"] = {f"{k} / plain forward": ratio_spread(runs[k], runs["plain_forward"])
                           for k in rows if k != "plain_forward"}
    out["noise"] = {"plain again / plain forward": ratio("plain_again"),
                    "spread": ratio_spread(runs["plain_again"], runs["plain_forward"])}
    def device_extras() -> None:  # on CUDA: the peak, and the low-precision views' error against float32
        if not cuda:
            return
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
        if args.dtype != "float32":
            low = vl.analyze(m, x, batch_size=args.batch, views=("distance", "rollout"))
            m32 = vl.load_model(args.model, pretrained=False, device=args.device, **size)
            m32.model.load_state_dict({k: v.float() for k, v in m.model.state_dict().items()})
            a32 = vl.analyze(m32, x.float(), batch_size=args.batch, views=("distance", "rollout"))
            out[f"{args.dtype}_vs_float32"] = {
                "distance_max_rel": float(np.max(np.abs(low.distance.mean_px - a32.distance.mean_px)
                                                 / a32.distance.mean_px)),
                "rollout_max_abs": float(np.max(np.abs(low.rollout.maps - a32.rollout.maps)))}

    if args.rows and not peers:  # no peer timed: no peer run either
        out["seconds"] = {k: round(v, 4) for k, v in t.items()}
        out["ratios"] = {f"{k} / plain forward": ratio(k) for k in rows if k != "plain_forward"}
        if "plain_mlp_buffers" in rows and "distance_rollout" in rows:  # the views' own cost
            out["ratios"]["distance_rollout / plain_mlp_buffers"] = ratio("distance_rollout", "plain_mlp_buffers")
            out["ratio_spread"]["distance_rollout / plain_mlp_buffers"] = ratio_spread(runs["distance_rollout"],
                                                                                      runs["plain_mlp_buffers"])
        device_extras()
        return out
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
        "distance / plain forward": ratio("distance"),
        "plain again / plain forward": ratio("plain_again"),
        "stream side / plain forward": ratio("stream_side"),
        "stream inline / plain forward": ratio("stream_inline"),
        "stream side by query rows / plain forward": ratio("stream_side_rows"),
        "stream inline by query rows / plain forward": ratio("stream_inline_rows"),
        "(a) AttentionExtract + torch / plain forward": ratio("peer_attention_extract"),
        "distance + rollout / (a)": ratio("distance_rollout", "peer_attention_extract"),
        "analyze / (a)": ratio("analyze", "peer_attention_extract"),
        "(b) per-image loop / vitlens, per image": round(t["peer_loop_per_image"] / t["vitlens_per_image"], 2),
        "two views separately / plain forward": ratio("two_views_called_separately"),
    }
    out["same_numbers_as_peers"] = True
    device_extras()
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


# ---- the resolution table: one subprocess per (input size, column) ---------------------------------------------

#: the table's rows: (input px, batch); ``--quick``: 224 px at a small batch only
TABLE_SIZES = ((224, 16), (768, 4), (1024, 2))
QUICK_SIZES = ((224, 2),)
#: the table's columns; each runs in a fresh process, its peak VmHWM above the loaded model
TABLE_COLUMNS = ("plain", "analyze", "distance", "peer_a", "peer_b", "peer_c")
#: columns for the whole-map / query-chunked crossover (``--columns plain distance_whole distance_rows``)
CROSSOVER_COLUMNS = ("distance_whole", "distance_rows", "distance_inline_rows")
COLUMN_TITLES = {
    "plain": "plain fused forward",
    "analyze": 'vl.analyze(views=("distance", "rollout"))',
    "distance": "distance alone",
    "peer_a": "(a) timm AttentionExtract + batched torch",
    "peer_b": "(b) per-image hook loop (vit-explain)",
    "peer_c": "(c) HF ViTModel eager, output_attentions",
    "distance_whole": "distance, whole maps (inline)",
    "distance_rows": "distance, query-chunked side capture",
    "distance_inline_rows": "distance, inline by query rows",
}


def whole_maps_gb(layers: int, batch: int, heads: int, tokens: int) -> float:
    """GB of every block's whole [batch, heads, T, T] float32 map (what a peer that keeps them all holds)."""
    return 4.0 * layers * batch * heads * tokens * tokens / 1e9


def needed_gb(column: str, layers: int, batch: int, heads: int, tokens: int) -> float:
    """An estimate of a column's memory above the loaded model, for refusing what cannot fit: the
    peers keep every map (a, c: the batch's; b: one image's) plus a block's scores and softmax (and,
    for a's and c's rollout, two [B, T, T] products); vitlens's columns hold at most rollout's
    L x B x T x T fused maps."""
    block = 4.0 * batch * heads * tokens * tokens / 1e9
    if column in ("peer_a", "peer_c"):
        return whole_maps_gb(layers, batch, heads, tokens) + 2 * block + 2 * 4.0 * batch * tokens ** 2 / 1e9
    if column == "peer_b":
        return whole_maps_gb(layers, 1, heads, tokens) + 2 * block / batch + 3 * 8.0 * tokens ** 2 / 1e9
    if column == "analyze":
        return 4.0 * layers * batch * tokens ** 2 / 1e9 + block
    return block


def hf_vit_from_timm(model: Any) -> Any:
    """A Hugging Face ``ViTModel`` (eager attention) carrying a timm ViT's weights (transformers 5 names).

    Only plain timm ViTs with a class token map one to one (qkv split into q, k, v; LayerNorm eps 1e-6).
    """
    import torch
    from transformers import ViTConfig, ViTModel

    pe = model.patch_embed
    blk = model.blocks[0]
    cfg = ViTConfig(image_size=int(pe.img_size[0]), patch_size=int(pe.patch_size[0]), hidden_size=int(model.embed_dim),
                    num_hidden_layers=len(model.blocks), num_attention_heads=int(blk.attn.num_heads),
                    intermediate_size=int(blk.mlp.fc1.out_features), layer_norm_eps=float(blk.norm1.eps),
                    qkv_bias=blk.attn.qkv.bias is not None, hidden_act="gelu", attn_implementation="eager")
    hf = ViTModel(cfg, add_pooling_layer=False).eval()
    sd = {"embeddings.cls_token": model.cls_token, "embeddings.position_embeddings": model.pos_embed,
          "embeddings.patch_embeddings.projection.weight": pe.proj.weight,
          "embeddings.patch_embeddings.projection.bias": pe.proj.bias,
          "layernorm.weight": model.norm.weight, "layernorm.bias": model.norm.bias}
    for i, b in enumerate(model.blocks):
        q, k, v = b.attn.qkv.weight.chunk(3)
        qb, kb, vb = b.attn.qkv.bias.chunk(3)
        pre = f"layers.{i}."
        sd.update({pre + "attention.q_proj.weight": q, pre + "attention.q_proj.bias": qb,
                   pre + "attention.k_proj.weight": k, pre + "attention.k_proj.bias": kb,
                   pre + "attention.v_proj.weight": v, pre + "attention.v_proj.bias": vb,
                   pre + "attention.o_proj.weight": b.attn.proj.weight, pre + "attention.o_proj.bias": b.attn.proj.bias,
                   pre + "layernorm_before.weight": b.norm1.weight, pre + "layernorm_before.bias": b.norm1.bias,
                   pre + "layernorm_after.weight": b.norm2.weight, pre + "layernorm_after.bias": b.norm2.bias,
                   pre + "mlp.fc1.weight": b.mlp.fc1.weight, pre + "mlp.fc1.bias": b.mlp.fc1.bias,
                   pre + "mlp.fc2.weight": b.mlp.fc2.weight, pre + "mlp.fc2.bias": b.mlp.fc2.bias})
    with torch.no_grad():
        hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return hf


def table_child(column: str, model_name: str, img: int, batch: int, threads: int, cap_gb: float) -> dict:
    """One cell of the resolution table, in this (fresh) process."""
    import resource

    import numpy as np
    import torch

    import vitlens as vl
    from vitlens.memory import peak_rss_mb
    from vitlens.views.distance import AttentionDistanceAccumulator

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = vl.load_model(model_name, pretrained=False, device="cpu", img_size=img)
    s = m.spec
    t = s.num_prefix_tokens + s.grid[0] * s.grid[1]
    out: dict[str, Any] = {"column": column, "img_size": img, "batch": batch, "tokens": t}
    need = needed_gb(column, s.num_layers, batch, s.num_heads, t)
    out["estimate_gb"] = round(need, 2)
    if need > cap_gb:
        out["oom"] = f"OOM: needs ~{need:.1f} GB above the model (estimate), over the {cap_gb:g} GB cap"
        return out
    x = torch.randn(batch, 3, img, img, generator=torch.Generator().manual_seed(0))
    peer_model = None
    if column in ("peer_a", "peer_b"):
        for blk in m.model.blocks:
            blk.attn.fused_attn = False
    if column == "peer_a":
        from timm.utils import AttentionExtract

        peer_model = AttentionExtract(m.model, method="fx")
    elif column == "peer_c":
        peer_model = hf_vit_from_timm(m.model)
    # the backstop for an estimate that is too low: the address space may grow by the cap and 4 GB more
    vm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:"))
    limit = int(vm + (cap_gb + 4) * 1e9)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    def run(x: Any) -> None:
        with torch.no_grad():
            if column == "plain":
                m.model(x)
            elif column == "analyze":
                a = vl.analyze(m, x, batch_size=batch, views=("distance", "rollout"))
                out.update(distance=a.distance.mean_px.tolist(), rollout=a.rollout.maps.tolist())
            elif column == "distance":
                out["distance"] = vl.attention_distance(m, x, batch_size=batch).mean_px.tolist()
            elif column in CROSSOVER_COLUMNS:
                acc = AttentionDistanceAccumulator.for_model(s)
                rows = None if column == "distance_whole" else plan_rows(m, batch)
                mode = "side" if column == "distance_rows" else "inline"
                vl.stream_attention(m, x, [acc], batch_size=batch, capture_mode=mode, query_rows=rows)
                out.update(distance=acc.result(s).mean_px.tolist(), query_rows=rows)
            elif column == "peer_a":
                d, r, _ = peer_attention_extract(peer_model, x, s.stride_px[0], s.num_prefix_tokens)
                out.update(distance=d.tolist(), rollout=r.tolist())
            elif column == "peer_b":
                out["rollout"] = np.stack(peer_per_image_loop(m.model, x)).tolist()
            elif column == "peer_c":
                hf_out = peer_model(pixel_values=x, output_attentions=True)
                d, r = peer_views(list(hf_out.attentions), s.stride_px[0], s.num_prefix_tokens)
                out.update(distance=d.tolist(), rollout=r.tolist())
            else:
                raise ValueError(f"unknown column {column!r}")

    try:
        run(x[:1])  # warm-up on one image (first-call costs), then the peak starts afresh from here
        import gc

        gc.collect()
        reset_peak()
        before = peak_rss_mb()
        runs: list[float] = []
        while not runs or (len(runs) < CELL_RUNS and sum(runs) < CELL_SECONDS):
            start = time.perf_counter()
            run(x)
            runs.append(round(time.perf_counter() - start, 2))
    except (MemoryError, RuntimeError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        out["oom"] = f"OOM at the {cap_gb:g} GB cap (estimate {need:.1f} GB): {str(e)[:80]}"
        return out
    out.update(seconds=round(statistics.median(runs), 2), runs=runs, peak_above_model_mb=round(peak_rss_mb() - before, 1),
               model_mb=round(before, 1))
    return out


#: a table cell repeats its timed run up to CELL_RUNS times while the runs so far took under CELL_SECONDS
#: in all, and reports the median (this shared VM drifts by 10-20% over a minute; one run of a 4 s cell
#: is mostly noise); its peak is the high-water mark over all its runs
CELL_RUNS = 3
CELL_SECONDS = 75.0


def reset_peak() -> None:
    """Start this process's VmHWM afresh at its current resident size (Linux ``clear_refs``), so what was
    built before (a peer's own model copy, the warm-up) does not count."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def run_cell(args: argparse.Namespace, column: str, img: int, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads), "--mem-cap-gb",
           str(args.mem_cap_gb), "--table-child", column, str(img), str(batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        killed = proc.returncode in (-9, 137)
        return {"column": column, "img_size": img, "batch": batch,
                "oom" if killed else "failed": f"{'killed (out of memory?)' if killed else 'exit'} "
                                               f"{proc.returncode}: {tail[:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_same_numbers(cells: dict[str, dict]) -> list[str]:
    """Every column's distance and rollout against vitlens's (the race is fair); returns the notes."""
    import numpy as np

    notes = []
    for key, rtol, atol in (("distance", 1e-4, 0.0), ("rollout", 1e-3, 1e-4)):
        have = {c: np.asarray(v[key]) for c, v in cells.items() if key in v}
        ref_col = "analyze" if "analyze" in have else next(iter(have), None)
        if ref_col is None:
            continue
        for c, v in have.items():
            if c == ref_col:
                continue
            np.testing.assert_allclose(v, have[ref_col], rtol=rtol, atol=atol, err_msg=f"{c} vs {ref_col}: {key}")
            rel = float(np.max(np.abs(v - have[ref_col]) / np.maximum(np.abs(have[ref_col]), 1e-12)))
            notes.append(f"{key}: {c} = {ref_col} (largest relative difference {rel:.1e})")
    return notes


def format_table(results: list[dict], columns: list[str]) -> str:
    """The README's resolution table: time ratio and peak above the loaded model, per column."""
    head = "| input | " + " | ".join(COLUMN_TITLES[c] for c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for (img, batch) in dict.fromkeys((r["img_size"], r["batch"]) for r in results):
        row = {r["column"]: r for r in results if (r["img_size"], r["batch"]) == (img, batch)}
        plain = row.get("plain", {})
        t = next((r.get("tokens") for r in row.values() if r.get("tokens")), "?")
        cells = []
        for c in columns:
            r = row.get(c, {})
            if "oom" in r or "failed" in r:
                cells.append(r.get("oom") or r.get("failed", ""))
            elif "seconds" not in r:
                cells.append("—")
            elif c == "plain":
                cells.append(f"{r['seconds']:.2f} s, +{r['peak_above_model_mb']:,.0f} MB")
            else:
                ratio = r["seconds"] / plain["seconds"] if plain.get("seconds") else float("nan")
                mem = r["peak_above_model_mb"] / plain["peak_above_model_mb"] if plain.get("peak_above_model_mb") \
                    else float("nan")
                cells.append(f"{ratio:.2f}x, +{r['peak_above_model_mb']:,.0f} MB ({mem:.2f}x)")
        lines.append(f"| {img} px, T={t}, batch {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(args: argparse.Namespace) -> dict:
    sizes = QUICK_SIZES if args.quick else tuple(tuple(int(v) for v in s.split(":")) for s in args.sizes) \
        if args.sizes else TABLE_SIZES
    columns = list(args.columns or TABLE_COLUMNS)
    results, notes = [], []
    for img, batch in sizes:
        cells = {}
        for c in columns:
            cells[c] = r = run_cell(args, c, img, batch)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("distance", "rollout")}), flush=True)
        notes += [f"{img} px: {n}" for n in check_same_numbers(cells)]
    text = format_table(results, columns)
    print("\n" + text + "\n\n" + "\n".join(notes))
    return {"cells": [{k: v for k, v in r.items() if k not in ("distance", "rollout")} for r in results],
            "table": text, "same_numbers": notes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--img-size", type=int, default=None, help="build --model at this input size (speed rows)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--loop-images", type=int, default=8)
    p.add_argument("--mem-images", type=int, nargs="*", default=[64, 1024])
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--rows", nargs="*", default=None, help="time only these rows (plain_forward always)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--table", action="store_true", help="the resolution table (one process per cell) instead")
    p.add_argument("--quick", action="store_true", help="with --table: 224 px at batch 2 only (a smoke run)")
    p.add_argument("--sizes", nargs="*", default=None, help="with --table: PX:BATCH rows (default 224:16 768:4 1024:2)")
    p.add_argument("--columns", nargs="*", default=None, choices=list(TABLE_COLUMNS + CROSSOVER_COLUMNS),
                   help="with --table: these columns (default every one but the crossover pair)")
    p.add_argument("--threads", type=int, default=2, help="with --table: torch threads per cell")
    p.add_argument("--mem-cap-gb", type=float, default=20.0,
                   help="with --table: a cell estimated (or found) to need more above the model is reported as OOM")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--table-child", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--attributions", action="store_true",
                   help="instead: seconds per image of every attribution method (analyses/attribution_cost.py)")
    p.add_argument("--runs", type=int, default=1,
                   help="the speed bench this many times, each its own process, with each run's median ratios")
    p.add_argument("--goal", nargs="*", default=None, metavar="ROW=RATIO",
                   help="with --runs: ratio goals to check in every run (e.g. distance_rollout=1.20)")
    p.add_argument("--cold", action="store_true",
                   help="instead: one call per fresh process, plain and analyze alternating (analyses/bench_cold.py)")
    p.add_argument("--pairs", type=int, default=3, help="with --cold: interleaved pairs of fresh processes")
    p.add_argument("--phases", action="store_true", help="with --cold: the phases of a first and a second call")
    p.add_argument("--base", default="plain", choices=["plain", "plain_mlp_buffers"],
                   help="with --cold: the row the pairs divide analyze by")
    p.add_argument("--phase-table", action="store_true",
                   help="instead: the views' phases against their memory bounds (analyses/bench_phases.py)")
    args = p.parse_args(argv)
    if args.cold:
        from bench_cold import main as bench_cold

        goal = parse_goals(args.goal or []).get("distance_rollout")
        return bench_cold(["--model", args.model, "--img-size", str(args.img_size or 224), "--batch", str(args.batch),
                           "--threads", str(args.threads), "--pairs", str(args.pairs)]
                          + (["--goal", str(goal)] if goal is not None else []) + (["--phases"] if args.phases else [])
                          + ["--base", args.base]
                          + (["--json", str(args.json)] if args.json else []))
    if args.phase_table:
        from bench_phases import main as bench_phases

        return bench_phases(["--model", args.model, "--img-size", str(args.img_size or 224), "--batch", str(args.batch),
                             "--reps", str(args.reps), "--threads", str(args.threads)]
                            + (["--json", str(args.json)] if args.json else []))
    if args.runs > 1:
        summary = repeated_runs(args, list(sys.argv[1:] if argv is None else argv))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
        return 0
    if args.attributions:
        from attribution_cost import main as attribution_cost

        return attribution_cost(["--threads", str(args.threads)] + (["--json", str(args.json)] if args.json else []))
    if args.child is not None:
        print(json.dumps(memory_child(args.child[0], args.model, int(args.child[1]), args.batch, args.device)))
        return 0
    if args.table_child is not None:
        column, img, batch = args.table_child
        print(json.dumps(table_child(column, args.model, int(img), int(batch), args.threads, args.mem_cap_gb)))
        return 0
    report: dict[str, Any] = {}
    if args.table:
        report["table"] = table(args)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return 0
    if not args.skip_speed:
        report["speed"] = s = speed(args)
        print(json.dumps(s, indent=1))
        sec, r = s["seconds"], s["ratios"]
        if "peer_loop_per_image" not in sec:  # --rows without a peer: the rows timed, and nothing else
            print("\n| what | seconds | ratio to the plain forward |\n|---|---|---|\n" + "\n".join(
                f"| {k} | {sec[k]:.3f} | {r.get(f'{k} / plain forward', 1.0):.3f} |" for k in s["runs_seconds"]))
            own = "distance_rollout / plain_mlp_buffers"
            if own in r:
                lo, hi = s["ratio_spread"][own]
                print(f"\nthe views' own cost, distance + rollout over the plain forward with the MLP's buffers: "
                      f"{r[own]:.3f} [{lo:.2f}, {hi:.2f}]")
        else:
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
