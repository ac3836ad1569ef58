"""Found again where we know the answer (issue 66, item 4): does a sparse autoencoder on the embedded pair's residual
stream find the six shapes of the reference scenes, and better than PCA and dictionary learning on the same tokens?

Usage:
    python analyses/sae_shapes.py [--models ref-vit ref-hybrid] [--layers 1 3 5] [--n-train 2000] [--n-test 500]
        [--n-features 256] [--k 8] [--epochs 4] [--fit-tokens 8000] [--out sae_shapes]

Per model and layer (``blocks.{l}.hook_resid_post``, the patch tokens):

- an SAE (``vl.train_sae``, TopK) is trained on the train scenes (seed ``TRAIN_SEED``, a stream neither the pair nor the
  held-out split uses); PCA (scikit-learn, every component, each sign a direction) and ``MiniBatchDictionaryLearning``
  (as many atoms as the SAE has features, fitted by coordinate descent for 3 passes over ``--fit-tokens`` of them,
  OMP codes with k atoms, each sign of a code a direction) are fitted on the same train tokens;
- an image's score on a feature is the feature's largest activation over its patch tokens (PCA: the projection on the
  direction, centred, negative parts cut at 0; dictionary learning: the code's part of that sign);
- for each shape, the feature and the threshold with the best F1 for "this shape is in the image" are chosen on the
  train scenes, and that feature's F1 is measured on the held-out scenes (``HELD_OUT_SEED``);
- on the held-out scenes that hold the shape, the share of the chosen feature's activation inside the object's mask
  (each patch weighted by the share of its pixels the mask covers) against the mask's share of the image.

Writes ``OUT.json``, ``OUT.csv`` and ``OUT.md`` (the markdown table) and prints the table.
"""
from __future__ import annotations

import argparse
import csv
import warnings
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vitlens as vl  # noqa: E402
from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate  # noqa: E402
from vitlens.sae import iter_site_batches  # noqa: E402

#: the train scenes' stream: not the pair's training seeds (>= 1000 in steps) nor the held-out one
TRAIN_SEED = 7
METHODS = ("sae", "pca", "dict")


def patch_tokens(m: vl.LoadedModel, images: np.ndarray, site: str) -> np.ndarray:
    """[N, P, D] the site's patch tokens of every image (``iter_site_batches``: one forward per batch)."""
    out = []
    for b in iter_site_batches(m, list(images), site, batch_size=100):
        out.append(b.acts[:, b.prefix:].double().cpu().numpy())
    return np.concatenate(out)


