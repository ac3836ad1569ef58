"""Train the embedded reference pair (ref-vit and ref-hybrid) on procedural shapes scenes.

Usage:
    python analyses/train_reference.py [--models ref-vit ref-hybrid] [--steps-vit 3000]
        [--steps-hybrid 2000] [--threads 1] [--state-dir runs/reference] [--out vitlens/reference/weights]

Seeded and resumable: the state (model, optimiser, step) is saved every ``--save-every``
steps under ``--state-dir``; rerunning the same command continues where it stopped. Training
data are generated on the fly: step ``s`` uses scenes ``[s*batch, (s+1)*batch)`` of the stream
seeded by ``TRAIN_SEED``; the held-out set is the stream ``HELD_OUT_SEED``, never seen in training.

Recipe (see MODEL_CARD.md and ``vitlens.reference.training``): AdamW lr 7e-4, weight decay 0.05,
5% linear warmup then cosine, label smoothing 0.1, batch 64, gradient clipping at 1.0, random
horizontal flips. ``--mpp-steps N`` first pretrains the ViT with masked patch prediction
(``analyses/locality_sweep.py`` compares recipes).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vitlens.reference.models import WEIGHTS_DIR, build_reference  # noqa: E402
from vitlens.reference.training import (  # noqa: E402
    BATCH, MaskedPatchPrediction, classification_loss, evaluate, mpp_loss, run_steps)


def train_one(name: str, steps: int, state_dir: Path, out_dir: Path, save_every: int, lr: float,
              eval_n: int = 2048, mpp_steps: int = 0) -> dict:
    torch.manual_seed(0)
    model = build_reference(name)
    seconds = 0.0
    if mpp_steps and name == "ref-vit":
        mpp = MaskedPatchPrediction(model, patch=8)
        seconds += run_steps(mpp, mpp_loss(mpp), mpp_steps, state_dir / f"{name}.mpp.state.pt", lr=1e-3,
                             save_every=save_every, desc=f"{name} mpp").seconds
    info = run_steps(model, classification_loss(model), steps, state_dir / f"{name}.state.pt", lr=lr,
                     save_every=save_every, desc=name)
    acc = evaluate(model, eval_n)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"{name}.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp),
              metadata={"name": name, "steps": str(steps), "mpp_steps": str(mpp_steps), "batch": str(BATCH)})
    tmp.replace(out_dir / f"{name}.safetensors")
    result = {"name": name, "steps": steps, "mpp_steps": mpp_steps, "images_seen": (steps + mpp_steps) * BATCH,
              "held_out_acc": acc, "eval_n": eval_n, "train_seconds": round(seconds + info.seconds, 1),
              "threads": torch.get_num_threads()}
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--steps-vit", type=int, default=3000)
    p.add_argument("--steps-hybrid", type=int, default=2000)
    p.add_argument("--mpp-steps", type=int, default=0, help="masked-patch-prediction pretraining steps of ref-vit")
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=2048, help="held-out images for the final accuracy")
    p.add_argument("--state-dir", type=Path, default=Path("runs/reference"))
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        steps = args.steps_vit if name == "ref-vit" else args.steps_hybrid
        results.append(train_one(name, steps, args.state_dir, args.out, args.save_every, args.lr, args.eval_n,
                                 args.mpp_steps))
    args.state_dir.mkdir(parents=True, exist_ok=True)
    (args.state_dir / "train_summary.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
