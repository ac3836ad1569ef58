"""Training recipes of the reference pair: supervised classification of shape scenes and the
ViT paper's masked patch prediction (appendix B.1.2), both seeded and resumable.

Serves the reference models that let Fig. 6, 7 and 11 be shown offline. Every step ``s`` of a
run draws scenes ``[s * batch, (s + 1) * batch)`` of its own training stream, so a run that
stops and resumes sees exactly the data of an uninterrupted one; the held-out stream
``HELD_OUT_SEED`` is never trained on.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .shapes import HELD_OUT_SEED, IMAGE_SIZE, ShapesBatch, generate

TRAIN_SEED = 1000
MPP_SEED = 2000
BATCH = 64

SceneSource = Callable[[int, int, int, int], ShapesBatch]  # (n, seed, size, start) -> scenes


def shapes_source(n: int, seed: int, size: int, start: int) -> ShapesBatch:
    return generate(n, seed=seed, size=size, start=start)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float [n, 3, H, W] normalised with the models' mean = std = 0.5."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    return (x - 0.5) / 0.5


def lr_at(step: int, total: int, base: float, warmup_frac: float = 0.05) -> float:
    """Linear warm-up over ``warmup_frac`` of the steps, then cosine decay to 0."""
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: nn.Module, n: int = 2048, size: int = IMAGE_SIZE,
             source: SceneSource = shapes_source) -> float:
    """Held-out accuracy on the first ``n`` scenes of the held-out stream."""
    was_training = model.training
    model.eval()
    data = source(n, HELD_OUT_SEED, size, 0)
    correct = 0
    for i in range(0, n, 256):
        logits = model(to_tensor(data.images[i: i + 256]))
        correct += int((logits.argmax(-1).numpy() == data.labels[i: i + 256]).sum())
    model.train(was_training)
    return correct / n


def mean_colour_classes(images: np.ndarray, patch: int, bits: int = 3) -> torch.Tensor:
    """The paper's masked-patch target: each patch's mean colour, ``bits`` bits per channel.

    uint8 [B, H, W, 3] -> long [B, N] in [0, 2 ** (3 * bits)), patches row-major.
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    mean = F.avg_pool2d(x, patch)  # [B, 3, gh, gw]
    levels = 2 ** bits
    q = (mean * levels).floor().clamp_(0, levels - 1).long()
    cls = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
    return cls.flatten(1)


