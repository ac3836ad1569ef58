"""Every attribution method against the same method called directly in its own library (issue 35): seconds
per image of ``vl.attribute`` beside captum's ``Saliency`` / ``InputXGradient`` / ``IntegratedGradients`` /
``Occlusion``, pytorch-grad-cam's CAM classes called as their README shows (one batched call, targets given),
and a plain per-image autograd loop for the gradient rollout; each batched as its library allows.

Usage:
    python analyses/attribution_peers.py [--models ref-vit ref-hybrid vit_base_patch16_224] [--batch 16]
        [--reps 3] [--json peers.json]

Fair by construction: one preprocessed batch and fixed targets for both sides (finding the prediction costs a
forward that both would pay; ``vl.attribute`` with ``target=None`` pays it, the rows here give targets), the
rows of one method interleaved within each repetition (vitlens, peer, then peer, vitlens in the next), the
ratio per repetition, its median and spread. Each row also says how far the two maps agree once the peer's
pixel attribution is reduced to the patch grid as vitlens reduces it (``core.resample.pixels_to_grid``), so
a fast row that computed something else would show. Run it alone (no test suite beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vitlens as vl  # noqa: E402
from vitlens.attribution import METHOD_TABLE  # noqa: E402
from vitlens.attribution.cam import CAM_CLASSES, default_target_layer, resolve_target_layer  # noqa: E402
from vitlens.core.resample import pixels_to_grid  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402

#: per model, methods not run by default and why (their cost grows with tokens or channels on a CPU)
DEFAULT_SKIP = {"vit_base_patch16_224": {
    "occlusion": "one forward per token: 196 / 16 forwards of the batch",
    "scorecam": "one forward per channel: 768 / 64 forwards of 64 masked images per image"}}
#: methods without a peer a user would call instead, and why
NO_PEER = {
    "rollout": "the rollout view itself (analyses/bench.py times it against timm's AttentionExtract)",
    "attnlrp": "lxt 2.1 has no efficient mode for timm ViTs (tests/test_lrp.py patches one with lxt's rules)",
    "attnlrp_gamma": "as attnlrp", "cp_lrp": "as attnlrp"}


def captum_peer(method: str, m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The captum call a user makes for ``method``, with vitlens's parameters (returns the pixel attribution)."""
    import captum.attr as ca

    p = METHOD_TABLE[method].defaults
    forward = m.model

    def run() -> torch.Tensor:
        inp = x.detach().clone().requires_grad_(method != "occlusion")
        if method == "saliency":
            return ca.Saliency(forward).attribute(inp, target=t, abs=True)
        if method == "input_x_gradient":
            return ca.InputXGradient(forward).attribute(inp, target=t)
        if method == "integrated_gradients":
            return ca.IntegratedGradients(forward).attribute(inp, baselines=torch.zeros_like(inp), target=t,
                                                             n_steps=int(p["n_steps"]), internal_batch_size=len(inp))
        sy, sx = m.spec.stride_px
        with torch.no_grad():
            return ca.Occlusion(forward).attribute(inp, sliding_window_shapes=(3, sy, sx), strides=(3, sy, sx),
                                                   baselines=0.0, target=t,
                                                   perturbations_per_eval=int(p["perturbations_per_eval"]))
    return run


