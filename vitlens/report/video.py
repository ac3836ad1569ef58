"""``vitlens report --video CLIP`` and ``vitlens compare --video CLIP`` (issue 50): the views of video models on one
clip, as one offline HTML page (plotly.js inlined once) plus the numbers as data, as the image reports write them.

The clip is read by ``vl.read_clip`` (a video file, an animated GIF or a folder of frames), sampled and preprocessed
as the model's processor does (``vl.clip_pixel_values``); the views are those the registry lists for the model's
kind (``available_views``: the space-time distance and rollout, the video weight views), each drawn by the figure
registered for its result (``figures.figure_for``), the rollout over the frames as the model sees them. Pure
composition, as ``vitlens.report.html``: the numbers come from the result objects, the pictures from
``vitlens.figures``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import numpy as np
import plotly.graph_objects as go

from .. import figures
from ..errors import InvalidParameterError
from ..figures.spacetime import spacetime_compare_figure, spacetime_rollout_figure
from ..kinds import kind_of
from ..views.analyze import AnalysisResult
from ..views.registry import VIEWS as REGISTRY
from ..views.spacetime import SpaceTimeDistanceResult
from ..words import counted
from .data import ReportData
from .html import figure_html, html_table, page_html
from vitlens.environment import versions
import vitlens as vl
from vitlens.clips import sampled_clip

#: the registry's names of the two views of the clip itself (the others are of the weights)
DISTANCE, ROLLOUT = "spacetime_distance", "spacetime_rollout"


@dataclass
class ClipRun:
    """One video model's views of the clip, with the frames as it sees them (for the rollout's overlay)."""

    analysis: AnalysisResult
    frames: np.ndarray
    weights: str
    seconds: float
    source_frames: int
    fps: float | None

    def sampling(self) -> str:
        """Which of the clip's frames the model reads, and at what rate."""
        n = self.frames.shape[0]
        rate = f", {self.fps:.4g} fps" if self.fps is not None else ""
        return f"reads {n} of the clip's {self.source_frames} frames, sampled uniformly{rate}"


def file_safe(name: str) -> str:
    """A model's name as part of a file name (``hf:/path/model`` -> ``hf__path_model``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def clip_description(path: str, clip: Any, fps: float | None, fps_given: bool) -> dict:
    """What the report says of the clip (its header and the data's ``image_set``): ``clip`` is any read of it (its
    first frame at the source's size is enough: the count is the source's)."""
    h, w = clip.size
    rate = (f"{fps:g} fps ({'--fps' if fps_given else 'from the file'})" if fps is not None else
            "frame rate unknown (temporal distances in frames; give --fps for seconds)")
    return {"source": "clip", "description": f"{path}: {clip.source_frames} frames of {w}x{h}, {rate}", "count": 1,
            "frames": clip.source_frames, "fps": fps, "skipped": []}


def refuse_image_models(models: Sequence[Any]) -> None:
    """``--video`` with a model that reads images: refused in one line naming it."""
    for m in models:
        if not kind_of(m).clips:
            raise InvalidParameterError(
                f"--video takes video models; {m.spec.name} reads images ({kind_of(m).label}): give it --images, "
                "or a video model (VideoMAE, ViViT, V-JEPA 2, TimeSformer: hf:NAME or hf:FOLDER).")


def refuse_video_models(models: Sequence[Any]) -> None:
    """A video model without ``--video``: refused in one line naming it."""
    for m in models:
        if kind_of(m).clips:
            raise InvalidParameterError(f"{m.spec.name} is a video model: give it a clip with --video CLIP (a video "
                                        "file, an animated GIF or a folder of frames).")


def model_frames(pixels: Any, m: Any) -> np.ndarray:
    """A preprocessed clip [frames, 3, H, W] back to uint8 [frames, H, W, 3], as the model sees it (after the
    resize and crop): the preprocessing is affine per channel after the crop, so it is inverted from what it makes
    of an all-0 and an all-255 clip (``clip_pixel_values``), whatever the processor's statistics."""
    f, _, h, w = pixels.shape
    ends = [vl.clip_pixel_values(np.full((f, h, w, 3), v, np.uint8), m)[0, 0, :, 0, 0].double() for v in (0, 255)]
    scale = (ends[1] - ends[0]) / 255.0
    u = (pixels.double() - ends[0][None, :, None, None]) / scale[None, :, None, None]
    return np.clip(np.round(u.permute(0, 2, 3, 1).numpy()), 0, 255).astype(np.uint8)