class MaskedPatchPrediction(nn.Module):
    """Self-supervised masked patch prediction (ViT paper, appendix B.1.2) around a timm ViT.

    Half of the patch embeddings are corrupted: 80% of those replaced by a learned [mask]
    embedding, 10% by the embedding of a random other patch, 10% left unchanged; the model
    predicts the 3-bit mean colour (512 classes) of every corrupted patch from the encoder's
    output token at that position.
    """

    def __init__(self, vit: nn.Module, patch: int, corrupt: float = 0.5, bits: int = 3) -> None:
        super().__init__()
        self.vit = vit
        self.patch = patch
        self.corrupt = corrupt
        self.bits = bits
        dim = vit.embed_dim
        self.mask_token = nn.Parameter(torch.zeros(dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = nn.Linear(dim, 2 ** (3 * bits))

    def forward(self, x: torch.Tensor, images: np.ndarray, generator: torch.Generator) -> torch.Tensor:
        vit = self.vit
        tokens = vit.patch_embed(x)  # [B, N, D]
        b, n, _ = tokens.shape
        corrupt = torch.rand(b, n, generator=generator) < self.corrupt
        how = torch.rand(b, n, generator=generator)
        use_mask = corrupt & (how < 0.8)
        use_other = corrupt & (how >= 0.8) & (how < 0.9)
        others = tokens.reshape(b * n, -1)[torch.randint(0, b * n, (b, n), generator=generator)]
        tokens = torch.where(use_mask[..., None], self.mask_token.expand_as(tokens), tokens)
        tokens = torch.where(use_other[..., None], others, tokens)
        h = vit.norm(vit.blocks(vit.norm_pre(vit.patch_drop(vit._pos_embed(tokens)))))
        logits = self.head(h[:, vit.num_prefix_tokens:])
        target = mean_colour_classes(images, self.patch, self.bits)
        return F.cross_entropy(logits[corrupt], target[corrupt])


@torch.no_grad()
def sincos_position_init(vit: nn.Module, scale: float, temperature: float | None = None) -> None:
    """Start E_pos's patch rows as 2D sin-cos embeddings of norm ``scale`` (still learned afterwards).

    Nearby patches then start with similar position embeddings, and a ``scale`` comparable to the
    patch content makes position visible to attention from the first step. ``temperature``
    defaults to twice the grid side, so the frequencies span the grid.
    """
    from timm.layers import build_sincos2d_pos_embed

    gh, gw = (int(g) for g in vit.patch_embed.grid_size)
    table = build_sincos2d_pos_embed([gh, gw], dim=vit.embed_dim, temperature=temperature or 2.0 * max(gh, gw))
    table = table / table.norm(dim=-1, keepdim=True) * scale
    prefix = vit.pos_embed.shape[1] - gh * gw
    vit.pos_embed[0, prefix:] = table.to(vit.pos_embed.dtype)


@torch.no_grad()
def mimetic_qk_init(vit: nn.Module, gain: float) -> None:
    """Queries and keys start equal, W_k = W_q (scaled by ``gain``), so W_q W_k^T is positive
    semi-definite and each token first attends to tokens like itself (the "mimetic" idea of
    Trockman & Kolter, 2023, in its simplest form)."""
    for block in vit.blocks:
        qkv = block.attn.qkv
        d = qkv.weight.shape[0] // 3
        qkv.weight[:d] *= gain
        qkv.weight[d:2 * d] = qkv.weight[:d]
        if qkv.bias is not None:
            qkv.bias[d:2 * d] = qkv.bias[:d]


@dataclass
class RunInfo:
    """What a finished run reports.

    ``seconds`` is wall time; ``cpu_seconds`` is the process's CPU time, which for a run on one
    thread is its wall time on an otherwise idle core (it does not count time the process
    waited for a busy CPU, or was paused).
    """

    steps: int
    images_seen: int
    seconds: float
    final_loss: float
    cpu_seconds: float = 0.0


def run_steps(
    module: nn.Module,
    loss_fn: Callable[[int], torch.Tensor],
    steps: int,
    state_file: Path,
    lr: float = 7e-4,
    weight_decay: float = 0.05,
    save_every: int = 100,
    desc: str = "train",
    batch: int = BATCH,
) -> RunInfo:
    """AdamW with warm-up + cosine over ``steps``, gradient clipping at 1.0, resumable.

    ``loss_fn(step)`` builds the batch of that step and returns its loss. The state (module,
    optimiser, step, elapsed seconds) is written atomically to ``state_file`` every
    ``save_every`` steps; a rerun with the same arguments continues from it.
    """
    from tqdm import tqdm

    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    step, elapsed, cpu = 0, 0.0, 0.0
    if state_file.exists():
        state = torch.load(state_file, weights_only=True)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["opt"])
        step, elapsed, cpu = int(state["step"]), float(state["elapsed"]), float(state.get("cpu", 0.0))
        print(f"[{desc}] resuming at step {step}", flush=True)
    module.train()
    losses: list[float] = []
    bar = tqdm(total=steps, initial=step, desc=desc, mininterval=10, file=sys.stdout)
    t0, c0 = time.time(), time.process_time()
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
        if step % save_every == 0 or step == steps:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_file.with_suffix(".tmp")
            torch.save({"module": module.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": elapsed + time.time() - t0, "cpu": cpu + time.process_time() - c0}, tmp)
            tmp.replace(state_file)
    bar.close()
    elapsed += time.time() - t0
    cpu += time.process_time() - c0
    if state_file.exists():
        saved = torch.load(state_file, weights_only=True)
        elapsed, cpu = max(elapsed, float(saved["elapsed"])), max(cpu, float(saved.get("cpu", 0.0)))
    return RunInfo(steps=steps, images_seen=steps * batch, seconds=elapsed,
                   final_loss=float(np.mean(losses[-50:])) if losses else float("nan"), cpu_seconds=cpu)


def classification_loss(model: nn.Module, size: int = IMAGE_SIZE, seed: int = TRAIN_SEED, batch: int = BATCH,
                        source: SceneSource = shapes_source) -> Callable[[int], torch.Tensor]:
    """Step -> cross-entropy (label smoothing 0.1) on that step's scenes, with random h-flips."""

    def loss(step: int) -> torch.Tensor:
        data = source(batch, seed, size, step * batch)
        x = to_tensor(data.images)
        flip = torch.from_numpy(np.random.default_rng([seed, step, 1]).random(batch) < 0.5)
        x[flip] = x[flip].flip(-1)
        return F.cross_entropy(model(x), torch.from_numpy(data.labels), label_smoothing=0.1)

    return loss


def mpp_loss(mpp: MaskedPatchPrediction, size: int = IMAGE_SIZE, seed: int = MPP_SEED, batch: int = BATCH,
             source: SceneSource = shapes_source) -> Callable[[int], torch.Tensor]:
    """Step -> masked-patch-prediction loss on that step's scenes (random h-flips)."""

    def loss(step: int) -> torch.Tensor:
        data = source(batch, seed, size, step * batch)
        images = data.images
        flip = np.random.default_rng([seed, step, 1]).random(batch) < 0.5
        images = np.where(flip[:, None, None, None], images[:, :, ::-1], images)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return mpp(to_tensor(images), images, g)

    return loss
