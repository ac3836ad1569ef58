"""``vitlens report``, ``vitlens compare`` (Fig. 11) and ``vitlens models``: every view (paper Fig. 6, 7) of one or
more models as one offline HTML file plus its numbers, the attention distance of several models in one chart, the
presets and families. The library is imported inside each command (import cost: the parser answers first)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Sequence, cast

import numpy as np

from vitlens.words import counted

from .common import (ALL_METHODS, CliError, N_ROLLOUT_SHOWN, check_names, check_outputs, command_line, data_path,
                     load_all, log, refuse_fps, refuse_video_models, resolve_images, safe_name, write_png)


def cmd_video(args: argparse.Namespace, names: Sequence[str], compare: bool) -> int:
    """``report --video`` / ``compare --video``: the views of video models on one clip (``vitlens.report.video``)."""
    for option in ("attributions", "heads", "components", "cka", "sae", "train_sae"):
        if getattr(args, option, False):
            raise CliError(f"--{option.replace('_', '-')} reads images; leave it out with --video.")
    check_outputs(args)
    from vitlens.report.video import video_command
    from vitlens.results import atomic_write_bytes

    page, data, figs = video_command(args, names, compare, lambda line: log(args, line), load_all, command_line())
    if args.png:
        write_png({(f"comparison-{k}" if compare else k): f for k, f in figs.items()}, Path(args.png))
    out = Path(args.out)
    data.save(data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    log(args, f"wrote {out} and {data_path(out, args.data)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    for option in ("methods", "metrics"):
        if getattr(args, option, None) and not args.attributions:
            raise CliError(f"--{option} picks the {option} of the attribution section; add --attributions.")
    if args.sae and args.train_sae:
        raise CliError("--sae reads an SAE file and --train-sae trains one: give one of them.")
    if args.video:
        return cmd_video(args, args.model, compare=False)
    refuse_fps(args)
    check_outputs(args)
    import vitlens as vl
    from vitlens.environment import versions
    from vitlens.views.registry import available_views
    from vitlens.views.distance import AttentionDistanceResult
    from vitlens.report.data import ReportData
    from vitlens.report.html import report_figures, report_html
    from vitlens.results import atomic_write_bytes

    t_start = time.perf_counter()
    if args.sae:  # the file is read (and refused, when it is no SAE) before any model or image
        from vitlens.sae import load_sae

        args.sae = load_sae(args.sae)
    check_names(args.model)  # a misspelt name is said before the images are read or made
    images, image_set, masks, labels = resolve_images(args)
    models = load_all(args, args.model)
    refuse_video_models(models)  # a video model without --video
    analyses, shown, timings, tables, notes, heads, parts, saes = [], [], {}, [], {}, [], [], []
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
            parts.append(components_section(m, images[:args.component_images], lambda line: log(args, line)))
            timings[m.spec.name]["components"] = time.perf_counter() - t3
        if args.sae or args.train_sae:
            t4 = time.perf_counter()
            saes.append(_sae(args, m, images, labels))
            timings[m.spec.name]["sae"] = time.perf_counter() - t4
        done = a.distance.n_images if isinstance(a.distance, AttentionDistanceResult) else len(images)
        log(args, f"{m.spec.name}: analysed {counted(done, 'image')} in {t2 - t1:.1f} s")
    timings["total"] = {"total": time.perf_counter() - t_start}
    data = ReportData(models=[a.spec.name for a in analyses], analyses=analyses, image_set=image_set,
                      environment=versions(str(models[0].device)), timings=timings, command=command_line(),
                      attributions=tables, notes=notes, heads=heads,
                      weights={m.spec.name: m.weights for m in models}, components=parts, sae=saes)
    figs = report_figures(data, shown)
    page = report_html(data, shown, figs)
    if args.png:
        write_png({f"{i + 1}-{safe_name(a.spec.name)}-{name}": fig for i, (a, f) in enumerate(zip(analyses, figs))
                   for name, fig in f.items()}, Path(args.png))
    out = Path(args.out)
    data.save(data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    log(args, f"wrote {out} and {data_path(out, args.data)}")
    return 0


def _sae(args: argparse.Namespace, m: Any, images: list, labels: np.ndarray | None) -> Any:
    """The SAE section: the --sae file's features, or those of an SAE trained here on the report's images."""
    from vitlens.report.sae import sae_section
    from vitlens.sae import train_sae

    if args.sae:
        sae = args.sae  # read before the models (cmd_report)
    else:
        # the middle block: an edit of the last block's patch tokens cannot reach a head that reads the class token
        site = args.sae_site or f"blocks.{m.spec.num_layers // 2}.hook_resid_post"
        sae = train_sae(m, images, site=site, n_features=args.sae_features, k=args.sae_k, epochs=args.sae_epochs,
                        batch_size=args.batch_size, progress=not args.quiet)
        log(args, f"{m.spec.name}: {sae.summary()}")
    return sae_section(m, images, sae, labels=labels, log=lambda line: log(args, line))


def _heads(args: argparse.Namespace, m: Any, images: list, labels: np.ndarray | None) -> Any:
    """Head importance on the first --head-images images (labels when the images have them)."""
    import vitlens as vl

    if m.spec.num_classes <= 0:
        log(args, f"{m.spec.name}: no classifier head, so no head importance")
        return None
    n = min(args.head_images, len(images))
    return vl.head_importance(m, images[:n], labels=None if labels is None else labels[:n],
                              batch_size=args.batch_size, progress=not args.quiet)


def _attributions(args: argparse.Namespace, m: Any, images: list, masks: np.ndarray | None) -> Any:
    """Methods x metrics for the report, on the first --attribution-images images."""
    from vitlens.attribution import compare_methods

    if m.spec.num_classes <= 0:
        log(args, f"{m.spec.name}: no classifier head, so no attributions")
        return None
    from vitlens.attribution.sanity import quick_methods, sanity_table

    n = min(args.attribution_images, len(images))
    methods = report_methods(getattr(args, "methods", None), lambda line: log(args, line), m)
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
            log(args, f"{m.spec.name}: no AttnLRP ledger ({e})")
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
    from vitlens.views.spacetime import SpaceTimeDistanceResult
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
        d = vl.attention_distance(m, images, batch_size=args.batch_size, progress=not args.quiet)
        if isinstance(d, SpaceTimeDistanceResult):  # video models went to cmd_video above (refuse_video_models)
            raise CliError(f"{m.spec.name} is a video model: compare it with --video CLIP.")
        distances.append(d)
        first = images[:1]
        rollouts.append((m.spec.name, vl.attention_rollout(m, first), m.display(first)[0]))
        timings[m.spec.name] = time.perf_counter() - t0
        caveat = m.prediction_caveat(image_set["source"])
        if caveat:
            notes.append(f"{m.spec.name}: {caveat}")
        log(args, f"{m.spec.name}: {distances[-1].n_images} images in {timings[m.spec.name]:.1f} s")
    timings["total"] = time.perf_counter() - t_start
    data = comparison(distances, [m.spec.name for m in models], args.local_threshold, args.first_layers,
                      image_set=image_set, environment=versions(str(models[0].device)), timings=timings,
                      command=command_line(), weights=[m.weights for m in models],
                      kinds=[m.spec.kind for m in models])
    if args.cka:
        data.cka = [vl.cka(models[0], other, images, batch_size=max(4, args.batch_size), progress=not args.quiet)
                    for other in models[1:]]
    figs = comparison_figures(data, rollouts)
    page = comparison_html(data, rollouts, figs, notes)
    if args.png:
        write_png({f"comparison-{name}": fig for name, fig in figs.items()}, Path(args.png))
    out = Path(args.out)
    data.save(data_path(out, args.data))
    atomic_write_bytes(out, page.encode())
    log(args, data.reading())
    log(args, data.local_statement()[:1].upper() + data.local_statement()[1:] + ".")
    log(args, f"wrote {out} and {data_path(out, args.data)}")
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
        for scheme in cast(list, fam["names"]):  # describe_families: each family's name schemes, a list of text
            print(f"  {'':16s}   {scheme}")
    print("\nWeights: hub weights by default (from the cache, or downloaded); --random-init for random weights "
          "(offline); a local checkpoint file with --model FILE --arch NAME (.safetensors, .pth/.pt/.bin, "
          "original ViT .npz; NAME a timm name or ref-vit / ref-hybrid).")
    print("Refused, since vitlens cannot read their attention exactly (timm modules):")
    for module, why in REFUSED_FAMILIES.items():
        print(f"  {module:28s} {why}")
    return 0


__all__ = ["cmd_compare", "cmd_models", "cmd_report", "cmd_video", "report_methods"]
