"""The views' own cost, phase by phase, against the plain forward they ride on, each phase beside its memory bound.

Usage:
    python analyses/bench.py --phase-table --img-size 768 --batch 4 --reps 3       # a ViT-B (the default model)
    python analyses/bench_phases.py --img-size 1024 --batch 2 --reps 2 [--json out.json]
    python analyses/bench_phases.py --model swin_base_patch4_window12_384 --img-size 768 --batch 1 --reps 2
    python analyses/bench_phases.py --model samvit_base_patch16 --img-size 1024 --batch 1 --reps 2

One process, one random-init model at ``--img-size``, one random batch. It first measures this machine's memory
bandwidth (``copy_bandwidth``: a 512 MiB float32 copy, read and write counted, the best of three). Then it times,
``--reps`` times and interleaved (the order reversed every other repetition), the base row and
``vl.analyze(m, x, views=("distance", "rollout"))``: the base is, for a timm ViT, the plain forward with its MLPs in
the workspace the views' inline capture runs them in (``plain_mlp_buffers``, so the ratio is the views' own cost),
and for the other kinds (Swin, SAM/ViTDet) the plain forward ``model(x)``.

Inside both rows the functions that make the phases are wrapped by a clock (``PhaseClock``; the wrappers are
removed after): the forward's fused attention (``F.scaled_dot_product_attention``), and in the views' call the
non-fused attention (``attention_output_in_rows``: a timm ViT's by query rows, SAM's whole maps), in it the scores
and the softmax (``attention_probs``) and the native softmax pass with the views' taps (``softmax_taps``), each
consumer's reading of the probabilities (distance's and rollout's ``on_attention``; the windowed ones'), rollout's
float16 store (``store_half``) and its chain (``rollout_row``, ``windowed_rollout_row``). Each phase's seconds are
the median over the repetitions; phases nest (the consumers read inside the attention of an inline capture), so they
do not add up to the total, and the table says what each contains.

Where the views fuse their sums into the softmax pass (a ViT from ``COMPILE_MIN_TOKENS`` = 192 tokens: the native
kernel), that pass is split apart by timing it alone on one layer's real blocks (``pass_split``): the softmax alone,
with distance's sums, with rollout's head mean too; the increments are the distance sums' and the head mean's cost,
times the layers and forwards of a call. Where rollout holds its maps in float16 (one image's float32 maps above
256 MB: 1024 px on a ViT-B), the native pass writes them itself (``SoftmaxTaps.half_mean``: no float32 map, no
``store_half``): the split then times that variant too (with rollout's float16 mean), and the head mean's share is
that variant's increment, the float16 store included; the store phase is what ``store_half`` still takes (rows the
kernel refused). Below ``COMPILE_MIN_TOKENS`` the views read the probabilities after an ATen softmax, and the same
split times those eager steps.

Each phase has the least memory traffic it needs (``least_bytes``) from S, the bytes of float32 probabilities the
consumers were handed in the call (counted by the clock), the heads H, and how rollout holds its maps: the scores'
product writes S, the softmax pass reads and writes S, P v reads S, distance's sums read S where they are a pass of
their own and only the grid's distance rows where fused into the softmax's pass, rollout's head mean writes S / H
(and reads S where not fused; S / 2H where the pass writes it in float16), its float16 store reads S / H in float32
and writes half of it (nothing where the pass writes the float16 maps), its chain reads the kept maps once. A
phase's bound is those bytes at the measured bandwidth; ``x bound`` is its time over that.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the table's phases of the views' call, and what each holds
PHASES = {
    "qk_product": "the scores' product q k^T (a ViT's inline capture by rows)",
    "scores_bias_softmax": "inline capture of whole maps (SAM): the scores' product q k^T, their relative-position "
                           "bias and the softmax, the probabilities made once",
    "softmax_pass": "the softmax pass over the scores (its share of the native pass with the taps, where fused)",
    "distance_sums": "attention distance's sums (their share of the fused pass, or the consumer's own reading)",
    "head_mean": "rollout's mean over heads (its share of the fused pass, with the float16 store where the pass "
                 "writes it, or the consumer's own reading)",
    "rollout_store": "rollout's float16 store of each layer's map (where one image's maps exceed 256 MB) as a pass of "
                     "its own (store_half)",
    "consumers_other": "the consumers' calls besides (the fused taps' results read, rows kept)",
    "pv_product_and_copies": "P v, the keys' and values' copies and the output's (the rest of the attention)",
    "scores_softmax_again": "side capture: the probabilities made a second time beside the forward's fused call",
    "rollout_chain": "rollout's chain, from the last block back",
    "rest_over_base": "inline capture (a ViT, SAM): the views' call outside its attention and chain, over the base's "
                      "work outside its fused attention; side capture: the difference of the two rows beyond the "
                      "phases timed",
}


def copy_bandwidth(mib: int = 512, reps: int = 3) -> float:
    """This machine's memory bandwidth in GB/s, as a large float32 copy sees it (bytes read plus bytes written, over
    the best of ``reps`` copies, after one that touches the pages)."""
    import torch

    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4 * n / best / 1e9


class PhaseClock:
    """Seconds spent in wrapped functions (``install``), and the bytes of probabilities the consumers were handed."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.fused_passes = 0  # softmax passes the native kernel made (its taps filled)
        self.half_passes = 0  # of those, passes that wrote rollout's float16 maps (SoftmaxTaps.half_mean)
        self.probs_bytes = 0

    def reset(self) -> None:
        self.spent, self.fused_passes, self.half_passes, self.probs_bytes = {}, 0, 0, 0

    def timed(self, fn: Callable, key: str, count_probs: bool = False, count_fused: bool = False) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if count_probs:  # a consumer's on_attention(self, layer, attn, rows)
                attn = args[2] if len(args) > 2 else kwargs["attn"]
                self.probs_bytes += attn.numel() * 4
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - start
            if count_fused and out:  # softmax_taps(scores, taps)
                self.fused_passes += 1
                self.half_passes += getattr(args[1], "half_mean", None) is not None
            return out
        return wrapper

    @contextmanager
    def install(self, sdpa: bool = False) -> Iterator["PhaseClock"]:
        """The wrappers in place for the duration (each removed after, whatever happens). ``sdpa``: time
        ``F.scaled_dot_product_attention`` too, for a plain forward only: side capture knows that function by identity
        (``vitlens.families.common.sdpa_calls``), so a wrapper in its place would hide the calls from it."""
        import torch.nn.functional as F

        import vitlens.core.attention as attention
        import vitlens.families.common.sdpa_calls as sdpa_calls
        import vitlens.families.sam as sam
        import vitlens.families.timm_vit as timm_vit
        import vitlens.views.rollout as rollout
        import vitlens.views.windowed_rollout as windowed_rollout
        from vitlens.views.distance import AttentionDistanceAccumulator
        from vitlens.views.windowed import WindowedDistanceAccumulator

        targets = [(F, "scaled_dot_product_attention", "fused_attention", {})] if sdpa else []
        targets += [(timm_vit, "attention_output_in_rows", "attention_rows", {}),
                    (sam, "attention_output_in_rows", "attention_rows", {}),
                    (attention, "attention_probs", "scores_softmax", {}),
                    (sdpa_calls, "attention_probs", "scores_softmax", {}),
                    (attention, "softmax_taps", "softmax_pass", {"count_fused": True}),
                    (AttentionDistanceAccumulator, "on_attention", "distance_reading", {"count_probs": True}),
                    (WindowedDistanceAccumulator, "on_attention", "distance_reading", {"count_probs": True}),
                    (rollout.RolloutAccumulator, "on_attention", "rollout_reading", {}),
                    (windowed_rollout.WindowedRolloutAccumulator, "on_attention", "rollout_reading", {}),
                    (rollout, "store_half", "rollout_store", {}),
                    (rollout, "rollout_row", "rollout_chain", {}),
                    (windowed_rollout, "windowed_rollout_row", "rollout_chain", {})]
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _, _ in targets]
        try:
            for owner, name, key, how in targets:
                setattr(owner, name, self.timed(getattr(owner, name), key, **how))
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