def sampled_fps(source_fps: float | None, sampled: int, total: int) -> float | None:
    """The frame rate of the frames a model reads: its processor samples ``sampled`` of the clip's ``total`` frames
    uniformly, so they come at ``source_fps * sampled / total`` on average (what ``fps=`` of the views means:
    seconds = frames read / fps); None without a rate."""
    return None if source_fps is None else float(source_fps) * sampled / total


def run_clip(m: Any, clip: Any, fps: float | None, batch_size: int, views: Sequence[str] | None = None) -> ClipRun:
    """The views of one video model on the clip (a path or a ``vl.Clip``; by default every view the registry lists
    for its kind); ``fps`` is the clip's own rate (the temporal distances in seconds at the rate of the frames the
    model samples). A file is read for each model as its processor samples it (``sampled_clip``: only those frames
    kept, each resized as it decodes)."""
    import time


    t0 = time.perf_counter()
    sampled = sampled_clip(clip, m)
    x = vl.clip_pixel_values(sampled, m)
    total = cast(int, sampled.source_frames)  # Clip.__post_init__ always sets it
    rate = sampled_fps(fps, x.shape[1], total)
    a = vl.analyze(m, x, batch_size=batch_size, views=tuple(views or vl.available_views(m)), fps=rate)
    return ClipRun(a, model_frames(x[0], m), m.weights, time.perf_counter() - t0, total, rate)


def run_figures(run: ClipRun) -> dict[str, go.Figure]:
    """Each view's figure by its name (the registered figure of its result), the rollout over the frames."""
    figs: dict[str, go.Figure] = {}
    for name in run.analysis.views:
        result = run.analysis.view(name)
        if result is None:
            continue
        fig = spacetime_rollout_figure(result, frames=run.frames) if name == ROLLOUT else figures.figure_for(result)
        if fig is not None:
            figs[name] = fig
    return figs


def distance_rows(d: SpaceTimeDistanceResult) -> list[dict]:
    """One row per map: its block and role, the heads' mean, least and most distance in space and in time, and
    uniform attention's (the divided maps' by-construction zeros left out)."""
    rows = []
    unit = "s" if d.fps else "frames"
    scale = 1.0 / d.fps if d.fps else 1.0
    for i, (role, block) in enumerate(zip(d.roles, d.blocks)):
        s, t = d.spatial_px[i], d.temporal_frames[i] * scale
        space, time = role != "temporal", role != "spatial"  # a divided map's other distance is 0 by construction
        values = {"spatial px (mean)": s.mean(), "min px": s.min(), "max px": s.max(),
                  "uniform px": d.baseline_spatial_px[i]} if space else {}
        values.update({f"temporal {unit} (mean)": t.mean(), f"min {unit}": t.min(), f"max {unit}": t.max(),
                       f"uniform {unit}": d.baseline_temporal_frames[i] * scale} if time else {})
        keys = ("spatial px (mean)", "min px", "max px", "uniform px", f"temporal {unit} (mean)", f"min {unit}",
                f"max {unit}", f"uniform {unit}")  # every row the same columns, in this order
        row = {"block": block + 1, "map": role, **{k: float(values[k]) if k in values else None for k in keys}}
        rows.append(row)
    return rows


def _header(title: str, image_set: dict, environment: dict, seconds: dict[str, float]) -> str:
    env = ", ".join(f"{k} {html.escape(str(v))}" for k, v in environment.items())
    times = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    return (f"<h1>{html.escape(title)}</h1><p class='muted'>{env}</p>"
            f"<p>Clip: {html.escape(image_set['description'])}</p><p class='muted'>Timings: {html.escape(times)}</p>")


def _caveat(weights: str) -> str:
    return ("<p class='note'>Random weights: the views show an untrained model (useful for checking the machinery, "
            "not for reading the model).</p>" if weights == "random init" else "")


def model_html(run: ClipRun, figs: dict[str, go.Figure]) -> str:
    """One model's section: its facts, then each view under its registry heading (its figure, the distance's
    numbers by map, or the note saying why it is not available)."""
    a = run.analysis
    parts = [f"<h2>{html.escape(a.spec.name)}</h2>", html_table([a.spec.describe()]), _caveat(run.weights),
             f"<p>The model {html.escape(run.sampling(), quote=False)}.</p>"]
    for name in a.views:
        parts.append(f"<h3>{html.escape(REGISTRY[name].heading)}</h3>")
        if name in figs:
            parts.append(figure_html(figs[name]))
        elif name in a.notes:
            parts.append(f"<p class='note'>{html.escape(a.notes[name])}</p>")
        if name == DISTANCE and a.view(name) is not None:
            parts.append(html_table(distance_rows(a.view(name)), "{:.3g}"))
    return "".join(parts)


