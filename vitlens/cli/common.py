"""What every command of the command line shares (``vitlens.cli``): its errors and exit codes, the checks of its
outputs before any work, the image set, the models loaded (and so checked) before the first is analysed, the PNG
export and the one-line log. The library is imported inside the functions that need it (import cost: a bad argument
is refused before torch is imported)."""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vitlens.words import printable


EXIT_USAGE, EXIT_ERROR = 2, 1


def count(n: int, noun: str) -> str:
    """"1 image", "2 images": counts in words without "(s)"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


N_ROLLOUT_SHOWN = 4


class CliError(Exception):
    """A problem with the command's input, reported as one line."""


class Interrupted(Exception):
    """Ctrl-C, with what was kept on disk (the survey keeps every finished shard)."""


def check_writable(path: str | Path, what: str, folder: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written: a file where a folder is
    wanted (or the reverse), or a place where nothing can be created (``--png /proc/x``).

    Missing folders are fine (they are created when the outputs are written); the nearest
    existing one must take a new file, which a temporary file (removed at once) checks."""
    target = Path(path).expanduser()
    if target.exists() and folder and not target.is_dir():
        raise CliError(f"{what} {target} is a file, not a folder.")
    if target.is_dir() and not folder:
        raise CliError(f"{what} {target} is a folder; give a file name.")
    probe = target if target.is_dir() else target.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise CliError(f"{what} {target} cannot be written: {probe} is a file, not a folder.")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise CliError(f"{what} {target} cannot be written ({e.strerror or type(e).__name__} in {probe}).") from e


def check_outputs(args: argparse.Namespace) -> None:
    """Every output of report / compare / survey-report, checked before any work."""
    out = Path(args.out)
    check_writable(out, "--out")
    if getattr(args, "data", "unset") != "unset":
        check_writable(data_path(out, args.data), "--data")
    if getattr(args, "png", None):
        check_writable(args.png, "--png", folder=True)


def log(args: argparse.Namespace, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(printable(msg), file=sys.stderr, flush=True)


def resolve_images(args: argparse.Namespace) -> tuple[list[Any], dict, np.ndarray | None, np.ndarray | None]:
    """(images, description of the set, object masks or None, labels or None) from --images / --samples / --shapes."""
    import vitlens as vl
    from vitlens.images import tiny_image_warning
    from vitlens.reference.shapes import HELD_OUT_SEED, generate

    if args.images:
        from vitlens.images import find_image_files

        files = find_image_files(args.images)
        good: list[Any] = []
        skipped: list[str] = []
        why: dict[str, str] = {}
        tiny = []
        for f in files:
            if len(good) >= args.n_images:
                break
            try:
                size = vl.to_rgb(f).size
                good.append(f)
                if tiny_image_warning(f.name, size):
                    tiny.append(tiny_image_warning(f.name, size))
            except vl.ImageLoadError as e:  # every skip says why: the library's reason, as it gave it
                skipped.append(f.name)
                why[f.name] = str(e).replace(str(f), f.name)
        reasons = [f"{name} ({why[name]})" for name in skipped[:5]]
        reasons += [f"... and {len(skipped) - 5} more"] if len(skipped) > 5 else []
        if skipped and args.strict:
            raise CliError(f"{count(len(skipped), 'image')} could not be read (--strict): " + " ".join(reasons))
        if skipped and good:
            for reason in reasons:
                log(args, f"warning: skipped {reason}")
        if not good:
            raise CliError(f"None of the images under {args.images!r} could be read: " + " ".join(reasons))
        for t in tiny:
            log(args, f"warning: {t}")
        return good, {"source": "files", "description": args.images, "count": len(good), "skipped": skipped,
                      "skipped_why": why}, None, None
    if args.samples:
        imgs = vl.sample_images()[: args.n_images]
        return imgs, {"source": "samples", "description": "scikit-image sample photographs "
                      + ", ".join(i.info["name"] for i in imgs), "count": len(imgs), "skipped": []}, None, None
    data = generate(args.n_images, seed=HELD_OUT_SEED)
    return list(data.images), {"source": "shapes", "description": f"vitlens held-out shapes scenes "
                               f"(seed {HELD_OUT_SEED}, first {args.n_images})", "count": args.n_images,
                               "skipped": []}, data.masks, data.labels


def check_names(names: Sequence[str]) -> None:
    """Refuse a name that resolves to nothing (``name_problem``: no model built, no weights read)."""
    from vitlens.loading.resolve import name_problem

    for name in names:
        problem = name_problem(name)
        if problem is not None:
            raise problem


def load_all(args: argparse.Namespace, names: Sequence[str]) -> list[Any]:
    """Load (and so check) every model before any is analysed; random-init models are seeded."""
    import torch

    import vitlens as vl

    from vitlens.loading.checkpoint import looks_like_checkpoint_path

    models = []
    # --arch goes to the checkpoint files; with none among the models it goes to all, which refuse it
    files = [n for n in names if looks_like_checkpoint_path(n)]
    for name in names:
        torch.manual_seed(args.seed)  # random-init models are the same on every run
        kwargs: dict[str, Any] = {"arch": args.arch} if args.arch and (name in files or not files) else {}
        models.append(vl.load_model(name, pretrained=not args.random_init, device=args.device, **kwargs))
    return models


def write_png(figs: dict[str, Any], out_dir: Path) -> None:
    """Static PNGs through kaleido; a clear CliError when no browser is available for it."""
    try:
        import kaleido  # noqa: F401
    except ImportError as e:
        raise CliError("--png needs the kaleido package: pip install kaleido") from e
    from vitlens.errors import VitlensError
    from vitlens.report.export import figures_png
    from vitlens.results import atomic_write_bytes

    try:  # every figure rendered (one browser for them all) before the first file is written
        pngs = dict(zip(figs, figures_png(list(figs.values()))))
    except VitlensError:  # no browser: the export's own message (what to install), not kaleido's
        raise
    except Exception as e:  # kaleido raises several types when no Chrome/Chromium is found
        raise CliError(f"--png could not render with kaleido ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                       "Install Chromium (Debian: apt-get install chromium) or leave out --png.") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, png in pngs.items():
        atomic_write_bytes(out_dir / f"{name}.png", png)


def data_path(out: Path, data: str | None) -> Path:
    return Path(data) if data else out.with_suffix(".json")


def refuse_fps(args: argparse.Namespace) -> None:
    """``--fps`` is a clip's frame rate: refused without ``--video``."""
    if args.fps is not None:
        raise CliError("--fps is a clip's frame rate; give the clip with --video CLIP.")


def refuse_video_models(models: Sequence[Any]) -> None:
    """A video model given images: refused in one line (``report.video.refuse_video_models``)."""
    from vitlens.report.video import refuse_video_models as refuse

    refuse(models)


#: ``--methods all``: every available attribution method (the report's default is the quick, preselected set)
ALL_METHODS = "all"


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def command_line() -> str:
    return "vitlens " + " ".join(shlex.quote(a) for a in sys.argv[1:])


__all__ = ["ALL_METHODS", "CliError", "EXIT_ERROR", "EXIT_USAGE", "Interrupted", "N_ROLLOUT_SHOWN", "check_names",
           "check_outputs", "check_writable", "command_line", "count", "data_path", "load_all", "log", "refuse_fps",
           "refuse_video_models", "resolve_images", "safe_name", "write_png"]
