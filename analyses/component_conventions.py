"""The component analyses' named conventions side by side on one OpenCLIP-style tower (issue 65; docs/definitions.md,
"Norm conventions", "TextSpan", "Token norms"): how far the parts of ``decompose`` move between ``per_part`` and
``clip_text_span``, how TextSpan's two rules differ on the same head vectors (the texts picked, the variance explained,
the zero-shot accuracy with the heads replaced by their texts), and how many artifact tokens each rule flags.

Usage:
    python analyses/component_conventions.py [--arch ViT-B-32] [--n 64] [--steps 10] [--randomise 0.5] [--out f.json]

The tower is random-init (no weights can be downloaded here): OpenCLIP's ``--arch`` built with ``pretrained=None``,
its text tower embedding the text bank shipped with vitlens and the class prompts of the shape scenes (``--n``
held-out scenes drawn at the tower's input size). With ``--randomise s`` the LayerNorm gains and biases and the
attention's projection biases get ``s * N(0, 1)`` added (the issue's comparison set them so that conventions show);
0 keeps the initialisation (gains 1, biases 0). Accuracies are agreement with the unmodified tower's zero-shot
prediction (a random tower's labels would be chance).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="ViT-B-32")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--randomise", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import open_clip
    import torch.nn.functional as F

    import vitlens as vl
    from vitlens.components import evaluate_text_span, text_bank
    from vitlens.components.head_vectors import head_vectors
    from vitlens.components.textspan import VARIANTS
    from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate

    torch.manual_seed(0)
    model = open_clip.create_model(args.arch, pretrained=None).double().eval()
    if args.randomise:
        with torch.no_grad():
            for name, q in model.visual.named_parameters():
                if "ln" in name or name.endswith("bias"):
                    q.add_(args.randomise * torch.randn_like(q))
    tower = model.visual
    tok = open_clip.get_tokenizer(args.arch)

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            return F.normalize(model.encode_text(tok(texts)), dim=-1).numpy()

    size = tower.image_size if isinstance(tower.image_size, int) else tower.image_size[0]
    scenes = generate(args.n, seed=HELD_OUT_SEED, size=size)
    x = (torch.as_tensor(scenes.images).permute(0, 3, 1, 2).double() / 255.0 - 0.45) / 0.27
    classes = embed([f"a photo of a {c}" for c in CLASSES])
    with torch.no_grad():
        f = tower(x)
    pred = (f.numpy() @ classes.T).argmax(-1)
    out: dict = {"arch": args.arch, "randomise": args.randomise, "images": args.n}

    # 1. the final norm's conventions, read along each image's predicted class prompt
    u = classes[pred[0]]
    ours = vl.decompose(tower, x, direction=u)
    theirs = vl.decompose(tower, x, direction=u, norm_convention="clip_text_span")
    r = np.linalg.norm(f.numpy(), axis=-1)
    a, b = ours.heads.sum(-1) / r[:, None, None], theirs.heads.sum(-1)
    out["norm_convention"] = {
        "max_abs_head": float(np.abs(a - b).max()), "max_abs_head_over_max_head": float(np.abs(a - b).max() /
                                                                                         np.abs(b).max()),
        "median_rel_head": float(np.median(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))),
        "max_abs_head_token": float(np.abs(ours.heads / r[:, None, None, None] - theirs.heads).max()),
        "ledgers": [float(ours.ledger().max()), float(theirs.ledger().max())]}

    # 2. TextSpan's two rules on the same head vectors, and their evaluation
    bank = text_bank()
    emb = embed(bank)
    v, layers = head_vectors(tower, x)
    v = v.numpy()
    same, first, lists = 0, 0, 0
    for i in range(v.shape[1]):
        for h in range(v.shape[2]):
            c1 = VARIANTS["normalised"](v[:, i, h], emb, args.steps, 80)[0]
            c2 = VARIANTS["authors"](v[:, i, h], emb, args.steps, 80)[0]
            same += c1.tolist() == c2.tolist()
            first += c1[0] == c2[0]
            lists += 1
    out["text_span_rules"] = {"heads": lists, "same_list": int(same), "same_first_pick": int(first)}
    for variant in VARIANTS:
        e = evaluate_text_span(tower, x, bank, emb, classes, steps=args.steps, variant=variant)
        out[f"text_span_{variant}"] = {"mean_explained": float(e.explained.mean()),
                                       "accuracy_model": e.accuracy_model, "accuracy_ablated": e.accuracy_ablated,
                                       "accuracy_replaced": e.accuracy_replaced, "layers": [int(l) for l in e.layers]}

    # 3. the artifact-token rules
    rel = vl.token_norms(tower, x)
    ab = vl.token_norms(tower, x, rule="absolute")
    out["artifact_rules"] = {"relative_outliers_last_depth": float(rel.outliers[:, -1].sum(-1).mean()),
                             "absolute_outliers_last_depth": float(ab.outliers[:, -1].sum(-1).mean()),
                             "median_patch_norm_last_depth": float(np.median(rel.norms[:, -1, 1:])),
                             "max_patch_norm_last_depth": float(rel.norms[:, -1, 1:].max())}
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
