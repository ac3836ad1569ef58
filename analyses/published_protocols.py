"""Chefer et al.'s positive / negative perturbation on the embedded pair under vitlens's token protocol and under
the published one (``protocol="chefer2021"``: pixels of the upsampled map to black), ordered by signed R and by |R|:
the MODEL_CARD's side table of the method x metric table.

    HF_HUB_OFFLINE=1 python analyses/published_protocols.py --n 40 --model ref-vit
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vitlens as vl  # noqa: E402
from vitlens.attribution import METHODS  # noqa: E402
from vitlens.attribution.cam import CAM_CLASSES, cam_package_available  # noqa: E402
from vitlens.attribution.perturbation import perturbation_test  # noqa: E402
from vitlens.reference.shapes import HELD_OUT_SEED, generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--model", default="ref-vit")
    p.add_argument("--methods", nargs="*", default=None)
    args = p.parse_args(argv)
    m = vl.load_model(args.model, device="cpu")
    data = generate(args.n, seed=HELD_OUT_SEED)
    images = list(data.images)
    methods = args.methods or [k for k in METHODS if k != "scorecam" and (k not in CAM_CLASSES or cam_package_available())]
    print("| method | pos ↓ token | neg ↑ token | pos ↓ chefer2021 | neg ↑ chefer2021 | neg ↑ token, by \\|R\\| "
          "| neg ↑ chefer2021, by \\|R\\| |")
    print("|---|---|---|---|---|---|---|")
    for method in methods:
        a = vl.attribute(m, images, method=method, batch_size=50)
        cells = []
        for proto, order in (("vitlens", "signed"), ("chefer2021", "signed"), ("vitlens", "absolute"),
                             ("chefer2021", "absolute")):
            r = perturbation_test(m, images, a, labels=data.labels, protocol=proto, ordering=order, batch_size=50)
            cells += ([r.positive_auc.mean(), r.negative_auc.mean()] if order == "signed" else [r.negative_auc.mean()])
        print(f"| {method} | " + " | ".join(f"{v:.3f}" for v in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
