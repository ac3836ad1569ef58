"""Benchmark: a survey in one process against the same survey on a local Ray with 2 workers.

Usage:
    python analyses/survey_bench.py [--models vit_tiny_patch16_224 deit_tiny_patch16_224 ...]
        [--images 512] [--batch 32] [--shard 128] [--out runs/survey_bench]

Four random-init timm models x 512 held-out scenes (resized to each model's input) by default:
- single process: the survey's own statistics over all images, model after model, on all cores;
- local Ray: ``vl.survey`` with a worker (one thread) per core; Ray's start-up is timed apart.
Prints wall times, the images per second of each, Ray's start-up, the peak memory of each worker
(from the shards it ran) and of the single process, and checks that both give the same numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ["vit_tiny_patch16_224", "deit_tiny_patch16_224", "vit_small_patch16_224", "vit_tiny_r_s16_p8_224"]


def single_process(models: list[str], n: int, batch: int, shard: int) -> dict:
    import numpy as np
    import torch

    import vitlens as vl
    from vitlens.memory import peak_rss_mb
    from vitlens.survey import shapes_source
    from vitlens.survey.stats import DEFAULT_SURVEY_VIEW_NAMES
    from vitlens.survey.worker import run_shard, weight_views
    from vitlens.survey.sources import Shard

    source = shapes_source(n)
    out = {}
    t0 = time.perf_counter()
    for name in models:
        torch.manual_seed(0)
        m = vl.load_model(name, pretrained=False, device="cpu")
        r = run_shard(m, source, Shard(0, 0, n), DEFAULT_SURVEY_VIEW_NAMES, batch)
        weight_views(m)
        out[name] = np.asarray(r["states"]["distance"]["mean"])
    return {"seconds": time.perf_counter() - t0, "means": out,
            "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}


def on_ray(models: list[str], n: int, batch: int, shard: int, folder: Path) -> dict:
    import vitlens as vl
    from vitlens.survey import shapes_source
    from vitlens.survey.run import start_ray

    shutil.rmtree(folder, ignore_errors=True)
    ray, _, startup = start_ray(None)
    try:
        t0 = time.perf_counter()
        result = vl.survey(models, shapes_source(n), folder, batch_size=batch, shard_size=shard, pretrained=False,
                           progress=False)
        seconds = time.perf_counter() - t0
    finally:
        ray.shutdown()
    peaks = {}
    for entry in result.manifest["models"].values():
        for s in entry.get("shards", {}).values():
            peaks[s["pid"]] = max(peaks.get(s["pid"], 0.0), s["peak_rss_mb"])
    return {"seconds": seconds, "startup": startup, "result": result, "worker_peak_rss_mb": sorted(peaks.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--shard", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("runs/survey_bench"))
    args = p.parse_args(argv)
    import numpy as np

    single = single_process(args.models, args.images, args.batch, args.shard)
    ray_run = on_ray(args.models, args.images, args.batch, args.shard, args.out)
    total = len(args.models) * args.images
    for name in args.models:
        got = ray_run["result"].distance(name).mean_px  # the name as given; its weights are a column
        np.testing.assert_allclose(got, single["means"][name], rtol=1e-6)
    report = {
        "models": args.models, "images": args.images, "batch": args.batch, "shard": args.shard,
        "single_process_s": round(single["seconds"], 1), "single_threads": single["threads"],
        "single_img_per_s": round(total / single["seconds"], 1), "single_peak_rss_mb": round(single["peak_rss_mb"]),
        "ray_s": round(ray_run["seconds"], 1), "ray_img_per_s": round(total / ray_run["seconds"], 1),
        "ray_startup_s": round(ray_run["startup"], 1),
        "ray_worker_peak_rss_mb": [round(v) for v in ray_run["worker_peak_rss_mb"]],
        "same_numbers": True,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
