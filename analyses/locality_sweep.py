"""Which training recipe gives the reference pair the paper's attention-distance finding?

Usage:
    python analyses/locality_sweep.py [--recipes mpp grid16 ...] [--short] [--threads 1]
        [--state-dir runs/locality] [--eval-n 256] [--table]

Paper Fig. 7 (right) and Fig. 11: low layers of a ViT mix local and global heads, distance grows
with depth, and the hybrid (whose CNN already did local processing) has fewer local heads. Each
recipe trains a ViT (and, where the recipe changes the grid, its hybrid), then measures with
vitlens on held-out scenes:

(a) layer-1 heads: min and max mean distance / uniform-attention distance (target: >= 2 heads
    <= 0.6);
(b) depth ratio: median distance of the last layer / of the first (target >= 1.3);
(c) hybrid layer-1 median / ViT layer-1 median (target >= 1.15);
plus held-out accuracy, position-embedding neighbours - far, and rollout mass ratio in the mask.

Every run is seeded and resumable (state under --state-dir, one folder per recipe); results go
to ``results.json`` there and ``--table`` prints them as the model card's markdown table.
Training minutes are the training process's CPU time on one thread (its wall time on an idle
core), so runs sharing the machine with other work are still comparable.
``--short`` divides every step count by 20 and evaluates on fewer scenes (a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vitlens as vl  # noqa: E402
from vitlens.kinds import HYBRID, VIT  # noqa: E402
from vitlens.reference.models import build_reference, weights_path  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, ShapesBatch, generate  # noqa: E402
from vitlens.reference.training import (  # noqa: E402
    MaskedPatchPrediction, classification_loss, evaluate, mimetic_qk_init, mpp_loss, run_steps, sincos_position_init)
from vitlens.results import atomic_write_bytes  # noqa: E402


@dataclass(frozen=True)
class Recipe:
    """One way of training the pair.

    Attributes:
        name: row name in the table.
        patch: token stride in pixels (8: 8x8 grid on 64 px scenes; 4: 16x16 grid).
        mpp_steps: masked-patch-prediction pretraining steps of the ViT (0: none).
        mpp_style: scenes of the pretraining ("plain", or "field": over a strong smooth colour field).
        pos_scale: > 0 starts E_pos as 2D sin-cos rows of this norm (0: timm's random init, norm ~0.2).
        qk_gain: > 0 starts W_k = W_q (scaled by this gain) in every block (0: timm's random init).
        mpp_from: a recipe whose masked-patch phase is this one's (same seed and settings): its
            finished state is copied instead of running the phase again.
        Both initialisations apply to the ViT and to the hybrid alike.
        steps: supervised classification steps of the ViT.
        hybrid_steps: supervised steps of the hybrid (0: use the committed ref-hybrid, same grid).
        hybrid_mpp: the hybrid goes through the ViT's masked-patch phase too (same steps, scenes
            and seed; the [mask] embedding replaces its CNN's output tokens): the pair trained alike.
        lr: peak learning rate of the supervised phase.
        note: what the recipe changes.
    """

    name: str
    patch: int = 8
    mpp_steps: int = 0
    steps: int = 3000
    hybrid_steps: int = 0
    lr: float = 7e-4
    note: str = ""
    mpp_style: str = "plain"
    pos_scale: float = 0.0
    qk_gain: float = 0.0
    mpp_from: str = ""
    hybrid_mpp: bool = False


RECIPES = {r.name: r for r in [
    Recipe("baseline", steps=1200, note="today's supervised recipe, short"),
    Recipe("mpp", mpp_steps=600, steps=600, note="masked patch prediction, then fine-tuning"),
    Recipe("mpp-long", mpp_steps=1500, steps=1500, note="masked patch prediction, then fine-tuning, longer"),
    Recipe("grid16", patch=4, steps=600, hybrid_steps=600, note="16x16 tokens of 4 px"),
    Recipe("mpp-field", mpp_steps=600, steps=600, mpp_style="field",
           note="masked patch prediction on scenes over smooth colour fields, then fine-tuning"),
    Recipe("pos-sincos", steps=1200, hybrid_steps=1200, pos_scale=4.0,
           note="E_pos starts as 2D sin-cos of norm 4 (patch content is about 4)"),
    Recipe("pos-sincos-qk", steps=1200, hybrid_steps=1200, pos_scale=4.0, qk_gain=4.0,
           note="as pos-sincos, and W_k = W_q at the start"),
    Recipe("mpp-field-sincos", mpp_steps=600, steps=600, mpp_style="field", pos_scale=4.0,
           note="E_pos starts as 2D sin-cos (norm 4); masked patch prediction on colour-field scenes, then "
                "fine-tuning; the committed supervised hybrid"),
    Recipe("mpp-field-sincos-long", mpp_steps=600, steps=1800, mpp_style="field", pos_scale=4.0,
           note="the best candidate with 3x the fine-tuning (its masked-patch phase is the same run: "
                "reuses mpp-field-sincos's)", mpp_from="mpp-field-sincos"),
    Recipe("pair-alike", mpp_steps=600, steps=1800, hybrid_steps=1800, hybrid_mpp=True, mpp_style="field",
           pos_scale=4.0,
           note="mpp-field-sincos-long for both models: the hybrid gets the same sin-cos start, the same "
                "masked-patch phase over colour fields and the same supervised steps"),
]}


def scenes(n: int, seed: int, size: int, start: int, style: str = "plain") -> ShapesBatch:
    return generate(n, seed=seed, size=size, start=start, style=style)


def _stamp(recipe: Recipe, short: bool) -> Recipe:
    if not short:
        return recipe
    div = 20
    return replace(recipe, mpp_steps=max(recipe.mpp_steps // div, 0 if not recipe.mpp_steps else 5),
                   steps=max(recipe.steps // div, 5), hybrid_steps=recipe.hybrid_steps // div)


def initialise(model: torch.nn.Module, r: Recipe) -> None:
    if r.pos_scale > 0:
        sincos_position_init(model, r.pos_scale)
    if r.qk_gain > 0:
        mimetic_qk_init(model, r.qk_gain)


def distance_summary(model: torch.nn.Module, name: str, n_eval: int) -> dict:
    """Layer-1 heads and per-layer medians of attention distance, in pixels (held-out scenes)."""
    m = vl.LoadedModel.from_module(model, name=name, device="cpu")
    m.data_config.update({"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0, "interpolation": "bilinear"})
    d = vl.attention_distance(m, list(generate(n_eval, seed=HELD_OUT_SEED).images), batch_size=128)
    for p in model.parameters():
        p.requires_grad_(True)  # from_module froze them; training goes on
    return {"layer1_heads_px": d.mean_px[0].round(2).tolist(),
            "per_layer_median_px": np.median(d.mean_px, axis=1).round(2).tolist(),
            "uniform_px": float(d.uniform_px)}


def train_model(kind: str, r: Recipe, folder: Path, n_eval: int = 64) -> tuple[torch.nn.Module, float, dict | None]:
    """The recipe's ViT or hybrid (``kind``: "vit" / "hybrid"), trained or resumed.

    Returns the model, its training seconds and, after masked patch prediction, the distances
    measured before fine-tuning. Both kinds start from seed 0 with the recipe's initialisation.
    """
    seconds, after_mpp = 0.0, None
    torch.manual_seed(0)
    model = build_reference(f"ref-{kind}", patch=r.patch)
    initialise(model, r)
    if r.mpp_steps and (kind == VIT.name or r.hybrid_mpp):
        mpp = MaskedPatchPrediction(model, patch=r.patch)
        source = partial(scenes, style=r.mpp_style)
        state = folder / f"{kind}-mpp.state.pt"
        shared = folder.parent / r.mpp_from / state.name
        if r.mpp_from and shared.exists() and not state.exists():
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy2(shared, state)
        info = run_steps(mpp, mpp_loss(mpp, source=source), r.mpp_steps, state, lr=1e-3,
                         desc=f"{r.name} {kind} mpp")
        seconds += info.cpu_seconds or info.seconds
        after_mpp = {"loss": info.final_loss, **distance_summary(model, f"{r.name}/{kind}-mpp", n_eval)}
        print(f"[{r.name}] {kind} after masked patch prediction: {json.dumps(after_mpp)}", flush=True)
        model.train()
    steps = r.steps if kind == VIT.name else r.hybrid_steps
    info = run_steps(model, classification_loss(model), steps, folder / f"{kind}.state.pt", lr=r.lr,
                     desc=f"{r.name} {kind}")
    return model, seconds + (info.cpu_seconds or info.seconds), after_mpp


def train_hybrid(r: Recipe, folder: Path, n_eval: int = 64) -> tuple[torch.nn.Module, float, str, dict | None]:
    if not r.hybrid_steps:
        if r.patch != 8:
            raise SystemExit(f"recipe {r.name}: a grid other than 8x8 needs hybrid_steps")
        from safetensors.torch import load_file

        h = build_reference("ref-hybrid")
        h.load_state_dict(load_file(str(weights_path("ref-hybrid"))))
        return h, 0.0, "committed ref-hybrid", None
    h, seconds, after_mpp = train_model(HYBRID.name, r, folder, n_eval)
    how = f"{r.mpp_steps} masked-patch + " if after_mpp else ""
    return h, seconds, f"trained {how}{r.hybrid_steps} steps", after_mpp


def measure(model: torch.nn.Module, name: str, n_eval: int, n_acc: int) -> dict:
    """Everything the table needs about one model, measured with vitlens on held-out scenes."""
    from vitlens.attribution.evaluation import rollout_mask_scores
    from vitlens.views.position import neighbour_similarity

    m = vl.LoadedModel.from_module(model, name=name, device="cpu")
    m.data_config.update({"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0, "interpolation": "bilinear"})
    data = generate(n_eval, seed=HELD_OUT_SEED)
    d = vl.attention_distance(m, list(data.images), batch_size=128)
    uniform = d.uniform_px
    pos = neighbour_similarity(vl.position_similarity(m))
    roll = rollout_mask_scores(m, list(data.images), data.masks).summary()
    medians = np.median(d.mean_px, axis=1)
    return {
        "accuracy": evaluate(model, n_acc),
        "uniform_px": uniform,
        "layer1_heads_px": d.mean_px[0].round(2).tolist(),
        "per_layer_median_px": medians.round(2).tolist(),
        "layer1_min_ratio": float(d.mean_px[0].min() / uniform),
        "layer1_max_ratio": float(d.mean_px[0].max() / uniform),
        "layer1_local_heads": int((d.mean_px[0] <= 0.6 * uniform).sum()),
        "layer1_global_heads": int((d.mean_px[0] >= 0.9 * uniform).sum()),
        "depth_ratio": float(medians[-1] / medians[0]),
        "pos_neighbours_minus_far": pos["neighbours"] - pos["far_ge3"],
        "rollout_mass_ratio": roll["ratio_mean"],
    }


def run_recipe(r: Recipe, state_dir: Path, n_eval: int, n_acc: int) -> dict:
    folder = state_dir / r.name
    t0 = time.time()
    vit, vit_s, after_mpp = train_model(VIT.name, r, folder, n_eval)
    hybrid, hyb_s, hybrid_from, hybrid_after_mpp = train_hybrid(r, folder, n_eval)
    for model, kind in ((vit, "ref-vit"), (hybrid, "ref-hybrid")):
        from safetensors.torch import save

        atomic_write_bytes(folder / f"{kind}.safetensors",
                           save({k: v.contiguous() for k, v in model.state_dict().items()}))
    v = measure(vit, f"{r.name}/vit", n_eval, n_acc)
    h = measure(hybrid, f"{r.name}/hybrid", n_eval, n_acc)
    row = {
        "recipe": r.name, "note": r.note, "patch": r.patch, "mpp_steps": r.mpp_steps, "steps": r.steps,
        "hybrid": hybrid_from, "vit_train_minutes": round(vit_s / 60, 1), "hybrid_train_minutes": round(hyb_s / 60, 1),
        "vit": v, "hybrid_metrics": h, "vit_after_mpp": after_mpp,
        "hybrid_after_mpp": hybrid_after_mpp,
        "hybrid_vs_vit_layer1": h["per_layer_median_px"][0] / v["per_layer_median_px"][0],
        "wall_minutes": round((time.time() - t0) / 60, 1),
    }
    row["meets"] = meets(row)
    return row


def meets(row: dict) -> dict:
    """The conditions the embedded pair must meet (issue 24's, applied to every stored row):
    (a) >= 2 ViT layer-1 heads at <= 0.6x uniform; (b) ViT depth ratio >= 1.3; (c) hybrid layer-1
    median >= 1.15x the ViT's; both >= 93% held-out accuracy; position neighbours - far >= 0.1;
    rollout on the object >= 1.5x its area; <= 150 training minutes for the pair."""
    v, h = row["vit"], row["hybrid_metrics"]
    return {
        "a": v["layer1_local_heads"] >= 2,
        "b": v["depth_ratio"] >= 1.3,
        "c": row["hybrid_vs_vit_layer1"] >= 1.15,
        "accuracy": min(v["accuracy"], h["accuracy"]) >= 0.93,
        "position": v["pos_neighbours_minus_far"] >= 0.1,
        "rollout": min(v["rollout_mass_ratio"], h["rollout_mass_ratio"]) >= 1.5,
        "time": row["vit_train_minutes"] + row["hybrid_train_minutes"] <= 150,
    }


def table(rows: list[dict]) -> str:
    head = ("| recipe | steps (MPP + supervised) | training minutes (ViT + hybrid) | accuracy ViT / hybrid | "
            "layer-1 min / max ÷ uniform | local / global layer-1 heads | depth ratio | hybrid ÷ ViT layer 1 | "
            "meets (a) (b) (c) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        v, h, ok = r["vit"], r["hybrid_metrics"], meets(r)
        lines.append(
            f"| {r['recipe']} | {r['mpp_steps']} + {r['steps']} | {r['vit_train_minutes']} + {r['hybrid_train_minutes']}"
            f" | {100 * v['accuracy']:.1f}% / {100 * h['accuracy']:.1f}% | {v['layer1_min_ratio']:.2f} / "
            f"{v['layer1_max_ratio']:.2f} | {v['layer1_local_heads']} / {v['layer1_global_heads']} | "
            f"{v['depth_ratio']:.2f} | {r['hybrid_vs_vit_layer1']:.2f} | "
            f"{'yes' if ok['a'] else 'no'} {'yes' if ok['b'] else 'no'} {'yes' if ok['c'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--short", action="store_true", help="steps / 20 and small evaluations (smoke test)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--state-dir", type=Path, default=Path("runs/locality"))
    p.add_argument("--eval-n", type=int, default=256, help="held-out scenes for distance and rollout")
    p.add_argument("--acc-n", type=int, default=2048, help="held-out scenes for accuracy")
    p.add_argument("--table", action="store_true", help="print the table of results.json and stop")
    p.add_argument("--part", choices=("all", VIT.name, HYBRID.name), default="all",
                   help="train only one model of each recipe and stop (run the two side by side, one per "
                        "core; a later run with --part all resumes both, measures and records the row)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    state_dir = args.state_dir / ("short" if args.short else "full")
    results_file = state_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if args.table:
        print(table([results[k] for k in results]))
        return 0
    n_eval, n_acc = (32, 256) if args.short else (args.eval_n, args.acc_n)
    for name in args.recipes:
        r = _stamp(RECIPES[name], args.short)
        if args.part != "all":
            if args.part == VIT.name:
                train_model(VIT.name, r, state_dir / r.name, n_eval)
            else:
                train_hybrid(r, state_dir / r.name, n_eval)
            continue
        row = run_recipe(r, state_dir, n_eval, n_acc)
        # other sweeps may have finished meanwhile (one per core): merge into what is there now
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
        results[name] = row
        atomic_write_bytes(results_file, json.dumps(results, indent=2).encode())
        print(json.dumps({k: row[k] for k in ("recipe", "hybrid_vs_vit_layer1", "meets")}), flush=True)
        print(f"[{name}] vit layer-1 heads {row['vit']['layer1_heads_px']} (uniform {row['vit']['uniform_px']:.1f}); "
              f"per-layer medians {row['vit']['per_layer_median_px']}", flush=True)
    print(table([results[k] for k in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