def pass_split(m: Any, batch: int, reps: int) -> dict[str, Any] | None:
    """The softmax pass of one layer, as the views' capture runs it for a timm ViT (its row blocks, the images per
    forward, the padded row stride), timed alone: softmax only, with distance's sums, with rollout's head mean too
    (the native kernel where it runs, else ATen's softmax then the eager sums and mean), and, where the kernel runs
    and rollout holds the maps in float16, with the head mean written in float16 into a [B, T, T] store as the views'
    pass writes it (``half_mean``); seconds per layer and forward, the median of ``reps``. None for a model whose
    views do not run this path."""
    import torch

    from vitlens.core.attention import padded_row_stride
    from vitlens.core.native import SoftmaxTaps, compiled_wanted, softmax_taps
    from vitlens.engine.plan import capture_plan, default_budget_mb, images_per_forward
    from vitlens.views.distance import KEY_BLOCK, per_query_distance, whole_distances
    from vitlens.views.rollout import RolloutAccumulator
    from vitlens.views.rollout_math import fuse
    from vitlens.views.rollout_store import HALF_SCALE, storage_for

    s = m.spec
    if m.family.name != "timm-vit" or not m.family.abilities(m.model).inline_rows:
        return None
    t, h, p = s.num_tokens(), s.num_heads, s.num_prefix_tokens
    held = RolloutAccumulator.for_model(m).held_bytes_per_image(t)
    sub = images_per_forward(batch, t, s.embed_dim, held)
    budget = default_budget_mb(batch, t, s.embed_dim) if sub < batch else None
    rows = capture_plan(m, sub, memory_budget_mb=budget).query_rows or t
    ld = padded_row_stride(t, torch.device("cpu"))
    buf = torch.randn(sub * h * rows * ld, generator=torch.Generator().manual_seed(0))
    distances = whole_distances(s.grid, s.stride_px, torch.device("cpu"))
    mean = torch.empty(sub, t, t)
    native = compiled_wanted(torch.device("cpu"), t)
    half = native and storage_for("auto", s.num_layers - 1, t) == "float16"  # the views' pass writes float16 maps
    store = torch.empty(sub, t, t, dtype=torch.float16) if half else None

    def one_layer(distance: bool, head_mean: bool, in_half: bool = False) -> float:
        start_t = time.perf_counter()
        for start in range(0, t, rows):
            r = min(t, start + rows) - start
            block = buf[:sub * h * r * ld].view(sub, h, r, ld)[..., :t]
            q0 = max(start, p)
            taps = SoftmaxTaps(distances=distances[q0 - p:start + r - p].contiguous() if distance else None,
                               first=q0 - start, prefix=p, key_block=KEY_BLOCK,
                               sums=torch.empty(2, sub * h, start + r - q0, dtype=torch.float64) if distance else None,
                               mean=mean[:, start:start + r] if head_mean and not in_half else None,
                               half_mean=store[:, start:start + r] if in_half and store is not None else None,
                               half_scale=HALF_SCALE)
            if not softmax_taps(block, taps):
                torch.softmax(block, dim=-1, out=block)
                if distance:
                    per_query_distance(block[:, :, q0 - start:], distances[q0 - p:start + r - p], p)
                if head_mean:
                    fuse(block, "mean", out=mean[:, start:start + r])
        return time.perf_counter() - start_t

    variants = {"softmax": (False, False, False), "softmax_distance": (True, False, False),
                "softmax_distance_mean": (True, True, False)}
    if half:
        variants["softmax_distance_half_mean"] = (True, True, True)
    for how in variants.values():  # warm-up (the kernels' load, the pages)
        one_layer(*how)
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(reps):
        for k in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            runs[k].append(one_layer(*variants[k]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"native": native, "images_per_forward": sub, "query_rows": rows, "row_stride": ld,
           "seconds_per_layer_forward": {k: round(v, 5) for k, v in med.items()},
           "distance_sums": round(med["softmax_distance"] - med["softmax"], 5),
           "head_mean": round(med["softmax_distance_mean"] - med["softmax_distance"], 5)}
    if half:
        out["head_mean_half"] = round(med["softmax_distance_half_mean"] - med["softmax_distance"], 5)
    return out


def least_bytes(phase: str, probs: int, heads: int, fused: bool, kept_fraction: float, half: bool,
                distance_rows: int, half_in_pass: bool = False) -> int | None:
    """The least bytes ``phase`` must read and write in one call (the module docstring's rules): ``probs`` float32
    bytes of probabilities handed to the consumers, ``heads``, whether the views' reading is fused into the softmax
    pass, the fraction of the layers' maps rollout keeps for its chain, whether it keeps them in float16 (and
    whether the softmax pass writes them so), and the bytes of the grid's distance rows the fused sums read. None: no
    bound stated (a phase of compute)."""
    mean = probs // heads
    return {
        "qk_product": probs,
        "softmax_pass": 2 * probs,
        "pv_product_and_copies": probs,
        "distance_sums": distance_rows if fused else probs,
        "head_mean": (mean // 2 if half_in_pass else mean) if fused else probs + mean,
        "scores_softmax_again": 3 * probs,
        "scores_bias_softmax": 3 * probs,
        "rollout_store": int(mean * kept_fraction * 1.5) if half and not half_in_pass else 0,
        "rollout_chain": int(mean * kept_fraction * (0.5 if half else 1.0)),
    }.get(phase)


def breakdown(spent: dict[str, float], split: dict | None, layers: int, forwards: int,
              half_in_pass: bool = False) -> dict[str, float]:
    """The views' phases (seconds a call) from the clock's nested ones and the pass's split (``pass_split``);
    ``half_in_pass``: the call's softmax passes wrote rollout's float16 maps (the head mean's share is then that
    variant's, the float16 store included)."""
    g = spent.get
    out: dict[str, float] = {}
    if "attention_rows" in spent and split is None:
        # inline capture of whole maps (SAM; no split of its pass): the product, the bias and the softmax (the native
        # pass included, where it runs) in one clock, the consumers' reading inside the attention (before P v)
        reading = g("distance_reading", 0.0) + g("rollout_reading", 0.0)
        out["scores_bias_softmax"] = g("scores_softmax", 0.0)
        out["distance_sums"] = g("distance_reading", 0.0)
        out["head_mean"] = g("rollout_reading", 0.0)
        out["pv_product_and_copies"] = g("attention_rows", 0.0) - g("scores_softmax", 0.0) - reading
    elif "attention_rows" in spent:  # a timm ViT's inline capture by rows
        reading = g("distance_reading", 0.0) + g("rollout_reading", 0.0)
        passes = layers * forwards
        if split is not None and split["native"]:
            out["softmax_pass"] = g("softmax_pass", 0.0)
            per = split["seconds_per_layer_forward"]
            in_half = half_in_pass and "head_mean_half" in split
            share = max(per["softmax_distance_half_mean" if in_half else "softmax_distance_mean"], 1e-12)
            out["distance_sums"] = out["softmax_pass"] * split["distance_sums"] / share
            out["head_mean"] = out["softmax_pass"] * split["head_mean_half" if in_half else "head_mean"] / share
            out["softmax_pass"] -= out["distance_sums"] + out["head_mean"]
            out["qk_product"] = g("scores_softmax", 0.0) - g("softmax_pass", 0.0)
            out["rollout_store"] = g("rollout_store", 0.0)
            out["consumers_other"] = reading - out["rollout_store"]
        else:
            soft = split["seconds_per_layer_forward"]["softmax"] * passes if split else 0.0
            out["qk_product"] = g("scores_softmax", 0.0) - soft
            out["softmax_pass"] = soft
            out["distance_sums"] = g("distance_reading", 0.0)
            out["head_mean"] = g("rollout_reading", 0.0) - g("rollout_store", 0.0)
            out["rollout_store"] = g("rollout_store", 0.0)
        out["pv_product_and_copies"] = g("attention_rows", 0.0) - g("scores_softmax", 0.0) - reading
    else:  # side capture (the other kinds): the probabilities made a second time beside the fused forward's
        out["scores_softmax_again"] = g("scores_softmax", 0.0)
        out["distance_sums"] = g("distance_reading", 0.0)
        out["head_mean"] = g("rollout_reading", 0.0)
    out["rollout_chain"] = g("rollout_chain", 0.0)
    return out


def run(model: str, img: int, batch: int, reps: int, threads: int | None = None,
        **model_kwargs: Any) -> dict[str, Any]:
    """The bench in this process (the module docstring); ``model_kwargs`` go to ``vl.load_model`` (``depth``)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    import vitlens as vl
    from vitlens.engine.plan import images_per_forward
    from vitlens.families.base import Handles
    from vitlens.families.timm_vit import mlp_in_workspace
    from vitlens.views.rollout import RolloutAccumulator
    from vitlens.views.rollout_store import storage_for

    torch.manual_seed(0)
    m = vl.load_model(model, pretrained=False, device="cpu", img_size=img, **model_kwargs)
    x = torch.randn(batch, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(0))
    vit = m.family.name == "timm-vit"
    base_name = "plain_mlp_buffers" if vit else "plain"

    def base() -> None:
        handles = Handles()
        if vit:
            mlp_in_workspace(m.model.blocks, {}, handles)
        try:
            with torch.no_grad():
                m.model(x)
        finally:
            handles.remove()

    def views() -> None:
        vl.analyze(m, x, batch_size=batch, views=("distance", "rollout"))

    bandwidth = copy_bandwidth()
    rows = {base_name: base, "views": views}
    clock = PhaseClock()
    seconds: dict[str, list[float]] = {k: [] for k in rows}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in rows}
    probs_bytes = fused = half_passes = 0
    for fn in rows.values():  # warm-up: the first call's costs (kernels' load, the distance matrix)
        fn()
    for i in range(reps):
        for k in (list(rows) if i % 2 == 0 else list(rows)[::-1]):
            clock.reset()
            with clock.install(sdpa=k == base_name):
                t0 = time.perf_counter()
                rows[k]()
                seconds[k].append(time.perf_counter() - t0)
            phases[k].append(dict(clock.spent))
            if k == "views":
                probs_bytes, fused, half_passes = clock.probs_bytes, clock.fused_passes, clock.half_passes
    split = pass_split(m, batch, max(3, reps)) if vit else None
    s = m.spec
    t = s.num_tokens()
    layers = s.num_layers
    forwards = 1
    kept_fraction, half, distance_rows = (layers - 1) / layers, False, 0
    if vit:
        acc = RolloutAccumulator.for_model(m)
        sub = images_per_forward(batch, t, s.embed_dim, acc.held_bytes_per_image(t))
        forwards = math.ceil(batch / sub)
        half = storage_for("auto", layers - 1, t) == "float16"
        n = s.grid[0] * s.grid[1]
        distance_rows = layers * forwards * n * n * 4
    med = {k: {key: statistics.median(p.get(key, 0.0) for p in phases[k]) for key in set().union(*phases[k])}
           for k in rows}
    parts = breakdown(med["views"], split, layers, forwards, half_passes > 0)
    heads = s.num_heads
    table = []
    for phase, sec in parts.items():
        need = least_bytes(phase, probs_bytes, heads, fused > 0, kept_fraction, half, distance_rows, half_passes > 0)
        if phase == "distance_sums" and fused and not vit:
            need = None  # sums fused into a windowed model's pass: the bytes of its tables are not counted here
        bound = None if need is None else need / (bandwidth * 1e9)
        table.append({"phase": phase, "seconds": round(sec, 6), "least_bytes": need,
                      "bound_seconds": None if bound is None else round(bound, 4),
                      "x_bound": None if not bound else round(sec / bound, 2)})
    # what the views' call spends outside its attention and chain, over the base's work outside its fused attention
    views_total, base_total = (statistics.median(seconds[k]) for k in ("views", base_name))
    outside = views_total - med["views"].get("attention_rows", med["views"].get("fused_attention", 0.0)) \
        - med["views"].get("rollout_chain", 0.0)
    if "attention_rows" in med["views"]:  # inline: the views' attention replaces the forward's fused one
        rest = outside - (base_total - med[base_name].get("fused_attention", 0.0))
    else:  # side capture: what the difference holds beyond the phases timed (the capture's own copies and memory)
        rest = views_total - base_total - sum(parts.values())
    table.append({"phase": "rest_over_base", "seconds": round(rest, 6), "least_bytes": None, "bound_seconds": None,
                  "x_bound": None})
    ratios = [a / b for a, b in zip(seconds["views"], seconds[base_name])]
    return {"model": model, "img_size": img, "batch": batch, "tokens": t, "heads": heads, "layers": layers,
            "threads": torch.get_num_threads(), "reps": reps, "base": base_name, "bandwidth_gb_s": round(bandwidth, 2),
            "seconds": {k: [round(v, 3) for v in vs] for k, vs in seconds.items()},
            "ratio": round(statistics.median(ratios), 3),
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "base_phases": {k: round(v, 6) for k, v in med[base_name].items()},
            "views_clock": {k: round(v, 6) for k, v in med["views"].items()},
            "probs_bytes": probs_bytes, "fused_passes": fused, "half_passes": half_passes,
            "forwards_per_call": forwards,
            "rollout_maps": "float16" if half else "float32", "pass_split": split, "phases": table}


def format_table(r: dict) -> str:
    """The run's table: the two rows' seconds and ratio, then each phase with its bound."""
    base = r["base"]
    b, v = (statistics.median(r["seconds"][k]) for k in (base, "views"))
    lo, hi = r["ratio_spread"]
    lines = [f"{r['model']} at {r['img_size']} px, batch {r['batch']} (T = {r['tokens']}), {r['threads']} threads, "
             f"{r['reps']} interleaved repetitions; copy bandwidth {r['bandwidth_gb_s']:.1f} GB/s",
             "", f"| row | seconds (median) | ÷ {base}, median [min, max] |", "|---|---|---|",
             f"| {base} | {b:.2f} | 1.00 |", f"| analyze(distance, rollout) | {v:.2f} | {r['ratio']:.3f} [{lo:.2f}, "
                                              f"{hi:.2f}] |",
             "", f"the difference: {v - b:.2f} s; the forward's fused attention in {base}: "
                 f"{r['base_phases'].get('fused_attention', 0.0):.2f} s",
             "", "| phase of the views' call | seconds | least bytes | bound at the bandwidth, s | × bound |",
             "|---|---|---|---|---|"]
    for row in r["phases"]:
        need = "—" if row["least_bytes"] is None else f"{row['least_bytes'] / 1e6:,.0f} MB"
        bound = "—" if row["bound_seconds"] is None else f"{row['bound_seconds']:.3f}"
        x = "—" if row["x_bound"] is None else f"{row['x_bound']:.1f}"
        lines.append(f"| {row['phase']} | {row['seconds']:.3f} | {need} | {bound} | {x} |")
    lines += [""] + [f"- {row['phase']}: {PHASES[row['phase']]}" for row in r["phases"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    r = run(args.model, args.img_size, args.batch, args.reps, args.threads)
    print(format_table(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