def report_data(runs: Sequence[ClipRun], image_set: dict, environment: dict, command: str) -> ReportData:
    """The numbers of a video report or comparison (every model's ``AnalysisResult``), saved as the image report's."""
    timings = {r.analysis.spec.name: {"analyze": r.seconds} for r in runs}
    return ReportData(models=[r.analysis.spec.name for r in runs], analyses=[r.analysis for r in runs],
                      image_set=image_set, environment=environment, timings=timings, command=command,
                      weights={r.analysis.spec.name: r.weights for r in runs})


def video_report_html(runs: Sequence[ClipRun], figs: Sequence[dict[str, go.Figure]], image_set: dict,
                      environment: dict) -> str:
    """The report page: the clip, then every model's views."""
    seconds = {r.analysis.spec.name: r.seconds for r in runs}
    body = [_header("vitlens report (video)", image_set, environment, seconds)]
    body += [model_html(r, f) for r, f in zip(runs, figs)]
    return page_html("vitlens report (video)", "".join(body))


def comparison_figures(runs: Sequence[ClipRun]) -> dict[str, go.Figure]:
    """The space-time Fig. 11 of the models and each model's rollout over the frames."""
    names = [r.analysis.spec.name for r in runs]
    figs = {"distance": spacetime_compare_figure([r.analysis.view(DISTANCE) for r in runs], names)}
    for i, r in enumerate(runs):
        figs[f"rollout-{i + 1}"] = spacetime_rollout_figure(r.analysis.view(ROLLOUT), frames=r.frames)
    return figs


def video_comparison_html(runs: Sequence[ClipRun], figs: dict[str, go.Figure], image_set: dict,
                          environment: dict) -> str:
    """The comparison page: Fig. 11 in space and time, the numbers by map of each model, the rollouts."""
    seconds = {r.analysis.spec.name: r.seconds for r in runs}
    body = [_header("vitlens comparison (video, Fig. 11 in space and time)", image_set, environment, seconds),
            f"<h2>{html.escape(REGISTRY[DISTANCE].heading)}</h2>", figure_html(figs["distance"])]
    for r in runs:
        name, sampling = html.escape(r.analysis.spec.name), html.escape(r.sampling(), quote=False)
        body += [f"<h3>{name}: by map</h3>{_caveat(r.weights)}<p>It {sampling}.</p>",
                 html_table(distance_rows(r.analysis.view(DISTANCE)), "{:.3g}")]
    body.append(f"<h2>{html.escape(REGISTRY[ROLLOUT].heading)}</h2>")
    body += [figure_html(figs[f"rollout-{i + 1}"]) for i in range(len(runs))]
    return page_html("vitlens comparison (video)", "".join(body))


def video_command(args: Any, names: Sequence[str], compare: bool, log: Callable[[str], None],
                  load: Callable[[Any, Sequence[str]], list], command: str) -> tuple[str, ReportData,
                                                                                      dict[str, go.Figure]]:
    """What ``report --video`` / ``compare --video`` make: (the page, its data, its figures by PNG name). The clip's
    first frame is read (so the file, its frame count and its frame size are checked) before any model is loaded,
    every model loaded (and checked to be a video model) before the first is run; each model then reads the frames
    it samples (issue 62: never the whole clip)."""
    clip = vl.read_clip(args.video, 1)
    fps = args.fps if args.fps is not None else clip.fps
    image_set = clip_description(args.video, clip, fps, args.fps is not None)
    models = load(args, names)
    refuse_image_models(models)
    views = (DISTANCE, ROLLOUT) if compare else None
    runs = []
    for m in models:
        runs.append(run_clip(m, args.video, fps, args.batch_size, views))
        log(f"{m.spec.name}: {counted(1, 'clip')} of {runs[-1].frames.shape[0]} frames in {runs[-1].seconds:.1f} s")
    environment = versions(str(models[0].device))
    data = report_data(runs, image_set, environment, command)
    if compare:
        figs = comparison_figures(runs)
        return video_comparison_html(runs, figs, image_set, environment), data, figs
    per_model = [run_figures(r) for r in runs]
    pngs = {f"{i + 1}-{file_safe(r.analysis.spec.name)}-{name}": fig for i, (r, f) in enumerate(zip(runs, per_model))
            for name, fig in f.items()}
    return video_report_html(runs, per_model, image_set, environment), data, pngs


__all__ = ["ClipRun", "clip_description", "comparison_figures", "distance_rows", "file_safe", "model_frames",
           "model_html", "refuse_image_models", "refuse_video_models", "report_data", "run_clip", "run_figures",
           "sampled_fps", "video_command", "video_comparison_html", "video_report_html"]
