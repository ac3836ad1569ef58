"""The cold bench (``python analyses/bench.py --cold``): one call as a user meets it, each call its own fresh process.

Usage:
    python analyses/bench.py --cold --img-size 768 --batch 4 --pairs 3 [--goal 1.20] [--phases] [--json out.json]
    python analyses/bench_cold.py --img-size 224 --batch 16 --pairs 3        # the same, run directly

Each repetition is a pair of fresh processes, one per row: the plain fused forward (``model(x)``) and
``vl.analyze(m, x, views=("distance", "rollout"))``; each process imports vitlens, loads the random-init model at
that size (``--threads`` torch threads), makes the batch, then times ONE call (the first), the call's peak being
VmHWM above the process just before it (``clear_refs``). The rows alternate (plain first in even pairs, analyze first
in odd ones), so drift falls on both alike; the ratio is the median over pairs of analyze's time / its pair's plain
time, given with the lowest and highest pair; the peak ratio likewise. ``--goal R`` says whether the median is
within R.

``--phases`` times, in each process, the first call and then a second one, phase by phase (a breakdown of what the
first call pays that the second does not): the set-up before the first block (of which the capture plan, the
native kernels' load and check, the grid's distance matrix), each block (forward hooks on the model's blocks, with
the page faults each one takes), and after the last block (the head, and rollout's chain). Timings on a machine
shared with other work are noise: read the phases' relative sizes there, and the ratios only from a quiet machine.
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("plain", "analyze")
#: the rows a pair's base may be (``--base``): the plain fused forward, or (a timm ViT) the same forward with its MLPs
#: in the workspace the views' inline capture runs them in, so the ratio is the views' own cost (issue 67)
BASES = ("plain", "plain_mlp_buffers")


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Phases:
    """Wall time of the call's phases, by wrapping the functions that make them and hooking the model's blocks."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.marks: list[tuple[float, int]] = []  # (time, page faults) at each block's start and end

    def wrap(self, module: Any, name: str, key: str) -> None:
        """Count the time of ``module.name`` (every call) under ``key``."""
        fn: Callable = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    def hook_blocks(self, blocks: Any) -> None:
        mark = lambda *_a: self.marks.append((time.perf_counter(), _faults()))  # noqa: E731
        for blk in blocks:
            blk.register_forward_pre_hook(mark)
            blk.register_forward_hook(mark)

    def reset(self) -> None:
        self.spent, self.marks = {}, []

    def summary(self, start: float, stop: float, faults: int) -> dict[str, Any]:
        """The phases of one call that ran from ``start`` to ``stop`` (perf_counter) with ``faults`` page faults."""
        starts, ends = self.marks[0::2], self.marks[1::2]
        blocks = [round(e[0] - s[0], 3) for s, e in zip(starts, ends)]
        out: dict[str, Any] = {"total": round(stop - start, 3), "faults": faults}
        if blocks:
            out.update(before_blocks=round(starts[0][0] - start, 3), blocks=round(sum(blocks), 3),
                       first_block=blocks[0], other_blocks_mean=round(statistics.mean(blocks[1:] or blocks), 3),
                       after_blocks=round(stop - ends[-1][0], 3), block_seconds=blocks,
                       block_faults=[e[1] - s[1] for s, e in zip(starts, ends)])
        out.update({k: round(v, 4) for k, v in sorted(self.spent.items())})
        return out


