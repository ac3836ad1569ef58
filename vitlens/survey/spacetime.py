"""The survey's space-time statistic of a video model over a shard of clips (issue 50; docs/definitions.md, "Space-time
mean attention distance", "Rollout through space-time").

A shard's clips run through the model once (``stream_attention`` with the video kind's batch source: side capture, the
outputs untouched) into a ``SpaceTimeAccumulator``, whose state is every clip's distances [clips, maps, heads] and
rollout maps with the clip layout (``SpaceTimeAccumulator.state``). Two shards merge with
``SpaceTimeAccumulator.merge`` (their clips concatenated in shard order), so the merged means are those of one run
over every clip in that order: exact.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..clips import clip_pixel_values, read_clip
from ..engine.stream import stream_attention
from ..kinds import kind_of
from ..loading.model import LoadedModel
from ..views.spacetime import SpaceTimeAccumulator


class SpaceTimeStats:
    """A shard's (or merged shards') space-time accumulator, as the survey's statistics registry keeps it."""

    def __init__(self, acc: SpaceTimeAccumulator) -> None:
        self.acc = acc

    def state(self) -> dict[str, Any]:
        return self.acc.state()

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "SpaceTimeStats":
        return cls(SpaceTimeAccumulator.from_state(state))

    def merge(self, other: "SpaceTimeStats") -> "SpaceTimeStats":
        return SpaceTimeStats(self.acc.merge(other.acc))

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """Per map's block (``layer``) and head: "{role}_spatial_px", "{role}_within_px" and
        "{role}_temporal_frames" (role "joint", or a divided block's "temporal" / "spatial"), the mean over clips;
        per block, the uniform baselines "{role}_baseline_spatial_px" and "{role}_baseline_temporal_frames"."""
        d = self.acc.distance(str(spec.get("name", "")))
        rows: list[dict[str, Any]] = []
        for i, (role, block) in enumerate(zip(d.roles, d.blocks)):
            for h in range(d.spatial_px.shape[1]):
                for what, values in (("spatial_px", d.spatial_px), ("within_px", d.within_px),
                                     ("temporal_frames", d.temporal_frames)):
                    rows.append(dict(metric=f"{role}_{what}", value=values[i, h], n=d.n_clips, layer=block, head=h))
            rows.append(dict(metric=f"{role}_baseline_spatial_px", value=d.baseline_spatial_px[i], n=d.n_clips,
                             layer=block))
            rows.append(dict(metric=f"{role}_baseline_temporal_frames", value=d.baseline_temporal_frames[i],
                             n=d.n_clips, layer=block))
        return rows


def clip_reader(m: LoadedModel) -> Callable[[str], Any]:
    """How a survey worker reads a clip file for ``m`` (issue 62: a shard's clips were read whole, every frame at its
    size): a video model's input, float32 [T, 3, H, W] (``clip_pixel_values``: only the frames it samples decoded,
    each resized as it decodes), so a clip holds what the model takes whatever the file; for a model that reads
    images, which takes nothing of a clip, its first frame (the file checked, ``skipped`` as before)."""
    if kind_of(m.spec).clips:
        return lambda path: clip_pixel_values(path, m)[0]
    return lambda path: read_clip(path, 1)


def spacetime_stats(m: LoadedModel, clips: list, batch_size: int, renormalize: bool = True) -> SpaceTimeStats | None:
    """A shard's clips (the model's inputs [T, 3, H, W] as ``clip_reader`` reads them, or any clip source, sampled
    here as the model's processor samples) through a video model, each query's weights renormalised over the cell
    keys unless ``renormalize`` is False (the survey's setting); None for a model that reads images (its kind's
    ``clips``), which a survey of clips leaves to its other statistics."""
    if not kind_of(m.spec).clips or not clips:
        return None
    acc = SpaceTimeAccumulator.for_model(m, "both", renormalize=renormalize)
    if all(isinstance(c, torch.Tensor) and c.is_floating_point() for c in clips):
        x = torch.stack(list(clips))  # the model's inputs already (``clip_reader``)
    else:
        x = clip_pixel_values(list(clips), m)
    stream_attention(m, x, [acc], batch_size, capture_mode=None)
    return SpaceTimeStats(acc)


__all__ = ["SpaceTimeStats", "clip_reader", "spacetime_stats"]
