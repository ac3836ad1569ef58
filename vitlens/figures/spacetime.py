"""The space-time views' figures (issue 50; docs/definitions.md, "Video: space and time"): mean attention distance
of each head in space (pixels) and in time (frames, or seconds with the clip's frame rate) beside the
uniform-attention baselines -- the space-time Fig. 7 right for one video model, Fig. 11 for several -- and rollout
through space-time as one map per time step (Fig. 6 over a clip).

A divided model (TimeSformer) makes two maps per block: its spatial maps are drawn in the spatial panel and its
temporal maps in the temporal panel; the other panel's value of each is 0 by construction and is not drawn (the
subtitle says so).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..errors import InvalidParameterError
from ..views.spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult
from ..words import counted
from .colours import PALETTE, model_colours
from .maps import TOKEN_COLORSCALE, colour_range, grid_columns, token_heatmap
from .registry import draws

#: which maps each panel draws: spatial distances of the joint and spatial maps, temporal of joint and temporal
PANEL_ROLES = {"spatial": ("joint", "spatial"), "temporal": ("joint", "temporal")}


def temporal_unit(results: Sequence[SpaceTimeDistanceResult]) -> str:
    """"s" when every result knows its clips' frame rate, else "frames"."""
    return "s" if all(r.fps is not None for r in results) else "frames"


