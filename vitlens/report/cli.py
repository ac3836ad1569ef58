"""Command line: ``vitlens report|compare|models|survey|survey-report`` (also ``python -m vitlens``).

report        — every view (paper Fig. 6, 7) for one or more models, one offline HTML file plus data.
compare       — Fig. 11: attention distance per head by layer for several models in one chart.
(both take ``--video CLIP`` for video models: the views in space and time of one clip, ``report.video``)
models        — the presets and the model families vitlens reads.
survey        — a model zoo x an image set on Ray, resumable, one tidy table (Fig. 11 across a zoo).
survey-report — one offline HTML page of a survey folder.

Bad input ends with a one-line message on stderr and exit code 2 (1 for unexpected errors),
no traceback unless --debug; a bad argument is refused before torch or any analysis module is imported (the
parser reads the registries behind ``--methods``, ``--metrics`` and ``--views`` only when one of them is given
or help is shown). Every model is loaded (and so checked) before the first is
analysed. Output files are written atomically, only once everything succeeded: a failure never
leaves half a report or replaces a good one.
"""
from __future__ import annotations

import argparse
import errno
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

import numpy as np

from vitlens.words import counted, printable

EXIT_USAGE, EXIT_ERROR = 2, 1


def _count(n: int, noun: str) -> str:
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
        check_writable(_data_path(out, args.data), "--data")
    if getattr(args, "png", None):
        check_writable(args.png, "--png", folder=True)


def _log(args: argparse.Namespace, msg: str) -> None:
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
        good, skipped, why = [], [], {}
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
        reasons = [f"{name} ({why[name]})" for name in skipped[:5]] + ([f"... and {len(skipped) - 5} more"] if len(skipped) > 5 else [])
        if skipped and args.strict:
            raise CliError(f"{_count(len(skipped), 'image')} could not be read (--strict): " + " ".join(reasons))
        if skipped and good:
            for reason in reasons:
                _log(args, f"warning: skipped {reason}")
        if not good:
            raise CliError(f"None of the images under {args.images!r} could be read: " + " ".join(reasons))
        for t in tiny:
            _log(args, f"warning: {t}")
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


def _data_path(out: Path, data: str | None) -> Path:
    return Path(data) if data else out.with_suffix(".json")


def refuse_fps(args: argparse.Namespace) -> None:
    """``--fps`` is a clip's frame rate: refused without ``--video``."""
    if args.fps is not None:
        raise CliError("--fps is a clip's frame rate; give the clip with --video CLIP.")


def refuse_video_models(models: Sequence[Any]) -> None:
    """A video model given images: refused in one line (``report.video.refuse_video_models``)."""
    from vitlens.report.video import refuse_video_models as refuse

    refuse(models)