def mask_cover(masks: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """[N, P] the share of each patch's pixels the object's mask covers."""
    n, h, w = masks.shape
    gh, gw = grid
    return masks.reshape(n, gh, h // gh, gw, w // gw).mean((2, 4)).reshape(n, gh * gw)


def best_f1(scores: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([F] the best F1 over thresholds of each column of ``scores`` [N, F] for ``present`` [N], [F] its threshold:
    an image is called positive when its score is above the threshold)."""
    order = np.argsort(-scores, axis=0, kind="stable")
    hits = present[order].astype(np.float64)  # [N, F], best-scored first
    tp = np.cumsum(hits, 0)
    called = np.arange(1, len(present) + 1)[:, None]
    f1 = 2 * tp / (called + present.sum())
    best = f1.argmax(0)
    sorted_scores = np.take_along_axis(scores, order, 0)
    below = np.take_along_axis(sorted_scores, np.minimum(best + 1, len(present) - 1)[None], 0)[0]
    at = sorted_scores[best, np.arange(scores.shape[1])]
    threshold = np.where(best + 1 < len(present), (at + below) / 2, at - 1e-9)
    return f1.max(0), threshold


def f1_at(scores: np.ndarray, present: np.ndarray, threshold: float) -> float:
    called = scores > threshold
    tp = float((called & present).sum())
    return 2 * tp / max(float(called.sum() + present.sum()), 1.0)


def in_mask(acts: np.ndarray, cover: np.ndarray) -> float:
    """Mean over images (those where the feature fires) of the share of its activation inside the mask."""
    total = acts.sum(1)
    keep = total > 0
    return float(((acts * cover).sum(1)[keep] / total[keep]).mean()) if keep.any() else float("nan")


def codes(method: str, fitted: object, tokens: np.ndarray) -> np.ndarray:
    """[N, P, F'] the non-negative activations of every candidate direction on tokens [N, P, D]."""
    n, p, d = tokens.shape
    flat = tokens.reshape(-1, d)
    if method == "sae":
        with torch.no_grad():
            z = fitted.encode(torch.as_tensor(flat, dtype=torch.float32)).double().numpy()
    else:
        proj = fitted.transform(flat)  # PCA: centred projections; dictionary learning: OMP codes
        z = np.concatenate([np.maximum(proj, 0), np.maximum(-proj, 0)], 1)  # each sign its own direction
    return z.reshape(n, p, -1)


def evaluate(method: str, fitted: object, train: np.ndarray, test: np.ndarray, train_labels: np.ndarray,
             test_labels: np.ndarray, cover: np.ndarray) -> list[dict]:
    z_train, z_test = codes(method, fitted, train), codes(method, fitted, test)
    s_train, s_test = z_train.max(1), z_test.max(1)
    rows = []
    for c, shape in enumerate(CLASSES):
        f1, threshold = best_f1(s_train, train_labels == c)
        best = int(f1.argmax())
        held = test_labels == c
        rows.append({"shape": shape, "method": method, "feature": best, "train_f1": float(f1[best]),
                     "f1": f1_at(s_test[:, best], held, float(threshold[best])),
                     "in_mask": in_mask(z_test[held, :, best], cover[held]),
                     "mask_share": float(cover[held].mean())})
    return rows


def fit_baselines(tokens: np.ndarray, n_features: int, k: int, seed: int, fit_tokens: int) -> dict[str, object]:
    from sklearn.decomposition import PCA, MiniBatchDictionaryLearning

    flat = tokens.reshape(-1, tokens.shape[-1])
    rng = np.random.default_rng(seed)
    sample = flat[rng.choice(len(flat), min(fit_tokens, len(flat)), replace=False)]
    pca = PCA(random_state=seed).fit(sample)
    dl = MiniBatchDictionaryLearning(n_components=n_features, alpha=0.1, batch_size=256, max_iter=3,
                                     fit_algorithm="cd", transform_algorithm="omp", transform_n_nonzero_coefs=k,
                                     random_state=seed)
    dl.fit(sample - sample.mean(0))
    dl.mean_ = sample.mean(0)
    transform = dl.transform
    dl.transform = lambda x: transform(x - dl.mean_)  # fitted on centred tokens, read the same way
    return {"pca": pca, "dict": dl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    p.add_argument("--layers", nargs="+", type=int, default=[1, 3, 5], help="blocks (0-based) whose output is read")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--n-features", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--fit-tokens", type=int, default=8000, help="tokens PCA and dictionary learning are fitted on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("sae_shapes"))
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore", message="Objective did not converge")  # the baseline's few passes, stated
    train, test = generate(args.n_train, seed=TRAIN_SEED), generate(args.n_test, seed=HELD_OUT_SEED)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for name in args.models:
        m = vl.load_model(name, device="cpu")
        cover = mask_cover(test.masks, m.spec.grid)
        for layer in args.layers:
            site = f"blocks.{layer}.hook_resid_post"
            t1 = time.perf_counter()
            tr, te = patch_tokens(m, train.images, site), patch_tokens(m, test.images, site)
            sae = vl.train_sae(m, list(train.images), site=site, n_features=args.n_features, k=args.k,
                            tokens="patches", epochs=args.epochs, batch_size=32, seed=args.seed).sae
            fitted: dict[str, object] = {"sae": sae, **fit_baselines(tr, args.n_features, args.k, args.seed,
                                                                      args.fit_tokens)}
            for method in METHODS:
                for row in evaluate(method, fitted[method], tr, te, train.labels, test.labels, cover):
                    rows.append({"model": name, "layer": layer, **row})
            print(f"{name} layer {layer}: {time.perf_counter() - t1:.0f} s", flush=True)
    table = markdown(rows, args)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    Path(f"{args.out}.json").write_text(json.dumps({"args": meta, "seconds": time.perf_counter() - t0,
                                                    "rows": rows}, indent=1) + "\n")
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    Path(f"{args.out}.md").write_text(table + "\n")
    return 0


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """One row per (model, layer, shape): held-out F1 and the share inside the mask of each method, the mask's share."""
    lines = [f"Held-out F1 of the best single feature for \"this shape is in the image\" ({args.n_test} held-out "
             f"scenes; feature and threshold chosen on {args.n_train} train scenes), and the share of its activation "
             f"inside the object's mask (SAE: TopK, {args.n_features} features, k={args.k}, {args.epochs} epochs).",
             "", "| model | layer | shape | F1 SAE | F1 PCA | F1 dict | in mask SAE | in mask PCA | in mask dict | "
             "mask share |", "|---|---|---|---|---|---|---|---|---|---|"]
    key = {(r["model"], r["layer"], r["shape"], r["method"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        for layer in dict.fromkeys(r["layer"] for r in rows if r["model"] == model):
            for shape in CLASSES:
                got = [key[(model, layer, shape, method)] for method in METHODS]
                lines.append(f"| {model} | {layer + 1} | {shape} | " + " | ".join(f"{g['f1']:.2f}" for g in got)
                             + " | " + " | ".join(f"{g['in_mask']:.2f}" for g in got)
                             + f" | {got[0]['mask_share']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
