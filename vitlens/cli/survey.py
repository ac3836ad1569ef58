"""``vitlens survey`` (a model zoo x an image set on Ray, resumable, one tidy table: Fig. 11 across a zoo) and
``vitlens survey-report`` (one offline page of a survey folder). The library is imported inside each command (import
cost: the parser answers first)."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from vitlens.words import printable

from .common import CliError, EXIT_ERROR, Interrupted, check_outputs, check_writable, log, write_png


def cmd_survey(args: argparse.Namespace) -> int:
    """A model zoo x an image set on Ray; the folder, a table and a line per failed model."""
    names = list(args.models or [])
    if args.models_file:
        path = Path(args.models_file).expanduser()
        if not path.is_file():
            raise CliError(f"Models file not found: {path}.")
        names += [name for name in (line.split("#")[0].strip() for line in path.read_text().splitlines()) if name]
    if not names:
        raise CliError("Name the models to survey: --models A B ... or --models-file zoo.txt.")
    if args.device == "cpu" and args.num_gpus_per_worker > 0:
        raise CliError("--device cpu and --num-gpus-per-worker > 0 contradict each other: pass one of them.")
    if args.device == "cuda" and args.num_gpus_per_worker == 0:
        import torch

        if args.address is None and not torch.cuda.is_available():
            raise CliError("--device cuda: this machine has no CUDA GPU for the local Ray (pass --address of a "
                           "cluster with GPUs, or drop --device).")
        args.num_gpus_per_worker = 1.0  # each model worker asks Ray for one GPU and runs on it
    check_writable(args.out, "--out", folder=True)
    import vitlens as vl
    from vitlens.survey import clips_source, files_source, shapes_source
    from vitlens.survey.stats import DEFAULT_SURVEY_VIEW_NAMES

    if args.clips and args.images:
        raise CliError("Pass --images (image models) or --clips (video models), not both.")
    if args.clips:  # video models: a shard is a set of clips, the space-time statistics kept
        try:
            source = clips_source(args.clips, max_clips=args.n_images)
        except vl.InvalidParameterError as e:
            raise CliError(str(e)) from e
    elif args.images:
        try:
            source = files_source(args.images, per_class=args.per_class, max_images=args.n_images)
        except vl.InvalidParameterError as e:
            raise CliError(str(e)) from e
    else:
        source = shapes_source(args.n_images or 128)
    try:
        result = vl.survey(names, source, args.out, address=args.address, batch_size=args.batch_size,
                           shard_size=args.shard_size, views=args.views or DEFAULT_SURVEY_VIEW_NAMES,
                           num_gpus_per_worker=args.num_gpus_per_worker, pretrained=args.pretrained,
                           strict=args.strict, progress=not args.quiet)
    except KeyboardInterrupt:
        raise Interrupted(interrupted_survey(Path(args.out))) from None
    failed = ""
    # a model named now was said as it failed, with its reason; one that failed in an earlier run into this
    # folder and is not named now is said here, with its reason, since nothing above said it
    earlier = {name: why for name, why in result.failed.items() if name not in names}
    if result.failed and not args.quiet:
        now = [name for name in result.failed if name not in earlier]
        parts = ([f"{', '.join(now)}: the reason is above"] if now else []) + \
                [f"{name} in an earlier run: {why}" for name, why in earlier.items()]
        failed = f"; {len(result.failed)} failed ({'; '.join(parts)})"
    logs = Path(args.out) / "logs"
    log(args, f"wrote {Path(args.out) / 'table.parquet'} ({len(result.table)} rows) and the manifest; "
               f"{len(result.models())} model(s) done{failed}"
               + (f"; Ray's messages are in {logs}" if logs.is_dir() else ""))
    if args.quiet:  # nothing was said yet: one line per failed model
        for name, reason in result.failed.items():
            print(printable(f"vitlens: failed: {name}: {reason}"), file=sys.stderr)
    return EXIT_ERROR if result.failed else 0


def interrupted_survey(out: Path) -> str:
    """What a survey interrupted with Ctrl-C left in its folder, in words."""
    from vitlens.survey.store import SurveyStore

    store = SurveyStore(out)
    if store.manifest() is None:
        return "nothing was written."
    kept = store.finished_shards()
    if not kept:
        return f"no shard had finished; {out} holds the manifest only, and a rerun starts the shards over."
    return (f"{kept} finished shard{'s' * (kept != 1)} kept in {out}; a rerun with the same command resumes "
            "from them.")


def cmd_survey_report(args: argparse.Namespace) -> int:
    check_outputs(args)
    import vitlens as vl
    from vitlens.results import atomic_write_bytes
    from vitlens.report.survey import survey_figures, survey_html
    from vitlens.survey.store import DamagedSurveyWarning

    with warnings.catch_warnings():  # said below, in one line per model
        warnings.simplefilter("ignore", DamagedSurveyWarning)
        result = vl.load_survey(args.folder)
    for label, bad in result.damaged.items():
        print(printable(f"vitlens: warning: {label}: damaged shard files: "
                        + ", ".join(f"{name} ({why})" for name, why in bad.items())
                        + "; rerun the same vitlens survey command to set them aside and recompute them."),
              file=sys.stderr)
    if result.table.empty:
        raise CliError(f"{args.folder} holds no finished model yet; run vitlens survey first.")
    out = Path(args.out)
    atomic_write_bytes(out, survey_html(result).encode())
    if args.png:
        write_png({f"survey-{name}": fig for name, fig in survey_figures(result).items()}, Path(args.png))
    log(args, f"wrote {out}")
    return 0


__all__ = ["cmd_survey", "cmd_survey_report", "interrupted_survey"]
