"""The SAE's cost and figures (issue 66): training throughput against the forward alone, where the time goes, the
held-out figures of ``vl.evaluate_sae``, and what a Ray Data worker that dies mid-epoch does to the SAE.

Usage:
    python analyses/sae_bench.py [--models ref-vit ref-hybrid] [--train 2048] [--held-out 512] [--epochs 2]
        [--features 512] [--k 16] [--batch 64] [--ray] [--kill] [--out runs/sae_bench.json]

Throughput, in one run per model, on the same images and batches:

- ``forward``: the model's forward alone (``LoadedModel.forward``), tokens per second of the site's selected tokens;
- ``stream``: the forward with the site read (``iter_site_batches`` + ``select_tokens``: what the trainer is fed);
- ``train``: ``vl.train_sae`` end to end (forward, site read, one SAE step per batch);
- ``step``: the SAE steps alone (``SAETrainer.step`` on the same batches, held in memory), and its parts measured
  on one batch: encode (pre-activations + TopK), decode, loss + AuxK, backward, Adam, decoder normalisation.

Held-out: each model's SAE at its middle block's output (patch tokens) and at its last block's output (every token:
the layer its classifier reads, through the class token), trained on scenes of the training stream (seed 1000; the
first epoch's tokens cached for the second), evaluated on the held-out stream (``HELD_OUT_SEED``).

``--ray``: the same training on Ray Data with two workers against one process (equal weights?). ``--kill``: the
same, with a worker that exits its process (``os._exit``) while it holds a batch, once: Ray Data restarts the actor
and runs that batch again; the SAE is compared with the undisturbed one and the time lost is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import vitlens as vl
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.sae.activations import iter_site_batches, select_tokens
from vitlens.sae.ray_train import SiteForward
from vitlens.sae.result import new_config
from vitlens.sae.trainer import SAETrainer


class DyingForward(SiteForward):
    """``SiteForward`` whose process exits while it holds the batch ``DIE_AT``, the first time only (a marker file
    says it happened)."""

    DIE_AT = 3
    MARK = ""  # set before the run: a __main__ class travels to the workers by value, its attributes with it

    def __call__(self, row):
        marker = Path(self.MARK)
        if int(row["batch"][0]) == self.DIE_AT and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return super().__call__(row)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def step_parts(trainer: SAETrainer, x: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """Seconds per step of each part of ``SAETrainer.step``, on one batch (median of ``repeats``)."""
    sae = trainer.sae
    parts: dict[str, list[float]] = {k: [] for k in ("encode", "decode", "loss", "backward", "adam", "normalise")}
    for _ in range(repeats):
        t = time.perf_counter()
        pre = sae.pre_acts(x)
        z = sae.activate(pre)
        t1 = time.perf_counter()
        recon = sae.decode(z)
        t2 = time.perf_counter()
        loss = (recon - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
        dead = torch.ones(sae.n_features, dtype=torch.bool)
        dead[: sae.n_features // 2] = False  # AuxK over half the features: its cost where many are dead
        loss = loss + trainer.aux_coef * trainer._aux_loss(x, recon, pre, dead)
        t3 = time.perf_counter()
        trainer.opt.zero_grad(set_to_none=True)
        loss.backward()
        t4 = time.perf_counter()
        trainer.opt.step()
        t5 = time.perf_counter()
        sae.normalize_decoder()
        t6 = time.perf_counter()
        for k, v in zip(parts, (t1 - t, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            v_list = parts[k]
            v_list.append(v)
    return {k: float(np.median(v)) for k, v in parts.items()}


def bench_model(name: str, args: argparse.Namespace) -> dict:
    m = vl.load_model(name)
    site = f"blocks.{m.spec.num_layers - 1}.hook_resid_post"
    x = m.preprocess(list(generate(args.train, seed=1000).images))
    held = m.preprocess(list(generate(args.held_out, seed=HELD_OUT_SEED).images))
    tokens = sum(select_tokens(b.acts, b.prefix, "patches").shape[0] for b in iter_site_batches(m, x[:1], site))
    n_tok = tokens * len(x)

    with torch.no_grad():
        m.forward(x[: args.batch])  # warm-up: first-call costs out of every figure

    def forward_only():
        with torch.no_grad():
            for i in range(0, len(x), args.batch):
                m.forward(x[i:i + args.batch])
    _, t_forward = timed(forward_only)
    batches, t_stream = timed(lambda: [select_tokens(b.acts, b.prefix, "patches")
                                       for b in iter_site_batches(m, x, site, args.batch)])
    r, t_train = timed(lambda: vl.train_sae(m, x, site=site, n_features=args.features, k=args.k, epochs=1,
                                            batch_size=args.batch, seed=0))
    trainer = SAETrainer(new_config(batches[0].shape[1], args.features, args.k, "topk", 0.0, site, "patches", m, 0))
    _, t_steps = timed(lambda: [trainer.step(b) for b in batches])
    parts = step_parts(trainer, batches[0])
    held_out = []
    # the middle block's patch tokens, and the last block's every token (its class token is what the head reads:
    # an SAE of its patch tokens alone changes nothing downstream, KL 0 exactly)
    for where, tokens in ((f"blocks.{m.spec.num_layers // 2}.hook_resid_post", "patches"), (site, "all")):
        t0 = time.perf_counter()
        full = vl.train_sae(m, x, site=where, tokens=tokens, n_features=args.features, k=args.k, epochs=args.epochs,
                            batch_size=args.batch, seed=0, cache_bytes=1 << 30)
        t_full = time.perf_counter() - t0
        ev = vl.evaluate_sae(m, full, held, batch_size=args.batch)
        held_out.append({"site": where, "tokens": tokens, "train_s": t_full, "cached_batches": full.cached_batches,
                         "train_fvu_last": float(full.fvu[-1]), **{r["measure"]: r["value"] for r in ev.to_rows()}})
    out = {
        "model": name, "site": site, "images": len(x), "tokens": n_tok, "threads": torch.get_num_threads(),
        "tokens_per_s": {"forward": n_tok / t_forward, "stream": n_tok / t_stream, "train": n_tok / t_train,
                         "step": n_tok / t_steps},
        "seconds": {"forward": t_forward, "stream": t_stream, "train": t_train, "step": t_steps},
        "step_parts_ms": {k: 1000 * v for k, v in parts.items()},
        "sae": {"n_features": args.features, "k": args.k, "epochs": args.epochs, "held_out_images": args.held_out},
        "held_out": held_out,
    }
    if args.ray or args.kill:
        out["ray"] = ray_runs(m, x[: min(len(x), 512)], site, args)
    return out


def ray_runs(m, x, site: str, args: argparse.Namespace) -> dict:
    from vitlens.sae.ray_train import train_sae_ray
    from vitlens.survey.ray_setup import restore_local_env, start_ray

    kw = dict(site=site, n_features=args.features, k=args.k, kind="topk", tokens="patches", epochs=1,
              batch_size=args.batch, lr=1e-3, seed=0, l1=0.0, dead_after=100_000, aux_coef=1 / 32)
    one, t_one = timed(lambda: vl.train_sae(m, x, **{k: v for k, v in kw.items() if k not in ("l1",)}))
    ray, _, t_start = start_ray(None, num_cpus=os.cpu_count())
    res: dict = {"images": len(x), "ray_start_s": t_start, "one_process_s": t_one}
    try:
        two, t_two = timed(lambda: train_sae_ray(m, x, workers=2, **kw))
        res.update(two_workers_s=t_two, equal_to_one_process=all(
            np.array_equal(getattr(one, n), getattr(two, n)) for n in ("W_enc", "b_enc", "W_dec", "b_dec")),
            max_abs_diff=max(float(np.abs(getattr(one, n) - getattr(two, n)).max())
                             for n in ("W_enc", "b_enc", "W_dec", "b_dec")))
        if args.kill:
            with tempfile.TemporaryDirectory() as d:
                DyingForward.MARK = str(Path(d) / "died")
                killed, t_killed = timed(lambda: train_sae_ray(m, x, workers=2, forward_class=DyingForward, **kw))
                res.update(worker_died=(Path(d) / "died").exists(), killed_run_s=t_killed,
                           killed_equal_to_one_process=all(np.array_equal(getattr(one, n), getattr(killed, n))
                                                           for n in ("W_enc", "b_enc", "W_dec", "b_dec")),
                           killed_steps=len(killed.fvu), steps=len(one.fvu))
    finally:
        ray.shutdown()
        restore_local_env()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--train", type=int, default=2048)
    p.add_argument("--held-out", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ray", action="store_true")
    p.add_argument("--kill", action="store_true")
    p.add_argument("--out", type=Path, default=Path("runs/sae_bench.json"))
    args = p.parse_args()
    results = [bench_model(name, args) for name in args.models]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
