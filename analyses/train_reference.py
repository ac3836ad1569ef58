"""Train the embedded reference pair (ref-vit and ref-hybrid) on procedural shapes scenes.

Usage:
    python analyses/train_reference.py [--models ref-vit ref-hybrid] [--steps-vit 3000]
        [--steps-hybrid 2000] [--threads 1] [--state-dir runs/reference] [--out vitlens/weights]

Seeded and resumable: the state (model, optimiser, step) is saved every ``--save-every``
steps under ``--state-dir``; rerunning the same command continues where it stopped. Training
data are generated on the fly: step ``s`` of model ``name`` uses scenes
``[s*batch, (s+1)*batch)`` of the stream seeded by ``TRAIN_SEED``; the held-out set is the
stream ``vitlens.shapes.HELD_OUT_SEED``, never seen in training.

Recipe (see MODEL_CARD.md): AdamW lr 7e-4, weight decay 0.05, 5% linear warmup then cosine,
label smoothing 0.1, batch 64, gradient clipping at 1.0, random horizontal flips.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vitlens.reference import build_reference  # noqa: E402
from vitlens.shapes import HELD_OUT_SEED, generate  # noqa: E402

TRAIN_SEED = 1000
BATCH = 64


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float [n, 3, H, W] normalised with the models' mean/std 0.5."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return (x - 0.5) / 0.5


def lr_at(step: int, total: int, base: float, warmup_frac: float = 0.05) -> float:
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: torch.nn.Module, n: int = 2048) -> float:
    model.eval()
    data = generate(n, seed=HELD_OUT_SEED)
    correct = 0
    for i in range(0, n, 256):
        logits = model(to_tensor(data.images[i : i + 256]))
        correct += int((logits.argmax(-1).numpy() == data.labels[i : i + 256]).sum())
    model.train()
    return correct / n


def train_one(name: str, steps: int, state_dir: Path, out_dir: Path, save_every: int, lr: float,
              eval_n: int = 2048) -> dict:
    torch.manual_seed(0)
    model = build_reference(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    state_file = state_dir / f"{name}.state.pt"
    step, elapsed = 0, 0.0
    if state_file.exists():
        state = torch.load(state_file, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = int(state["step"]), float(state["elapsed"])
        print(f"[{name}] resuming at step {step}", flush=True)
    model.train()
    bar = tqdm(total=steps, initial=step, desc=name, mininterval=10, file=sys.stdout)
    t0 = time.time()
    losses: list[float] = []
    while step < steps:
        data = generate(BATCH, seed=TRAIN_SEED, start=step * BATCH)
        x = to_tensor(data.images)
        flip = torch.from_numpy(np.random.default_rng([TRAIN_SEED, step, 1]).random(BATCH) < 0.5)
        x[flip] = x[flip].flip(-1)
        y = torch.from_numpy(data.labels)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        if step % 100 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.3f}")
        if step % save_every == 0 or step == steps:
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = state_file.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                 "elapsed": elapsed + time.time() - t0},
                tmp,
            )
            tmp.replace(state_file)
            if step % (save_every * 4) == 0 or step == steps:
                print(f"[{name}] step {step} loss {np.mean(losses[-100:]):.3f} "
                      f"held-out acc {evaluate(model, min(512, eval_n)):.3f}", flush=True)
    bar.close()
    elapsed += time.time() - t0
    acc = evaluate(model, eval_n)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tmp = out_dir / f"{name}.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"name": name, "steps": str(steps), "batch": str(BATCH)})
    tmp.replace(out_dir / f"{name}.safetensors")
    info = {"name": name, "steps": steps, "images_seen": steps * BATCH, "held_out_acc": acc, "eval_n": eval_n,
            "train_seconds": round(elapsed, 1), "threads": torch.get_num_threads()}
    print(json.dumps(info), flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--steps-vit", type=int, default=3000)
    p.add_argument("--steps-hybrid", type=int, default=2000)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=2048, help="held-out images for the final accuracy")
    p.add_argument("--state-dir", type=Path, default=Path("runs/reference"))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "vitlens" / "weights")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        steps = args.steps_vit if name == "ref-vit" else args.steps_hybrid
        results.append(train_one(name, steps, args.state_dir, args.out, args.save_every, args.lr, args.eval_n))
    args.state_dir.mkdir(parents=True, exist_ok=True)
    (args.state_dir / "train_summary.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