def child(row: str, model: str, img: int, batch: int, threads: int, calls: int, phases: bool,
          **model_kwargs: Any) -> dict:
    """One fresh process's row: import, load (``model_kwargs`` to ``vl.load_model``, e.g. ``depth``), then ``calls``
    timed calls (the first is the cold one)."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    import vitlens as vl
    from vitlens.families.base import Handles
    from vitlens.families.timm_vit import mlp_in_workspace
    from vitlens.memory import peak_rss_mb

    t1 = time.perf_counter()
    m = vl.load_model(model, pretrained=False, device="cpu", img_size=img, **model_kwargs)
    x = torch.randn(batch, 3, img, img, generator=torch.Generator().manual_seed(0))
    t2 = time.perf_counter()
    probe = Phases() if phases else None
    if probe is not None:
        import vitlens.core.native as native
        import vitlens.engine.stream as stream
        import vitlens.views.distance as distance
        import vitlens.views.rollout as rollout

        probe.wrap(native, "_load", "native_kernels_load")
        probe.wrap(stream, "capture_plan", "capture_plan")
        probe.wrap(distance, "whole_distances", "distance_matrix")
        probe.wrap(rollout, "rollout_row", "rollout_chain")
        probe.hook_blocks(m.model.blocks)
    out: dict[str, Any] = {"row": row, "img_size": img, "batch": batch, "threads": torch.get_num_threads(),
                           "import_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2), "calls": []}
    import gc

    for _ in range(calls):
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts afresh at the current resident size
        except OSError:
            pass
        before, faults = peak_rss_mb(), _faults()
        if probe is not None:
            probe.reset()
        start = time.perf_counter()
        with torch.no_grad():
            if row in BASES:
                handles = Handles()
                if row == "plain_mlp_buffers":
                    mlp_in_workspace(m.model.blocks, {}, handles)
                try:
                    m.model(x)
                finally:
                    handles.remove()
                storage = None
            else:
                storage = vl.analyze(m, x, batch_size=batch, views=("distance", "rollout")).rollout.map_storage
        stop = time.perf_counter()
        call: dict[str, Any] = {"seconds": round(stop - start, 3),
                                "peak_above_model_mb": round(peak_rss_mb() - before, 1)}
        if storage is not None:
            call["map_storage"] = storage  # how rollout held its maps (float16 where large)
        if probe is not None:
            call["phases"] = probe.summary(start, stop, _faults() - faults)
        out["calls"].append(call)
    return out


def run_child(args: argparse.Namespace, row: str, calls: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", row, "--model", args.model, "--img-size",
           str(args.img_size), "--batch", str(args.batch), "--threads", str(args.threads), "--calls", str(calls)]
    if args.phases:
        cmd.append("--phases")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"bench_cold: the {row} process failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.2f}, {max(values):.2f}]"


def phase_table(runs: list[dict], rows: tuple[str, str] = ROWS) -> str:
    """Per-phase seconds of the processes' first and second calls (the median over processes), each of ``rows``."""
    keys = ["total", "before_blocks", "capture_plan", "native_kernels_load", "distance_matrix", "blocks",
            "first_block", "other_blocks_mean", "after_blocks", "rollout_chain", "faults"]
    lines = ["| phase | " + " | ".join(f"{r} call {c}" for r in rows for c in (1, 2)) + " |", "|---|" + "---|" * 4]
    for k in keys:
        cells = []
        for row in rows:
            for c in (0, 1):
                vals = [r["calls"][c]["phases"].get(k) for r in runs if r["row"] == row and len(r["calls"]) > c]
                vals = [v for v in vals if v is not None]
                cells.append("—" if not vals else (f"{statistics.median(vals):,.0f}" if k == "faults"
                                                    else f"{statistics.median(vals):.3f}"))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cold(args: argparse.Namespace) -> dict:
    """``--pairs`` interleaved pairs of fresh processes; the table of ratios (and phases with ``--phases``)."""
    calls = 2 if args.phases else 1
    rows = (args.base, "analyze")
    pairs, runs = [], []
    for i in range(args.pairs):
        order = rows if i % 2 == 0 else rows[::-1]
        got = {row: run_child(args, row, calls) for row in order}
        runs += list(got.values())
        p, a = got[args.base]["calls"][0], got["analyze"]["calls"][0]
        pairs.append({"plain_s": p["seconds"], "analyze_s": a["seconds"],
                      "ratio": round(a["seconds"] / p["seconds"], 3),
                      "plain_peak_mb": p["peak_above_model_mb"], "analyze_peak_mb": a["peak_above_model_mb"],
                      "peak_ratio": round(a["peak_above_model_mb"] / max(p["peak_above_model_mb"], 1.0), 3),
                      "map_storage": a.get("map_storage")})
        if calls > 1:  # the second call in each process: the warm pair
            p2, a2 = got[args.base]["calls"][1], got["analyze"]["calls"][1]
            pairs[-1].update(plain_warm_s=p2["seconds"], analyze_warm_s=a2["seconds"],
                             warm_ratio=round(a2["seconds"] / p2["seconds"], 3))
        print(json.dumps(pairs[-1]), flush=True)
    ratios, peaks = [q["ratio"] for q in pairs], [q["peak_ratio"] for q in pairs]
    median = statistics.median(ratios)
    met = None if args.goal is None else median <= args.goal
    print(f"\ncold: {args.model} at {args.img_size} px, batch {args.batch}, {args.threads} threads, {args.pairs} "
          f"interleaved pairs of fresh processes (one call each)\n")
    print(f"| row | seconds (median) | ÷ {args.base}, median [min, max] | peak above the model, MB | peak ÷ "
          f"{args.base}'s |")
    print("|---|---|---|---|---|")
    base_title = "plain fused forward" if args.base == "plain" else args.base
    print(f"| {base_title} | {statistics.median(q['plain_s'] for q in pairs):.2f} | 1.00 | "
          f"{statistics.median(q['plain_peak_mb'] for q in pairs):,.0f} | 1.00 |")
    print(f"| `analyze(distance, rollout)` | {statistics.median(q['analyze_s'] for q in pairs):.2f} | "
          f"{spread(ratios)} | "
          f"{statistics.median(q['analyze_peak_mb'] for q in pairs):,.0f} | {spread(peaks)} |")
    if calls > 1:
        warm = [q["warm_ratio"] for q in pairs]
        print(f"| second call in the same processes (warm) | "
              f"{statistics.median(q['analyze_warm_s'] for q in pairs):.2f} (plain "
              f"{statistics.median(q['plain_warm_s'] for q in pairs):.2f}) | {spread(warm)} | | |")
    print(f"\nrollout's maps held in: {sorted({str(q['map_storage']) for q in pairs})}; the plain forward's "
          f"seconds over the pairs: {spread([q['plain_s'] for q in pairs])} (the noise row)")
    if met is not None:
        print(f"\ngoal <= {args.goal:.2f}: {'met' if met else 'not met'} (median {median:.3f})")
    summary: dict[str, Any] = {"mode": "cold", "base": args.base, "model": args.model, "img_size": args.img_size,
                               "batch": args.batch,
                               "threads": args.threads, "pairs": pairs, "median_ratio": round(median, 3),
                               "median_peak_ratio": round(statistics.median(peaks), 3), "goal": args.goal,
                               "goal_met": met}
    if args.phases:
        table = phase_table(runs, rows)
        print("\nPhases (seconds; the median over processes; faults: page faults of the call)\n\n" + table)
        summary["phases"] = [{"row": r["row"], "calls": [c.get("phases") for c in r["calls"]]} for r in runs]
        summary["phase_table"] = table
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=3, help="interleaved pairs of fresh processes")
    p.add_argument("--goal", type=float, default=None, help="the ratio analyze ÷ plain the median must be within")
    p.add_argument("--phases", action="store_true", help="time the phases of a first and a second call per process")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--base", choices=BASES, default="plain",
                   help="the row analyze is divided by: the plain forward, or with the MLP's buffers (a timm ViT)")
    p.add_argument("--child", choices=ROWS + BASES[1:], default=None, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=1, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.model, args.img_size, args.batch, args.threads, args.calls,
                               args.phases)))
        return 0
    summary = cold(args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