def cam_peer(method: str, m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> Callable[[], Any]:
    """pytorch-grad-cam's class for ``method`` called as its README shows: the model, the same target layer and
    reshape, one batched call with ClassifierOutputTarget per image (it returns maps resized to the input)."""
    import pytorch_grad_cam as pkg
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    name = default_target_layer(m)
    layer = resolve_target_layer(m, name)
    grid = m.grid_for(x.shape[-2:])

    prefix, (gh, gw) = m.spec.num_prefix_tokens, grid

    def reshape(tokens: torch.Tensor) -> torch.Tensor:  # the README's ViT reshape, prefix tokens dropped
        return tokens[:, prefix:].reshape(tokens.shape[0], gh, gw, -1).permute(0, 3, 1, 2)

    def run() -> Any:
        cam = getattr(pkg, CAM_CLASSES[method])(m.model, [layer], reshape_transform=reshape)
        with cam:
            # the model's weights are frozen (vitlens turns their gradients off): the graph starts at the input
            return cam(input_tensor=x.detach().clone().requires_grad_(True),
                       targets=[ClassifierOutputTarget(int(c)) for c in t.tolist()])
    return run


def grad_rollout_peer(m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The gradient rollout as implementations of Chefer et al. write it: one image at a time, the attention
    maps kept with their gradients (vitlens's inline capture), then the chain on that image."""
    def run() -> torch.Tensor:
        rows = []
        for i in range(len(x)):
            xi = x[i:i + 1].detach().clone().requires_grad_(True)
            with torch.enable_grad(), vl.capture_attention(m, mode="inline", detach=False) as cap:
                out = m.model(xi)
                grads = torch.autograd.grad(out[0, int(t[i])], cap.maps)
            tokens = cap.maps[0].shape[-1]
            r = torch.eye(tokens, dtype=torch.float64)
            for attn, grad in zip(cap.maps, grads):
                cam = (grad[0].double() * attn[0].detach().double()).clamp(min=0).mean(0)
                r = r + cam @ r
            rows.append(r)  # the whole rolled-out matrix; the source row is read as vitlens reads it
        return torch.stack(rows)
    return run


def peer_for(method: str, m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> Callable[[], Any] | None:
    if method in ("saliency", "input_x_gradient", "integrated_gradients", "occlusion"):
        return captum_peer(method, m, x, t)
    if method in CAM_CLASSES:
        return cam_peer(method, m, x, t)
    if method == "grad_rollout":
        return grad_rollout_peer(m, x, t)
    return None


def agreement(method: str, ours: np.ndarray, theirs: Any, m: vl.LoadedModel, grid: tuple[int, int]) -> float:
    """Max abs difference of the two maps on the patch grid, relative to the largest |value| of ours (NaN when
    the peer's output is not on a comparable scale: the CAM package's maps are resized and min-max scaled)."""
    if method in ("saliency", "input_x_gradient", "integrated_gradients"):
        theirs = pixels_to_grid(theirs.detach(), grid)
    elif method == "occlusion":
        theirs = pixels_to_grid(theirs.detach(), grid, reduce="mean") / 3
    elif method == "grad_rollout":
        p = m.spec.num_prefix_tokens
        row = theirs[:, 0] if m.spec.has_class_token else theirs[:, p:].mean(dim=1)
        theirs = row[:, p:].reshape(-1, *grid)
        theirs = (theirs / theirs.flatten(1).amax(1)[:, None, None]).numpy()
    else:
        return float("nan")
    return float(np.abs(ours - theirs).max() / max(np.abs(ours).max(), 1e-30))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def model_rows(name: str, batch: int, reps: int, skip: dict[str, str]) -> list[dict]:
    torch.manual_seed(0)
    m = vl.load_model(name, pretrained=False) if name not in ("ref-vit", "ref-hybrid") else vl.load_model(name)
    x = m.preprocess(list(generate(batch, seed=HELD_OUT_SEED).images))
    with torch.no_grad():
        t = m.logits(x).argmax(-1)
    grid = m.grid_for(x.shape[-2:])
    rows = []
    for method, spec in METHOD_TABLE.items():
        row: dict[str, Any] = {"model": name, "method": method}
        if method in skip or method in NO_PEER or spec.package and not _importable(spec.package):
            row["note"] = skip.get(method) or NO_PEER.get(method) or f"{spec.package} not installed"
            rows.append(row)
            continue
        ours_fn = lambda: vl.attribute(m, x, method=method, target=t, batch_size=batch)  # noqa: E731
        peer = peer_for(method, m, x, t)
        ours_fn(), peer()  # warm-up
        ours_s, peer_s = [], []
        for rep in range(reps):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for side in order:
                if side == 0:
                    s, ours = timed(ours_fn)
                    ours_s.append(s / batch)
                else:
                    s, theirs = timed(peer)
                    peer_s.append(s / batch)
        ratios = [a / b for a, b in zip(ours_s, peer_s)]
        row.update(vitlens_s=statistics.median(ours_s), peer_s=statistics.median(peer_s),
                   ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                   max_rel_diff=agreement(method, ours.maps, theirs, m, grid))
        rows.append(row)
        print(f"{name:22s} {method:22s} vitlens {row['vitlens_s']:.4f} s/img, peer {row['peer_s']:.4f} s/img, "
              f"ratio {row['ratio']:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}], "
              f"max rel diff {row['max_rel_diff']:.1e}", flush=True)
    return rows


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid", "vit_base_patch16_224"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-skip", action="store_true", help="run every method on every model")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        rows += model_rows(name, args.batch, args.reps, {} if args.no_skip else DEFAULT_SKIP.get(name, {}))
    print(f"\nseconds per image, batch {args.batch}, {args.reps} interleaved repetitions, {args.threads} threads, "
          f"torch {torch.__version__}\n")
    print("| model | method | vitlens s/img | peer s/img | vitlens / peer (median [min, max]) | max rel diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "ratio" in r:
            print(f"| {r['model']} | {r['method']} | {r['vitlens_s']:.4f} | {r['peer_s']:.4f} | {r['ratio']:.2f} "
                  f"[{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] | {r['max_rel_diff']:.1e} |")
        else:
            print(f"| {r['model']} | {r['method']} | — | — | not run: {r['note']} | |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
