"""Artifact tokens (Darcet et al., ICLR 2024, "Vision Transformers Need Registers"), side by side: the token norms
by depth of a ViT without registers and of the same ViT trained with registers, on the README's sample photos and
the shape scenes, as one offline HTML file plus the numbers as data (CSV).

Usage:
    python analyses/artifact_tokens.py [--models A B] [--n-scenes 4] [--no-samples] [--img-size PX]
        [--out artifact_tokens.html] [--random-init] [--device cuda] [--rule relative|absolute] [--threshold 150]

The default pair is DINOv2 ViT-S/14 without and with four registers (``vit_small_patch14_dinov2.lvd142m``,
``vit_small_patch14_reg4_dinov2.lvd142m``; the paper's Fig. 2 and 7 show DINOv2). Each model is read by
``vl.token_norms`` (docs/definitions.md, "Token norms": a patch token is an outlier at a depth when its norm exceeds
4 x its image's median patch norm there; ``--rule absolute``: Darcet et al.'s rule, a norm over ``--threshold``, 150
for DINOv2 ViT-g). The page gives, per model and image: the outliers at the last depth, the
first depth at which one appears, the attention the class token pays them in the last block, and, with registers,
the class token's attention to the registers (where that mass goes instead).

Pretrained weights are needed to see artifacts: without them (offline, not cached) the script stops with the
loader's one-line reason and writes nothing. ``--random-init`` runs the same code on untrained weights (no artifact
is expected there; the page says so): a check of the script, not a finding.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

PAIR = ("vit_small_patch14_dinov2.lvd142m", "vit_small_patch14_reg4_dinov2.lvd142m")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    p = argparse.ArgumentParser(prog="artifact_tokens.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(PAIR), help="timm names (default: DINOv2 ViT-S/14 without "
                   "and with registers)")
    p.add_argument("--n-scenes", type=int, default=4, help="shape scenes (held-out seed) beside the sample photos")
    p.add_argument("--no-samples", action="store_true", help="leave out the README's sample photos")
    p.add_argument("--rule", choices=("relative", "absolute"), default="relative",
                   help="artifact-token rule: over 4 x the median patch norm (relative) or over --threshold (absolute)")
    p.add_argument("--threshold", type=float, default=150.0, help="the absolute rule's norm (Darcet et al.: 150)")
    p.add_argument("--img-size", type=int, default=None, help="input size in pixels (default: the model's own)")
    p.add_argument("--random-init", action="store_true", help="untrained weights: a check of the script only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("artifact_tokens.html"))
    return p.parse_args(list(argv))


def images_of(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The images (PIL or uint8 arrays) and their names: the sample photos, then the shape scenes."""
    from vitlens.images import SAMPLE_NAMES, sample_images
    from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate

    images: list[Any] = [] if args.no_samples else list(sample_images())
    names = [] if args.no_samples else list(SAMPLE_NAMES)
    if args.n_scenes > 0:
        scenes = generate(args.n_scenes, seed=HELD_OUT_SEED)
        images += list(scenes.images)
        names += [f"scene {i} ({CLASSES[k]})" for i, k in enumerate(scenes.labels)]
    return images, names


def summary_rows(model: str, result: Any, names: Sequence[str]) -> list[dict]:
    """One row per image: outliers at the last depth, their first depth, the class token's attention to them and to
    the registers in the last block (NaN where the model has no class token or no registers)."""
    rows = []
    for b, name in enumerate(names):
        first = result.first_depth[b]
        rows.append({"model": model, "image": name, "registers": result.num_registers,
                     "outliers (last depth)": int(result.outliers[b, -1].sum()),
                     "first depth with one": int(first[first >= 0].min()) if (first >= 0).any() else "never",
                     "max norm / median": float(result.norms[b, -1, result.num_prefix_tokens:].max()
                                                / np.median(result.norms[b, -1, result.num_prefix_tokens:])),
                     "class attention to outliers (last block)": float(result.class_attention[b, -1]),
                     "class attention to registers (last block)": float(result.register_attention[b, -1])})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the analysis; 0 on success, 1 with one line on stderr when a model cannot be loaded (nothing written)."""
    import pandas as pd
    import torch

    import vitlens as vl
    from vitlens.errors import VitlensError
    from vitlens.figures import token_norms_figure
    from vitlens.report.html import figure_html, html_table, page_html
    from vitlens.results import atomic_write_bytes

    args = parse(sys.argv[1:] if argv is None else argv)
    images, names = images_of(args)
    if not images:
        print("artifact_tokens: no images (--no-samples and --n-scenes 0); give at least one.", file=sys.stderr)
        return 1
    kwargs = {"img_size": args.img_size} if args.img_size else {}
    results, rows = [], []
    for name in args.models:
        try:
            torch.manual_seed(0)  # untrained weights are the same on every run
            m = vl.load_model(name, pretrained=not args.random_init, device=args.device, **kwargs)
            result = vl.token_norms(m, images, rule=args.rule, threshold=args.threshold)
        except VitlensError as e:
            print(f"artifact_tokens: {name}: {e.message_for('cli')}", file=sys.stderr)
            return 1
        results.append((name, result))
        rows += summary_rows(name, result, names)
    body = ["<h1>Artifact tokens: token norms by depth, without and with registers</h1>",
            "<p class='muted'>Outlier rule (docs/definitions.md, Token norms): a patch token whose "
            f"{results[0][1].rule_words()} at that depth.</p>"]
    if args.random_init:
        body.append("<p class='note'>Untrained weights (--random-init): artifact tokens come from training, so none "
                    "is expected here. This page checks the script, it shows no finding.</p>")
    body.append(html_table(rows, floatfmt="{:.3g}"))
    shown = sorted({0, min(1, len(names) - 1), len(names) - 1})  # a photo or two and the last scene, each model
    for i in shown:
        image = names[i]
        for name, result in results:
            body.append(figure_html(token_norms_figure(result, image=i, title=f"{name}: {image}")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = args.out.with_suffix(".csv")
    detail = pd.DataFrame([dict(r, model=n) for n, res in results for r in res.to_rows()])
    atomic_write_bytes(table, detail.to_csv(index=False).encode())
    atomic_write_bytes(args.out, page_html("vitlens: artifact tokens", "\n".join(body)).encode())
    print(f"artifact_tokens: wrote {args.out} and {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
