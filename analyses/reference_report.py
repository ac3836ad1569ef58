"""Measure the embedded reference pair with vitlens: the numbers of MODEL_CARD.md.

Usage:
    python analyses/reference_report.py [--n-rollout 512] [--n-distance 256] [--out reference_measurements.json]

Held-out data: ``vitlens.reference.shapes.generate(n, seed=HELD_OUT_SEED)`` (never seen in training).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vitlens as vl  # noqa: E402
from vitlens.attribution.evaluation import accuracy, rollout_mask_scores  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402
from vitlens.views.position import neighbour_similarity  # noqa: E402


def measure(name: str, n_acc: int, n_rollout: int, n_distance: int) -> dict:
    t0 = time.perf_counter()
    m = vl.load_model(name)
    load_s = time.perf_counter() - t0
    data = generate(max(n_acc, n_rollout, n_distance), seed=HELD_OUT_SEED)
    out: dict = {"name": name, "load_seconds": round(load_s, 3), "params": m.spec.num_params}
    out["held_out_accuracy"] = accuracy(m, data.images[:n_acc], data.labels[:n_acc])
    out["n_accuracy"] = n_acc
    out["position"] = neighbour_similarity(vl.position_similarity(m))
    out["position_norm_mean"] = float(m.model.pos_embed[0, m.spec.pos_embed_prefix:].norm(dim=-1).mean())
    for discard in (0.0, 0.9):
        scores = rollout_mask_scores(m, data.images[:n_rollout], data.masks[:n_rollout], discard_ratio=discard)
        out[f"rollout_discard_{discard}"] = scores.summary()
    d = vl.attention_distance(m, data.images[:n_distance], batch_size=128)
    uniform = d.uniform_px
    out["distance"] = {
        "n_images": d.n_images,
        "uniform_px": uniform,
        "per_layer_min": d.mean_px.min(1).round(2).tolist(),
        "per_layer_median": np.median(d.mean_px, 1).round(2).tolist(),
        "per_layer_max": d.mean_px.max(1).round(2).tolist(),
        "layer1_heads": d.mean_px[0].round(2).tolist(),
    }
    f = vl.embedding_filter_pca(m, n_components=min(28, vl.views.filters.max_filter_components(m)))
    out["filters"] = {"source": f.source, "top5_explained_variance": f.explained_variance_ratio[:5].round(4).tolist(),
                      "top28_total": float(f.explained_variance_ratio.sum())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--n-accuracy", type=int, default=2048)
    p.add_argument("--n-rollout", type=int, default=512)
    p.add_argument("--n-distance", type=int, default=256)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = [measure(n, args.n_accuracy, args.n_rollout, args.n_distance) for n in args.models]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