def panel_values(result: SpaceTimeDistanceResult, panel: str, unit: str = "frames"
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The maps one panel draws: their indices, blocks, [maps, heads] values and [maps] baselines, in pixels for
    the spatial panel and in ``unit`` ("frames" or "s") for the temporal panel."""
    keep = np.array([i for i, role in enumerate(result.roles) if role in PANEL_ROLES[panel]], dtype=int)
    blocks = np.asarray(result.blocks, dtype=int)[keep]
    if panel == "spatial":
        return keep, blocks, result.spatial_px[keep], result.baseline_spatial_px[keep]
    scale = 1.0 / result.fps if unit == "s" and result.fps else 1.0
    return keep, blocks, result.temporal_frames[keep] * scale, result.baseline_temporal_frames[keep] * scale


def _axis_title(panel: str, unit: str) -> str:
    return "Spatial distance (pixels)" if panel == "spatial" else \
        f"Temporal distance ({'seconds' if unit == 's' else 'frames'})"


def _by_construction(results: Sequence[SpaceTimeDistanceResult]) -> str:
    if not any("temporal" in r.roles for r in results):
        return ""
    return ("<br>divided blocks: temporal maps on the right, spatial maps on the left (the other "
            "distance of each is 0 by construction)")


@draws(SpaceTimeDistanceResult)
def spacetime_distance_figure(result: SpaceTimeDistanceResult, title: str | None = None) -> go.Figure:
    """The space-time Fig. 7 right: every head's mean attention distance by block, in space (pixels, left) and in
    time (frames, or seconds when the clip's frame rate is known; right), with per block a dotted dash at what
    uniform attention over the map's cells gives.

    Args:
        result: ``attention_distance`` of a video model (``SpaceTimeDistanceResult``).
        title: the figure's title (default: the model, the convention and how many clips).

    Returns:
        A plotly ``Figure`` with two panels.
    """
    unit = temporal_unit([result])
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("in space (across the frame)", "in time (across frames)"))
    depth = max(result.blocks) + 1 if result.blocks else 1
    role_colour = {"joint": PALETTE[0], "spatial": PALETTE[0], "temporal": PALETTE[1]}
    for col, panel in enumerate(("spatial", "temporal"), start=1):
        keep, blocks, values, base = panel_values(result, panel, unit)
        for role in dict.fromkeys(result.roles[i] for i in keep):
            rows = np.array([result.roles[i] == role for i in keep])
            heads = values.shape[1]
            bb, hh = np.meshgrid(blocks[rows], np.arange(heads), indexing="ij")
            within = result.within_px[keep[rows]]
            label = "joint maps" if role == "joint" else f"{role} maps"
            fmt = ".1f" if panel == "spatial" or unit == "frames" else ".3f"
            fig.add_trace(go.Scatter(
                x=bb.ravel() + 1, y=values[rows].ravel(), mode="markers", name=label, legendgroup=role,
                showlegend=col == 1 or role == "temporal",
                marker=dict(size=7, color=role_colour[role], opacity=0.8),
                customdata=np.stack([bb.ravel() + 1, hh.ravel() + 1, within.ravel()], -1),
                hovertemplate=(f"{label[:-1]}, block %{{customdata[0]}}, head %{{customdata[1]}}<br>"
                               f"%{{y:{fmt}}} {'px' if panel == 'spatial' else unit}"
                               + ("<br>within its time step %{customdata[2]:.1f} px" if panel == "spatial" else "")
                               + "<extra></extra>")), row=1, col=col)
        fig.add_trace(go.Scatter(
            x=np.repeat(blocks + 1, 3) + np.tile([-0.35, 0.35, np.nan], len(blocks)),
            y=np.repeat(base, 3) * np.tile([1.0, 1.0, np.nan], len(blocks)), mode="lines",
            line=dict(dash="dot", width=2, color="#555"), hoverinfo="skip", legendgroup="uniform",
            name="uniform attention", showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title="Network depth (block)", dtick=1, range=[0.5, depth + 0.5], row=1, col=col)
        fig.update_yaxes(title=_axis_title(panel, unit), rangemode="tozero", row=1, col=col)
    conv = "renormalised over cell keys" if result.renormalized else "raw weights"
    rate = f"{result.fps:g} fps" if result.fps else "frame rate unknown"
    fig.update_layout(
        title=title or f"Mean attention distance in space and time, {result.model}<br><sup>{conv}; mean over "
                       f"{counted(result.n_clips, 'clip')}; {rate}; dotted: uniform attention"
                       f"{_by_construction([result])}</sup>",
        height=500, margin=dict(l=10, r=10, t=130, b=10), legend=dict(orientation="h", y=-0.2))
    return fig


def spacetime_compare_figure(results: Sequence[SpaceTimeDistanceResult], names: Sequence[str],
                             title: str | None = None) -> go.Figure:
    """The space-time Fig. 11: two or more video models side by side, every head's spatial distance (pixels,
    left) and temporal distance (frames, or seconds when every clip's frame rate is known; right) by block, a
    colour per model, each model's uniform-attention distance a dotted line of its colour.

    Args:
        results: one ``SpaceTimeDistanceResult`` per model.
        names: their legend names.
        title: the figure's title.

    Returns:
        A plotly ``Figure`` with two panels.

    Raises:
        InvalidParameterError: no results, or names that do not match them one to one.
    """
    if not results or len(results) != len(names):
        raise InvalidParameterError(f"spacetime_compare_figure takes one name per result; got {len(results)} "
                                    f"results and {len(names)} names.")
    unit = temporal_unit(results)
    colours = model_colours(list(names))
    offsets = np.linspace(-0.2, 0.2, len(results)) if len(results) > 1 else [0.0]
    depth = max(max(r.blocks) + 1 for r in results)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("in space (across the frame)", "in time (across frames)"))
    for col, panel in enumerate(("spatial", "temporal"), start=1):
        for i, (res, name) in enumerate(zip(results, names)):
            _, blocks, values, base = panel_values(res, panel, unit)
            bb, hh = np.meshgrid(blocks, np.arange(values.shape[1]), indexing="ij")
            fmt = ".1f" if panel == "spatial" or unit == "frames" else ".3f"
            fig.add_trace(go.Scatter(
                x=bb.ravel() + 1 + offsets[i], y=values.ravel(), mode="markers", name=name, legendgroup=name,
                showlegend=col == 1, marker=dict(size=7, color=colours[i], opacity=0.8),
                customdata=np.stack([bb.ravel() + 1, hh.ravel() + 1], -1),
                hovertemplate=(f"{name}<br>block %{{customdata[0]}}, head %{{customdata[1]}}<br>%{{y:{fmt}}} "
                               f"{'px' if panel == 'spatial' else unit}<extra></extra>")), row=1, col=col)
            level = float(np.mean(base))  # every map of a panel has the same baseline within one model
            fig.add_trace(go.Scatter(
                x=[0.5, depth + 0.5], y=[level, level], mode="lines", hoverinfo="skip", legendgroup=name,
                line=dict(dash="dot", width=1.5, color=colours[i]), name=f"uniform attention ({name})",
                showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title="Network depth (block)", dtick=1, range=[0.5, depth + 0.5], row=1, col=col)
        fig.update_yaxes(title=_axis_title(panel, unit), rangemode="tozero", row=1, col=col)
    clips = ", ".join(f"{name}: {counted(r.n_clips, 'clip')}" for r, name in zip(results, names))
    fig.update_layout(
        title=title or f"Mean attention distance in space and time<br><sup>{clips}; dotted: uniform attention"
                       f"{_by_construction(results)}</sup>",
        height=520, margin=dict(l=10, r=10, t=130, b=10), legend=dict(orientation="h", y=-0.2))
    return fig


def step_labels(time_centres: np.ndarray) -> list[str]:
    """Each time step's frames, from its centre c(s) = s·τ + (τ - 1)/2: "frame 3", or "frames 2-3" for a tubelet."""
    c = np.asarray(time_centres, dtype=np.float64)
    tau = int(round(c[1] - c[0])) if len(c) > 1 else int(round(2 * c[0] + 1))
    if tau <= 1:
        return [f"frame {int(round(x))}" for x in c]
    half = (tau - 1) / 2
    return [f"frames {int(round(x - half))}-{int(round(x + half))}" for x in c]


@draws(SpaceTimeRolloutResult)
def spacetime_rollout_figure(result: SpaceTimeRolloutResult, index: int = 0, frames: np.ndarray | None = None,
                             opacity: float = 0.5, title: str | None = None) -> go.Figure:
    """Rollout through space-time for one clip: a small heatmap per time step (a frame, or a tubelet's frames), on
    one colour scale (the maps are divided by their maximum over the clip, so steps compare), optionally over the
    step's middle frame.

    Args:
        result: ``attention_rollout`` of a video model (``SpaceTimeRolloutResult``).
        index: which clip.
        frames: uint8 [F, H, W, 3], the clip's frames as the model sees them (after the crop), to draw the maps
            over; None draws the maps alone.
        opacity: the maps' opacity over the frames.
        title: the figure's title.

    Returns:
        A plotly ``Figure``.

    Raises:
        InvalidParameterError: an index outside the result's clips.
    """
    n = result.maps.shape[0]
    if not 0 <= index < n:
        raise InvalidParameterError(f"clip index {index} is outside the result's {counted(n, 'clip')}.")
    maps = result.maps[index]
    steps, gh, gw = maps.shape
    labels = step_labels(result.time_centres)
    cols = grid_columns(steps, most=8)
    rows = -(-steps // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=labels, horizontal_spacing=0.01,
                        vertical_spacing=0.08 if rows > 1 else 0.0)
    size = (gh, gw) if frames is None else tuple(np.asarray(frames).shape[1:3])
    for s in range(steps):
        r, c = s // cols + 1, s % cols + 1
        if frames is not None:
            at = min(int(np.floor(result.time_centres[s])), len(frames) - 1)
            fig.add_trace(go.Image(z=np.asarray(frames[at]), hoverinfo="skip"), row=r, col=c)
        fig.add_trace(token_heatmap(maps[s], size, coloraxis="coloraxis",
                                    opacity=1.0 if frames is None else opacity), row=r, col=c)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    for s in range(steps):
        fig.update_yaxes(scaleanchor=f"x{s + 1 if s else ''}", row=s // cols + 1, col=s % cols + 1)
    low, high = colour_range([maps])
    fig.update_layout(coloraxis=dict(colorscale=TOKEN_COLORSCALE, cmin=low, cmax=high,
                                     colorbar=dict(title=dict(text="rollout (÷ max)", side="right"))))
    fig.update_annotations(font_size=11)
    fig.update_layout(
        title=title or f"Rollout through space-time, {result.model}<br><sup>clip {index + 1} of {n}; from the "
                       f"{result.source_token}, heads fused by {result.head_fusion}; a map per time step, divided "
                       "by the clip's maximum</sup>",
        height=int(max(240, rows * (min(880 / cols, 260) + 35) + 100)), margin=dict(l=10, r=10, t=90, b=10))
    return fig


__all__ = ["spacetime_compare_figure", "spacetime_distance_figure", "spacetime_rollout_figure", "step_labels"]