def cmd_video(args: argparse.Namespace, names: Sequence[str], compare: bool) -> int:
    """``report --video`` / ``compare --video``: the views of video models on one clip (``vitlens.report.video``)."""
    for option in ("attributions", "heads", "components", "cka"):
        if getattr(args, option, False):
            raise CliError(f"--{option} reads images; leave it out with --video.")
    check_outputs(args)
    from vitlens.report.video import video_command
    from vitlens.results import atomic_write_bytes

    page, data, figs = video_command(args, names, compare, lambda line: _log(args, line), load_all, _command())
    if args.png:
        write_png({(f"comparison-{k}" if compare else k): f for k, f in figs.items()}, Path(args.png))
    out = Path(args.out)
    data.save(_data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    _log(args, f"wrote {out} and {_data_path(out, args.data)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    for option in ("methods", "metrics"):
        if getattr(args, option, None) and not args.attributions:
            raise CliError(f"--{option} picks the {option} of the attribution section; add --attributions.")
    if args.video:
        return cmd_video(args, args.model, compare=False)
    refuse_fps(args)
    check_outputs(args)
    import vitlens as vl
    from vitlens.environment import versions
    from vitlens.views.registry import available_views
    from vitlens.report.data import ReportData
    from vitlens.report.html import report_figures, report_html
    from vitlens.results import atomic_write_bytes

    t_start = time.perf_counter()
    check_names(args.model)  # a misspelt name is said before the images are read or made
    images, image_set, masks, labels = resolve_images(args)
    models = load_all(args, args.model)
    refuse_video_models(models)  # a video model without --video
    analyses, shown, timings, tables, notes, heads, parts = [], [], {}, [], {}, [], []
    for m in models:
        t1 = time.perf_counter()
        a = vl.analyze(m, images, batch_size=args.batch_size, progress=not args.quiet, views=available_views(m))
        t2 = time.perf_counter()
        shown.append(m.display(images[:N_ROLLOUT_SHOWN]))
        analyses.append(a)
        timings[m.spec.name] = {"analyze": t2 - t1}
        notes[m.spec.name] = m.prediction_caveat(image_set["source"])
        if args.heads:
            heads.append(_heads(args, m, images, labels))
        if args.attributions:
            tables.append(_attributions(args, m, images, masks))
            timings[m.spec.name]["attributions"] = time.perf_counter() - t2
        if args.components:
            from vitlens.report.components import components_section

            t3 = time.perf_counter()
            parts.append(components_section(m, images[:args.component_images], lambda line: _log(args, line)))
            timings[m.spec.name]["components"] = time.perf_counter() - t3
        _log(args, f"{m.spec.name}: analysed {counted(a.distance.n_images, 'image')} in {t2 - t1:.1f} s")
    timings["total"] = {"total": time.perf_counter() - t_start}
    data = ReportData(models=[a.spec.name for a in analyses], analyses=analyses, image_set=image_set,
                      environment=versions(str(models[0].device)), timings=timings, command=_command(),
                      attributions=tables, notes=notes, heads=heads,
                      weights={m.spec.name: m.weights for m in models}, components=parts)
    figs = report_figures(data, shown)
    page = report_html(data, shown, figs)
    if args.png:
        write_png({f"{i + 1}-{_safe(a.spec.name)}-{name}": fig for i, (a, f) in enumerate(zip(analyses, figs))
                   for name, fig in f.items()}, Path(args.png))
    out = Path(args.out)
    data.save(_data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    _log(args, f"wrote {out} and {_data_path(out, args.data)}")
    return 0


def _heads(args: argparse.Namespace, m: Any, images: list, labels: np.ndarray | None) -> Any:
    """Head importance on the first --head-images images (labels when the images have them)."""
    import vitlens as vl

    if m.spec.num_classes <= 0:
        _log(args, f"{m.spec.name}: no classifier head, so no head importance")
        return None
    n = min(args.head_images, len(images))
    return vl.head_importance(m, images[:n], labels=None if labels is None else labels[:n],
                              batch_size=args.batch_size, progress=not args.quiet)


def _attributions(args: argparse.Namespace, m: Any, images: list, masks: np.ndarray | None) -> Any:
    """Methods x metrics for the report, on the first --attribution-images images."""
    from vitlens.attribution import compare_methods

    if m.spec.num_classes <= 0:
        _log(args, f"{m.spec.name}: no classifier head, so no attributions")
        return None
    from vitlens.attribution.sanity import quick_methods, sanity_table

    n = min(args.attribution_images, len(images))
    methods = report_methods(getattr(args, "methods", None), lambda line: _log(args, line), m)
    quick = quick_methods()
    table = compare_methods(m, images[:n], methods=methods, masks=None if masks is None else masks[:n],
                            batch_size=args.batch_size, progress=not args.quiet, metrics=getattr(args, "metrics", None))
    # the cascade recomputes every map L + 2 times: the quick methods on at most 4 images
    checked = [mt for mt in methods if mt in quick]
    table.sanity = sanity_table(m, images[:min(n, 4)], methods=checked, batch_size=args.batch_size,
                                progress=not args.quiet) if checked else None
    from vitlens.attribution.lrp_ledger import attnlrp_ledger, lrp_methods

    lrp = [mt for mt in lrp_methods() if mt in methods]
    if lrp:  # where AttnLRP's relevance goes (the first AttnLRP method run), on the images the sanity check uses
        from vitlens.errors import ViewNotAvailableError

        try:
            table.ledger = attnlrp_ledger(m, images[:min(n, 4)], batch_size=args.batch_size, method=lrp[0])
        except ViewNotAvailableError as e:
            _log(args, f"{m.spec.name}: no AttnLRP ledger ({e})")
    return table


def report_methods(picked: Sequence[str] | None, log: Any = None, model: Any = None) -> list[str]:
    """The attribution methods of a report, read from ``METHOD_TABLE``: those ``--methods`` picked; ``all`` for
    every method available here (one whose extra package is missing is left out, and ``log`` says which and
    how to install it); by default the quick set the app preselects too (``Method.preselected``: rollout,
    grad_rollout, saliency), so a default report's attributions take seconds, and the slow methods
    (integrated gradients, occlusion, the CAMs, AttnLRP) are a choice. Given the model (or its kind), only the
    methods defined for its kind (``methods_for``: a hierarchical model has rollout, captum's input methods and
    the CAMs). A picked method that is not available, or not defined for the model, is a CliError."""
    from vitlens.attribution.methods import (METHOD_TABLE, available_methods, methods_for, missing_packages,
                                             preselected_methods, refusal)

    defined = tuple(METHOD_TABLE) if model is None else methods_for(model)
    available = tuple(k for k in available_methods() if k in defined)
    if picked and ALL_METHODS not in picked:
        undefined = [name for name in picked if name not in defined]
        if undefined:  # left out of this model's section (another model of the report may have them), or refused
            line = (refusal(model, undefined[0]) if hasattr(model, "spec") else
                    f"{', '.join(undefined)} {'is' if len(undefined) == 1 else 'are'} not defined for this kind of "
                    f"model; the methods defined for it: {', '.join(defined)}.")
            picked = [name for name in picked if name in defined]
            if not picked or log is None:
                raise CliError(line)
            log(f"{getattr(getattr(model, 'spec', None), 'name', 'this model')}: no {', '.join(undefined)} ({line})")
        missing = [name for name in picked if name not in available]
        if missing:
            raise CliError(f"{', '.join(missing)} need{'s' if len(missing) == 1 else ''} "
                           f"{', '.join(sorted({METHOD_TABLE[k].package for k in missing}))}, which is not installed. "
                           + " ".join(sorted({METHOD_TABLE[k].install for k in missing if METHOD_TABLE[k].install})))
        return list(dict.fromkeys(picked))
    if not picked:
        return [k for k in preselected_methods(model) if k in available]
    if log is not None:
        for package, install in missing_packages().items():
            left = [k for k, mt in METHOD_TABLE.items() if mt.package == package and k in defined]
            log(f"{package} is not installed, so no {', '.join(left)} ({install})")
    return list(available)


#: ``--methods all``: every available attribution method (the report's default is the quick, preselected set)
ALL_METHODS = "all"


def cmd_compare(args: argparse.Namespace) -> int:
    if len(args.models) < 2:
        raise CliError("compare needs at least two models: --models A B [...].")
    if args.video:
        return cmd_video(args, args.models, compare=True)
    refuse_fps(args)
    check_outputs(args)
    import vitlens as vl
    from vitlens.environment import versions
    from vitlens.report.data import comparison
    from vitlens.report.html import comparison_figures, comparison_html
    from vitlens.results import atomic_write_bytes
    from vitlens.views.distance import LOCAL_OF_UNIFORM

    if args.local_threshold is None:
        args.local_threshold = LOCAL_OF_UNIFORM
    t_start = time.perf_counter()
    check_names(args.models)
    images, image_set, _, _ = resolve_images(args)
    models = load_all(args, args.models)
    refuse_video_models(models)
    distances, rollouts, timings, notes = [], [], {}, []
    for m in models:
        t0 = time.perf_counter()
        distances.append(vl.attention_distance(m, images, batch_size=args.batch_size, progress=not args.quiet))
        first = images[:1]
        rollouts.append((m.spec.name, vl.attention_rollout(m, first), m.display(first)[0]))
        timings[m.spec.name] = time.perf_counter() - t0
        caveat = m.prediction_caveat(image_set["source"])
        if caveat:
            notes.append(f"{m.spec.name}: {caveat}")
        _log(args, f"{m.spec.name}: {distances[-1].n_images} images in {timings[m.spec.name]:.1f} s")
    timings["total"] = time.perf_counter() - t_start
    data = comparison(distances, [m.spec.name for m in models], args.local_threshold, args.first_layers,
                      image_set=image_set, environment=versions(str(models[0].device)), timings=timings,
                      command=_command(), weights=[m.weights for m in models],
                      kinds=[m.spec.kind for m in models])
    if args.cka:
        data.cka = [vl.cka(models[0], other, images, batch_size=max(4, args.batch_size), progress=not args.quiet)
                    for other in models[1:]]
    figs = comparison_figures(data, rollouts)
    page = comparison_html(data, rollouts, figs, notes)
    if args.png:
        write_png({f"comparison-{name}": fig for name, fig in figs.items()}, Path(args.png))
    out = Path(args.out)
    data.save(_data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    _log(args, data.reading())
    _log(args, data.local_statement()[:1].upper() + data.local_statement()[1:] + ".")
    _log(args, f"wrote {out} and {_data_path(out, args.data)}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from vitlens.families import REFUSED_FAMILIES, describe_families
    from vitlens.loading.presets import list_models

    print("Presets (vitlens report --model NAME):")
    for p in list_models():
        print(f"  {p.name:48s} {p.description}{'' if p.needs_download else ' [embedded, offline]'}")
    print("\nModel families vitlens reads (--model takes any name of these forms):")
    for fam in describe_families():
        print(f"  {fam['name']:16s} {fam['reads']}")
        for scheme in fam["names"]:
            print(f"  {'':16s}   {scheme}")
    print("\nWeights: hub weights by default (from the cache, or downloaded); --random-init for random weights "
          "(offline); a local checkpoint file with --model FILE --arch NAME (.safetensors, .pth/.pt/.bin, "
          "original ViT .npz; NAME a timm name or ref-vit / ref-hybrid).")
    print("Refused, since vitlens cannot read their attention exactly (timm modules):")
    for module, why in REFUSED_FAMILIES.items():
        print(f"  {module:28s} {why}")
    return 0


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
    _log(args, f"wrote {Path(args.out) / 'table.parquet'} ({len(result.table)} rows) and the manifest; "
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
    _log(args, f"wrote {out}")
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
    src.add_argument("--video", default=None, metavar="CLIP", help="a clip for video models: a video file, an "
                     "animated GIF or a folder of frames, sampled as each model's processor samples it")
    p.add_argument("--fps", type=_positive_float, default=None,
                   help="the clip's frame rate, where the file does not give it (temporal distances in seconds)")
    p.add_argument("--n-images", type=_positive, default=128, help="use at most this many images (default 128)")
    p.add_argument("--batch-size", type=_positive, default=32,
                   help="images per forward (default 32; lower it when memory runs short)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--arch", default=None, help="architecture of a local checkpoint file (timm name or ref-vit)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights instead of pretrained hub weights (timm names; embedded models keep theirs)")
    p.add_argument("--seed", type=int, default=0, help="seed for random-init weights (default 0)")
    p.add_argument("--data", default=None, help="where to write the numbers (default: OUT with .json)")
    p.add_argument("--png", default=None, metavar="DIR", help="also write static PNGs of every figure (kaleido)")
    p.add_argument("--strict", action="store_true", help="stop on unreadable images instead of skipping them")
    p.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


class Parser(argparse.ArgumentParser):
    """argparse with the command line's rules: an error is one line on stderr and exit code 2 (no usage block;
    the line says where the usage is), and an option's help that reads a registry (``later_help``) is written only
    when help is shown, so that parsing imports nothing heavy. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        for action in self._actions:
            later = getattr(action, "later_help", None)
            if later is not None:
                action.help = later()
        return super().format_help()


def later_help(action: argparse.Action, write: Callable[[], str]) -> None:
    """Give ``action`` help that ``write`` composes when help is shown (``Parser.format_help``), not when parsed."""
    action.later_help = write  # type: ignore[attr-defined]


class Names:
    """The choices of an option read from a registry at their first use: argparse asks ``in`` (and lists them in an
    error) only when the option is given, so the registry's module (and torch) is imported only then."""

    def __init__(self, read: Callable[[], Sequence[str]]) -> None:
        self._read = read

    def __contains__(self, name: object) -> bool:
        return name in self._read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())


def _methods() -> list[str]:
    from vitlens.attribution.methods import METHOD_TABLE

    return [*METHOD_TABLE, ALL_METHODS]


def _metrics() -> list[str]:
    from vitlens.attribution.metrics import METRIC_TABLE

    return list(METRIC_TABLE)


def _survey_views() -> list[str]:
    from vitlens.survey.stats import SURVEY_VIEW_NAMES

    return list(SURVEY_VIEW_NAMES)


def _default_survey_views() -> list[str]:
    from vitlens.survey.stats import DEFAULT_SURVEY_VIEW_NAMES

    return list(DEFAULT_SURVEY_VIEW_NAMES)


def _methods_help() -> str:
    from vitlens.attribution.methods import METHOD_TABLE, methods_for
    from vitlens.kinds import HIERARCHICAL

    return ("attribution methods for --attributions (default: the quick set, "
            f"{', '.join(k for k, mt in METHOD_TABLE.items() if mt.preselected)}; "
            f"'{ALL_METHODS}' for every available one, the slow ones included; each model gets those "
            f"defined for its kind, a hierarchical one (Swin) {', '.join(methods_for(HIERARCHICAL.name))}): "
            + ", ".join(METHOD_TABLE))


def _metrics_help() -> str:
    from vitlens.attribution.metrics import METRIC_TABLE

    return ("perturbation metrics for --attributions (default: "
            f"{', '.join(k for k, mt in METRIC_TABLE.items() if mt.default)}): "
            + "; ".join(f"{k} ({mt.cost})" if mt.cost else k for k, mt in METRIC_TABLE.items()))


def _local_threshold_help() -> str:
    from vitlens.views.distance import LOCAL_OF_UNIFORM

    return ("a head is local at or below this multiple of the uniform-attention distance on its grid (default "
            f"{LOCAL_OF_UNIFORM:g}, the one definition every view uses)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> Parser:
    """The command line's parser; building it and parsing valid or invalid arguments import no analysis module."""
    p = Parser(prog="vitlens", description="Interpretability reports for Vision Transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="every view for one or more models (Fig. 6, 7)")
    r.add_argument("--model", action="append", default=None, help="model name or checkpoint (repeatable; "
                   "default ref-vit)")
    r.add_argument("--out", default="report.html", metavar="FILE",
                   help="the HTML report to write (default report.html; the numbers go beside it as .json)")
    r.add_argument("--attributions", action="store_true",
                   help="add class-specific attributions (captum, grad-rollout) and their faithfulness scores")
    later_help(r.add_argument("--methods", nargs="+", default=None, choices=Names(_methods), metavar="METHOD",
                              help="attribution methods for --attributions"), _methods_help)
    later_help(r.add_argument("--metrics", nargs="+", default=None, choices=Names(_metrics), metavar="METRIC",
                              help="perturbation metrics for --attributions"), _metrics_help)
    r.add_argument("--attribution-images", type=_positive, default=16,
                   help="images for the attribution section (default 16; occlusion and IG are costly)")
    r.add_argument("--heads", action="store_true",
                   help="add head importance (one head removed at a time) against attention distance")
    r.add_argument("--head-images", type=_positive, default=32,
                   help="images for head importance (default 32; it costs one forward per head and image)")
    r.add_argument("--components", action="store_true",
                   help="add the components: each head's part of the predicted class's logit with the ledger that "
                        "closes the sum, the logit lens and token norms by depth")
    r.add_argument("--component-images", type=_positive, default=4,
                   help="images for the components section (default 4)")
    r.set_defaults(func=cmd_report)
    _common(r)
    c = sub.add_parser("compare", help="attention distance of several models in one chart (Fig. 11)")
    c.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"], metavar="MODEL",
                   help="the models to compare: names, hf:FOLDER or checkpoint files as --model takes them "
                        "(default ref-vit ref-hybrid)")
    c.add_argument("--out", default="compare.html", metavar="FILE",
                   help="the HTML comparison to write (default compare.html; the numbers go beside it as .json)")
    later_help(c.add_argument("--local-threshold", type=float, default=None,
                              help="a head is local at or below this multiple of the uniform-attention distance"),
               _local_threshold_help)
    c.add_argument("--first-layers", type=_positive, default=4, help="layers counted for the local share")
    c.add_argument("--cka", action="store_true",
                   help="add layer-by-layer representation similarity (linear CKA) of each model with the first")
    c.set_defaults(func=cmd_compare)
    _common(c)
    ls = sub.add_parser("models", help="list the presets and the model families vitlens reads")
    ls.set_defaults(func=cmd_models, debug=False)
    sv = sub.add_parser("survey", help="a model zoo x an image set on Ray: resumable, one tidy table (Fig. 11 "
                                       "across a zoo)")
    sv.add_argument("--models", nargs="+", default=None,
                    help="model names, or local checkpoints as PATH@ARCH (runs/e3.safetensors@vit_tiny_patch16_224)")
    sv.add_argument("--models-file", default=None,
                    help="a file with one model name or PATH@ARCH per line (# comments)")
    sv.add_argument("--images", default=None, help="folder (searched recursively) or glob of images; default: "
                                                   "held-out shapes scenes")
    sv.add_argument("--per-class", action="store_true", help="each image's parent folder is its class")
    sv.add_argument("--clips", default=None, help="a folder of clips (videos, animated GIFs; searched recursively) "
                                                  "for video models: shards of clips, the space-time statistics")
    sv.add_argument("--out", required=True, help="the survey folder (a rerun continues it)")
    sv.add_argument("--address", default=None, help="a Ray cluster ('auto', 'ray://host:10001'); default: "
                                                    "RAY_ADDRESS, else a local Ray on this machine's cores")
    sv.add_argument("--batch-size", type=_positive, default=32,
                    help="images per forward on each worker (default 32)")
    sv.add_argument("--shard-size", type=_positive, default=256, help="images per task (default 256)")
    later_help(sv.add_argument("--views", nargs="+", default=None, choices=Names(_survey_views), metavar="VIEW",
                               help="the views to survey"),
               lambda: f"the views to survey: {', '.join(_survey_views())} (default "
                       f"{', '.join(_default_survey_views())})")
    sv.add_argument("--num-gpus-per-worker", type=float, default=0.0,
                    help="GPUs each model worker asks Ray for (default 0: CPU; a worker with a GPU runs on it)")
    sv.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where the model workers run, as for report and compare: cuda asks Ray for one GPU per "
                         "worker (--num-gpus-per-worker 1), cpu for none (default: --num-gpus-per-worker)")
    weights = sv.add_mutually_exclusive_group()
    weights.add_argument("--pretrained", dest="pretrained", action="store_true", default=True,
                         help="hub weights (the default)")
    weights.add_argument("--random-init", dest="pretrained", action="store_false",
                         help="random weights for hub models (seeded); the embedded models and PATH@ARCH checkpoints "
                              "keep their own weights, which the run says")
    sv.add_argument("--n-images", type=_positive, default=None, help="use at most this many images (default: "
                                                                     "every file; 128 shapes scenes)")
    sv.add_argument("--max-images", dest="n_images", type=_positive, default=None, help=argparse.SUPPRESS)
    sv.add_argument("--strict", action="store_true", help="stop at the first model that fails")
    sv.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    sv.add_argument("--debug", action="store_true", help="show tracebacks")
    sv.set_defaults(func=cmd_survey)
    sr = sub.add_parser("survey-report", help="one offline HTML page of a survey folder")
    sr.add_argument("folder", help="the survey folder that vitlens survey --out wrote")
    sr.add_argument("--out", default="survey.html", metavar="FILE", help="the HTML page to write (default survey.html)")
    sr.add_argument("--png", default=None, metavar="DIR", help="also write the figures as PNGs (kaleido)")
    sr.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    sr.add_argument("--debug", action="store_true", help="show tracebacks")
    sr.set_defaults(func=cmd_survey_report)
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
        text = e.message_for("cli") if isinstance(e, VitlensError) else str(e)
        print(printable(f"vitlens: error: {text}", newlines=True), file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as e:
        print(printable(f"vitlens: interrupted; {e}"), file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("vitlens: interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # a full disk is the machine's state, not a bug
            where = e.filename or getattr(args, "out", None) or "the output folder"
            print(f"vitlens: error: no space left on device at {where}; free some space or write elsewhere "
                  "(--out), then rerun.", file=sys.stderr)
            return EXIT_ERROR
        print(printable(f"vitlens: unexpected error ({type(e).__name__}: {e}); rerun with --debug for the traceback."),
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
