"""Command line: ``python -m vitlens report|compare`` (also installed as ``vitlens``).

report  — every view (paper Fig. 6, 7) for one or more models, one offline HTML file plus data.
compare — Fig. 11: attention distance per head by layer for several models in one chart.

Bad input ends with a one-line message on stderr and exit code 2 (1 for unexpected errors),
no traceback unless --debug. Output files are written atomically, only once everything
succeeded: a failure never leaves half a report or replaces a good one.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
EXIT_USAGE, EXIT_ERROR = 2, 1
N_ROLLOUT_SHOWN = 4


class CliError(Exception):
    """A problem with the command's input, reported as one line."""


def _log(args: argparse.Namespace, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(msg, file=sys.stderr, flush=True)


def find_image_files(spec: str) -> list[Path]:
    """Files named by a folder, a glob pattern or a single file, sorted."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        if not files:
            raise CliError(f"No files match {spec!r}.")
        return files
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise CliError(f"The folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)}).")
        return files
    if path.is_file():
        return [path]
    raise CliError(f"Image folder or file not found: {path}.")


def resolve_images(args: argparse.Namespace) -> tuple[list[Any], dict, np.ndarray | None]:
    """(images, description of the set, object masks or None) from --images / --samples / --shapes."""
    import vitlens as vl
    from vitlens.shapes import HELD_OUT_SEED, generate

    if args.images:
        files = find_image_files(args.images)
        good, skipped = [], []
        for f in files:
            if len(good) >= args.n_images:
                break
            try:
                vl.to_rgb(f)
                good.append(f)
            except vl.ImageLoadError:
                skipped.append(f.name)
        if skipped and args.strict:
            raise CliError(f"{len(skipped)} unreadable image(s) (--strict): {', '.join(skipped[:5])}"
                           f"{' ...' if len(skipped) > 5 else ''}.")
        if skipped:
            _log(args, f"warning: skipped {len(skipped)} unreadable image(s): {', '.join(skipped[:5])}"
                       f"{' ...' if len(skipped) > 5 else ''}")
        if not good:
            raise CliError(f"None of the images under {args.images!r} could be read.")
        return good, {"source": "files", "description": args.images, "count": len(good), "skipped": skipped}, None
    if args.samples:
        imgs = vl.sample_images()[: args.n_images]
        return imgs, {"source": "samples", "description": "scikit-image sample photographs "
                      + ", ".join(i.info["name"] for i in imgs), "count": len(imgs), "skipped": []}, None
    data = generate(args.n_images, seed=HELD_OUT_SEED)
    return list(data.images), {"source": "shapes", "description": f"vitlens held-out shapes scenes "
                               f"(seed {HELD_OUT_SEED}, first {args.n_images})", "count": args.n_images,
                               "skipped": []}, data.masks


def environment(device: str) -> dict:
    import timm
    import torch

    import vitlens

    return {"vitlens": vitlens.__version__, "timm": timm.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "device": device}


def _load(args: argparse.Namespace, name: str):
    import torch

    import vitlens as vl

    torch.manual_seed(args.seed)  # random-init models are the same on every run
    kwargs: dict[str, Any] = {}
    if args.arch:
        kwargs["arch"] = args.arch
    return vl.load_model(name, pretrained=not args.random_init, device=args.device, **kwargs)


def _progress(args: argparse.Namespace, desc: str):
    if args.quiet:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(desc=desc, unit="img", file=sys.stderr, leave=False)

    def update(done: int, total: int | None) -> None:
        bar.total = total
        bar.update(done - bar.n)

    update.bar = bar  # type: ignore[attr-defined]
    return update


def _close(progress: Any) -> None:
    if progress is not None:
        progress.bar.close()


def write_png(figs: dict[str, Any], out_dir: Path) -> None:
    """Static PNGs through kaleido; a clear CliError when no browser is available for it."""
    try:
        import kaleido  # noqa: F401
    except ImportError as e:
        raise CliError("--png needs the kaleido package: pip install kaleido") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, fig in figs.items():
        try:
            png = fig.to_image(format="png", scale=1)
        except Exception as e:  # kaleido raises several types when no Chrome/Chromium is found
            raise CliError(f"--png could not render with kaleido ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                           "Install Chromium (Debian: apt-get install chromium) or leave out --png.") from e
        from vitlens.results import atomic_write_bytes

        atomic_write_bytes(out_dir / f"{name}.png", png)


def _data_path(out: Path, data: str | None) -> Path:
    return Path(data) if data else out.with_suffix(".json")


def cmd_report(args: argparse.Namespace) -> int:
    import vitlens as vl
    from vitlens import figures
    from vitlens.images import display_image, iter_batches
    from vitlens.report import ReportData, report_html
    from vitlens.results import atomic_write_bytes

    t_start = time.perf_counter()
    images, image_set, masks = resolve_images(args)
    analyses, shown, timings, device, tables = [], [], {}, "", []
    for name in args.model:
        t0 = time.perf_counter()
        m = _load(args, name)
        t1 = time.perf_counter()
        progress = _progress(args, f"{m.spec.name}")
        try:
            a = vl.analyze(m, images, batch_size=args.batch_size, progress=progress)
        finally:
            _close(progress)
        t2 = time.perf_counter()
        x = next(iter_batches(images[:N_ROLLOUT_SHOWN], m.data_config, N_ROLLOUT_SHOWN))
        shown.append([display_image(xi, m.data_config) for xi in x])
        analyses.append(a)
        timings[m.spec.name] = {"load": t1 - t0, "analyze": t2 - t1}
        device = str(m.device)
        if args.attributions:
            tables.append(_attributions(args, m, images, masks))
            timings[m.spec.name]["attributions"] = time.perf_counter() - t2
        _log(args, f"{m.spec.name}: analysed {a.distance.n_images} images in {t2 - t1:.1f} s")
    timings["total"] = {"total": time.perf_counter() - t_start}
    data = ReportData(models=[a.spec["name"] for a in analyses], analyses=analyses, image_set=image_set,
                      environment=environment(device), timings=timings,
                      command=_command(), attributions=tables)
    page = report_html(data, shown)
    if args.png:
        figs = {}
        for i, (a, imgs) in enumerate(zip(analyses, shown)):
            stem = f"{i + 1}-{_safe(a.spec['name'])}"
            figs[f"{stem}-filters"] = figures.filters_figure(a.filters)
            if a.position is not None:
                figs[f"{stem}-position"] = figures.position_figure(a.position)
            figs[f"{stem}-distance"] = figures.distance_figure(a.distance)
            figs[f"{stem}-rollout"] = figures.rollout_figure(a.rollout, imgs[0], 0)
        write_png(figs, Path(args.png))
    out = Path(args.out)
    data.save(_data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    _log(args, f"wrote {out} and {_data_path(out, args.data)}")
    return 0


def _attributions(args: argparse.Namespace, m: Any, images: list, masks: np.ndarray | None) -> Any:
    """Methods x metrics for the report, on the first --attribution-images images."""
    from vitlens.attribution import METHODS
    from vitlens.faithfulness import compare_methods

    if m.spec.num_classes <= 0:
        _log(args, f"{m.spec.name}: no classifier head, so no attributions")
        return None
    n = min(args.attribution_images, len(images))
    progress = _progress(args, f"{m.spec.name} attributions")
    try:
        return compare_methods(m, images[:n], methods=METHODS, masks=None if masks is None else masks[:n],
                               batch_size=args.batch_size, progress=progress)
    finally:
        _close(progress)


def cmd_compare(args: argparse.Namespace) -> int:
    import vitlens as vl
    from vitlens.images import display_image, iter_batches
    from vitlens.report import ComparisonData, comparison_html, comparison_units, layer_table, local_head_share
    from vitlens.results import atomic_write_bytes

    if len(args.models) < 2:
        raise CliError("compare needs at least two models: --models A B [...].")
    t_start = time.perf_counter()
    images, image_set, _ = resolve_images(args)
    distances, names, rollouts, timings, device = [], [], [], {}, ""
    for name in args.models:
        t0 = time.perf_counter()
        m = _load(args, name)
        progress = _progress(args, m.spec.name)
        try:
            distances.append(vl.attention_distance(m, images, batch_size=args.batch_size, progress=progress))
        finally:
            _close(progress)
        names.append(m.spec.name)
        first = images[:1]
        rollouts.append((m.spec.name, vl.attention_rollout(m, first),
                         display_image(next(iter_batches(first, m.data_config, 1))[0], m.data_config)))
        timings[m.spec.name] = time.perf_counter() - t0
        device = str(m.device)
        _log(args, f"{m.spec.name}: {distances[-1].n_images} images in {timings[m.spec.name]:.1f} s")
    timings["total"] = time.perf_counter() - t_start
    units = comparison_units(distances)
    data = ComparisonData(
        models=names, distances=distances, units=units, local_threshold=args.local_threshold,
        first_layers=args.first_layers, table=layer_table(distances, names, units),
        local_share=[local_head_share(d, args.local_threshold, args.first_layers) for d in distances],
        image_set=image_set, environment=environment(device), timings=timings,
        command=_command(),
    )
    page = comparison_html(data, rollouts)
    if args.png:
        from vitlens import figures

        write_png({"comparison-distance": figures.distance_figure(distances, names=names, units=units)},
                  Path(args.png))
    out = Path(args.out)
    data.save(_data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    _log(args, f"wrote {out} and {_data_path(out, args.data)}")
    return 0


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _command() -> str:
    return "vitlens " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--images", help="folder, glob pattern or file of images")
    src.add_argument("--samples", action="store_true", help="scikit-image's sample photographs")
    src.add_argument("--shapes", action="store_true", help="held-out vitlens shapes scenes (the default)")
    p.add_argument("--n-images", type=_positive, default=128, help="use at most this many images (default 128)")
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--arch", default=None, help="timm architecture of a local checkpoint file")
    p.add_argument("--random-init", action="store_true",
                   help="random weights instead of pretrained hub weights (timm names; embedded models keep theirs)")
    p.add_argument("--seed", type=int, default=0, help="seed for random-init weights (default 0)")
    p.add_argument("--data", default=None, help="where to write the numbers (default: OUT with .json)")
    p.add_argument("--png", default=None, metavar="DIR", help="also write static PNGs of every figure (kaleido)")
    p.add_argument("--strict", action="store_true", help="stop on unreadable images instead of skipping them")
    p.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitlens", description="Interpretability reports for Vision Transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="every view for one or more models (Fig. 6, 7)")
    r.add_argument("--model", action="append", default=None, help="model name or checkpoint (repeatable; "
                   "default ref-vit)")
    r.add_argument("--out", default="report.html")
    r.add_argument("--attributions", action="store_true",
                   help="add class-specific attributions (captum, grad-rollout) and their faithfulness scores")
    r.add_argument("--attribution-images", type=_positive, default=16,
                   help="images for the attribution section (default 16; occlusion and IG are costly)")
    r.set_defaults(func=cmd_report)
    _common(r)
    c = sub.add_parser("compare", help="attention distance of several models in one chart (Fig. 11)")
    c.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"])
    c.add_argument("--out", default="compare.html")
    c.add_argument("--local-threshold", type=float, default=0.15,
                   help="a head is local below this fraction of the image width (default 0.15)")
    c.add_argument("--first-layers", type=_positive, default=4, help="layers counted for the local share")
    c.set_defaults(func=cmd_compare)
    _common(c)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model", "unset") is None:
        args.model = ["ref-vit"]
    from vitlens.errors import VitlensError

    try:
        return args.func(args)
    except (CliError, VitlensError) as e:
        if args.debug:
            raise
        print(f"vitlens: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("vitlens: interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"vitlens: unexpected error ({type(e).__name__}: {e}); rerun with --debug for the traceback.",
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
