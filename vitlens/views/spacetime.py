"""The ViT paper's attention views in space and time, for video transformers (issue 50; docs/definitions.md, "Video:
space and time"): mean attention distance split into a spatial distance (pixels) and a temporal distance (frames,
seconds with ``fps``), each beside its uniform-attention baseline (a space-time Fig. 7 right, and Fig. 11 for two
models), and rollout through space-time (a map per time step; through TimeSformer's divided blocks, the
composition of the temporal and spatial maps).

Reads the maps ``vl.capture_attention`` hands over and the family's ``ClipLayout`` (``core.clip_layout``): a joint
block's [B, heads, N, N] map (permuted into the canonical order, prefix then cells time-major), a divided block's
temporal [B * cells, heads, T', T'] and spatial [B * T', heads, 1 + cells, 1 + cells] maps. The sums run in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..core.clip_layout import ClipLayout
from ..core.spec import ModelSpec
from ..engine.consumer import AttentionConsumer, query_rows
from ..errors import InvalidParameterError
from ..results import Result
from ..words import counted

if TYPE_CHECKING:
    from ..loading.model import LoadedModel

HEAD_FUSIONS = ("mean", "max", "min")


@dataclass(frozen=True)
class MapGeometry:
    """What one map's query and key cells are, as [Q, K] float64 matrices of the pairs' distances.

    Attributes:
        spatial: pixels between the query's and key's cell centres.
        temporal: frames between their time steps' centres.
        same_step: whether the two cells are of one time step (the within-frame spatial distance reads those).
    """

    spatial: np.ndarray
    temporal: np.ndarray
    same_step: np.ndarray


def joint_geometry(layout: ClipLayout) -> MapGeometry:
    """Every cell of every time step against every other, canonical order (time-major)."""
    t, y, x = layout.cell_positions()
    spatial = np.sqrt((y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2)
    return MapGeometry(spatial, np.abs(t[:, None] - t[None, :]), t[:, None] == t[None, :])


def temporal_geometry(layout: ClipLayout) -> MapGeometry:
    """A divided block's temporal map: one cell at every time step (spatial distance 0 by construction)."""
    t = layout.time_centres()
    n = len(t)
    return MapGeometry(np.zeros((n, n)), np.abs(t[:, None] - t[None, :]), np.eye(n, dtype=bool))


def spatial_geometry(layout: ClipLayout) -> MapGeometry:
    """A divided block's spatial map: the cells of one time step (temporal distance 0 by construction)."""
    gh, gw = layout.grid
    r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    y, x = r.reshape(-1) * float(layout.stride_px[0]), c.reshape(-1) * float(layout.stride_px[1])
    n = len(y)
    return MapGeometry(np.sqrt((y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2), np.zeros((n, n)),
                       np.ones((n, n), dtype=bool))


def cell_maps(probs: torch.Tensor, layout: ClipLayout, role: str) -> np.ndarray:
    """A map's cell-to-cell weights [B, G, heads, Q, K] in float64 (G: groups of queries, 1 for a joint map, the
    cells of a temporal map, the time steps of a spatial map), prefix queries and keys dropped."""
    p = layout.num_prefix
    a = probs.detach().double().cpu()
    if role == "joint":
        return layout.to_canonical(a)[:, None, :, p:, p:].numpy()
    if role == "temporal":
        return a.reshape(-1, layout.cells, *a.shape[1:]).numpy()
    return a.reshape(-1, layout.steps, *a.shape[1:])[..., p:, p:].numpy()


def map_distances(weights: np.ndarray, geometry: MapGeometry, renormalize: bool = True) -> dict[str, np.ndarray]:
    """One map's distances per clip and head [B, heads]: "spatial", "within" (spatial, within the query's time
    step) and "temporal", each the mean over queries of sum_k w[q, k] d(q, k), with w the weights over cell keys
    (renormalised to sum 1 unless ``renormalize`` is False; the within-step distance always renormalises over the
    query's own step, over the queries with weight there: NaN when none has)."""
    w = weights / weights.sum(-1, keepdims=True) if renormalize else weights
    same = w * geometry.same_step
    mass = same.sum(-1)  # a query with no weight in its own step (never a softmax's) has no within-step distance
    within = np.divide((same * geometry.spatial).sum(-1), mass, out=np.zeros_like(mass), where=mass > 0)
    counted_queries = (mass > 0).sum(axis=(1, 3))
    return {"spatial": (w * geometry.spatial).sum(-1).mean(axis=(1, 3)),
            "within": np.divide(within.sum(axis=(1, 3)), counted_queries,
                                out=np.full(counted_queries.shape, np.nan), where=counted_queries > 0),
            "temporal": (w * geometry.temporal).sum(-1).mean(axis=(1, 3))}


def baselines(geometry: MapGeometry) -> dict[str, float]:
    """What uniform attention over a map's cell keys gives (self-pairs included)."""
    same = geometry.same_step
    return {"spatial": float(geometry.spatial.mean()), "temporal": float(geometry.temporal.mean()),
            "within": float((geometry.spatial * same).sum(-1).mean() / same.sum(-1).mean())}


GEOMETRIES = {"joint": joint_geometry, "temporal": temporal_geometry, "spatial": spatial_geometry}


@dataclass(eq=False, repr=False)
class SpaceTimeDistanceResult(Result):
    """Mean attention distance of every head of every map, in space and in time, over clips.

    Attributes:
        model: the model's name.
        roles: [maps] each map's role ("joint", or a divided block's "temporal" then "spatial").
        blocks: [maps] each map's block.
        spatial_px: [maps, heads] spatial distance in pixels, mean over clips.
        within_px: [maps, heads] spatial distance within the query's time step.
        temporal_frames: [maps, heads] temporal distance in frames.
        spatial_std_px: [maps, heads] the spatial distance's standard deviation over clips.
        temporal_std_frames: [maps, heads] the temporal distance's.
        baseline_spatial_px: [maps] uniform attention's spatial distance.
        baseline_within_px: [maps] uniform attention's within-step distance.
        baseline_temporal_frames: [maps] uniform attention's temporal distance.
        max_spatial_px: the clip's spatial diagonal between the farthest cell centres.
        max_temporal_frames: the clip's temporal span between the first and last time step's centres.
        n_clips: clips averaged over.
        fps: the clip's frame rate (None: unknown; ``temporal_s`` then is None).
        renormalized: whether each query's weights were renormalised over cell keys.
    """

    kind = "spacetime_distance"
    model: str
    roles: tuple[str, ...]
    blocks: tuple[int, ...]
    spatial_px: np.ndarray
    within_px: np.ndarray
    temporal_frames: np.ndarray
    spatial_std_px: np.ndarray
    temporal_std_frames: np.ndarray
    baseline_spatial_px: np.ndarray
    baseline_within_px: np.ndarray
    baseline_temporal_frames: np.ndarray
    max_spatial_px: float
    max_temporal_frames: float
    n_clips: int
    fps: float | None = None
    renormalized: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.roles) - set(GEOMETRIES))
        if unknown:
            raise InvalidParameterError(f"a space-time distance's map roles are among {', '.join(GEOMETRIES)}; got "
                                        f"{', '.join(map(repr, unknown))}.")

    @property
    def temporal_s(self) -> np.ndarray | None:
        """[maps, heads] temporal distance in seconds (frames / fps), or None without a frame rate."""
        return None if self.fps is None else self.temporal_frames / self.fps

    def summary(self) -> str:
        return (f"{self.model}: space-time attention distance of {len(self.roles)} maps x "
                f"{self.spatial_px.shape[1]} heads over {counted(self.n_clips, 'clip')}")

    def to_rows(self) -> list[dict[str, Any]]:
        rows = []
        for i, (role, block) in enumerate(zip(self.roles, self.blocks)):
            for h in range(self.spatial_px.shape[1]):
                row = {"model": self.model, "map": i, "block": block, "role": role, "head": h,
                       "spatial_px": float(self.spatial_px[i, h]), "within_px": float(self.within_px[i, h]),
                       "temporal_frames": float(self.temporal_frames[i, h]),
                       "baseline_spatial_px": float(self.baseline_spatial_px[i]),
                       "baseline_within_px": float(self.baseline_within_px[i]),
                       "baseline_temporal_frames": float(self.baseline_temporal_frames[i])}
                if self.fps is not None:
                    row["temporal_s"] = float(self.temporal_frames[i, h] / self.fps)
                rows.append(row)
        return rows


@dataclass(eq=False, repr=False)
class SpaceTimeRolloutResult(Result):
    """Rollout through space-time: each clip's source row over its cells, a map per time step.

    Attributes:
        model: the model's name.
        maps: [B, T', gh, gw] the rolled-out row over the cells, divided by its maximum over the clip.
        source_token: "class" or "mean of cells" (a model without a class token).
        head_fusion: how each map's heads were fused.
        time_centres: [T'] each time step's centre in frames.
    """

    kind = "spacetime_rollout"
    model: str
    maps: np.ndarray
    source_token: str
    head_fusion: str
    time_centres: np.ndarray

    def summary(self) -> str:
        b, t, gh, gw = self.maps.shape
        return f"{self.model}: rollout from the {self.source_token} over {counted(b, 'clip')}, {t} steps of {gh}x{gw}"


#: what a ``SpaceTimeAccumulator`` computes: the distances, the rollout, or both (a survey's shard keeps both)
PARTS = ("both", "distance", "rollout")


class SpaceTimeAccumulator(AttentionConsumer):
    """The space-time distance and rollout of clips, batch by batch, from one capture's maps: a consumer of the
    streaming engine (``stream_attention`` runs a video model's clips through its clip source and hands it each map,
    whole, first map first), reading the video kind's maps (``reads_clips``).

    Args:
        layout: the model's ``ClipLayout``.
        blocks: the model's blocks (a divided block hands over two maps).
        renormalize: renormalise each query's weights over the cell keys (the distances).
        head_fusion: how the rollout fuses each map's heads ("mean", "max", "min").
        part: what it computes (``PARTS``): "distance" or "rollout" alone (a view's consumer; ``result`` gives
            that view's result), or "both" (``distance`` and ``rollout`` give each).
        fps: the clips' frame rate, for the distance's ``temporal_s`` (None: unknown).
    """

    reads_clips = True

    def __init__(self, layout: ClipLayout, blocks: int, renormalize: bool = True, head_fusion: str = "mean",
                 part: str = "both", fps: float | None = None) -> None:
        if head_fusion not in HEAD_FUSIONS:
            raise InvalidParameterError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}; got {head_fusion!r}.")
        if part not in PARTS:
            raise InvalidParameterError(f"part must be one of {', '.join(PARTS)}; got {part!r}.")
        self.layout, self.renormalize, self.head_fusion = layout, renormalize, head_fusion
        self.part, self.fps = part, fps
        self.roles = layout.map_roles(blocks)
        self.geometries = {role: GEOMETRIES[role](layout) for role in set(self.roles)}
        self.per_clip: list[dict[str, np.ndarray]] = []  # per batch: [B, maps, heads] per distance
        self.rollouts: list[np.ndarray] = []
        self._batch_distances: dict[int, dict[str, np.ndarray]] = {}
        self._batch_fused: dict[int, np.ndarray] = {}

    @classmethod
    def for_model(cls, m: "LoadedModel", part: str = "both", renormalize: bool = True, head_fusion: str = "mean",
                  fps: float | None = None) -> "SpaceTimeAccumulator":
        """The accumulator of a video model's clips (its family's ``clip_layout``)."""
        if m.family.clip_layout is None:
            raise InvalidParameterError(f"{m.spec.name} is not a video model (its family {m.family.name} reads no "
                                        "clips): its attention has no space-time distance or rollout.")
        return cls(m.family.clip_layout(m.model), m.spec.num_layers, renormalize, head_fusion, part, fps)

    @property
    def _distances(self) -> bool:
        return self.part != "rollout"

    @property
    def _rollout(self) -> bool:
        return self.part != "distance"

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        """Map ``layer`` of the current batch (the capture's map index: a divided block hands over two), whole."""
        start, stop, last = query_rows(attn, rows)
        if start or not last:
            raise InvalidParameterError("the space-time views read each map whole; a video model's capture hands "
                                        "over whole maps (side capture without query rows).")
        self.on_map(layer, attn)

    def add(self, maps: Sequence[torch.Tensor]) -> None:
        """One batch's captured maps, first map first (``on_map`` for each, then ``end_batch``)."""
        if len(maps) != len(self.roles):
            raise InvalidParameterError(f"expected {len(self.roles)} maps ({', '.join(self.roles)}); got {len(maps)}")
        for i, a in enumerate(maps):
            self.on_map(i, a)
        self.end_batch()

    def on_map(self, index: int, probs: torch.Tensor) -> None:
        """Map ``index`` of the current batch as the capture hands it over: its distances now (a head at a time,
        so no float64 copy of every head exists at once), its heads fused for the rollout at the batch's end."""
        role = self.roles[index]
        if self._distances:
            parts = [map_distances(cell_maps(probs[:, h:h + 1], self.layout, role), self.geometries[role],
                                   self.renormalize) for h in range(probs.shape[1])]
            self._batch_distances[index] = {k: np.concatenate([p[k] for p in parts], 1) for k in parts[0]}
        if self._rollout:
            self._batch_fused[index] = fuse_heads(probs, self.head_fusion)

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        """The batch's maps are all in: its distances kept per clip, its rollout made."""
        seen = self._batch_distances if self._distances else self._batch_fused
        if sorted(seen) != list(range(len(self.roles))):
            raise InvalidParameterError(f"a batch handed over maps {sorted(seen)}; expected "
                                        f"{len(self.roles)} ({', '.join(self.roles)}).")
        if self._distances:
            found = [self._batch_distances[i] for i in range(len(self.roles))]
            self.per_clip.append({k: np.stack([f[k] for f in found], 1) for k in ("spatial", "within", "temporal")})
        if self._rollout:
            self.rollouts.append(rollout_fused([self._batch_fused[i] for i in range(len(self.roles))], self.layout,
                                               self.roles))
        self._batch_distances, self._batch_fused = {}, {}

    def result(self, spec: ModelSpec | str) -> "SpaceTimeDistanceResult | SpaceTimeRolloutResult":
        """The view's result: the distance (``part="distance"``, with the accumulator's ``fps``) or the rollout
        (``part="rollout"``); an accumulator of both gives each by ``distance`` and ``rollout``."""
        name = spec if isinstance(spec, str) else spec.name
        if self.part == "both":
            raise InvalidParameterError("this accumulator computes both space-time views: ask distance(name) or "
                                        "rollout(name).")
        return self.distance(name, self.fps) if self.part == "distance" else self.rollout(name)

    def merge(self, other: "SpaceTimeAccumulator") -> "SpaceTimeAccumulator":
        """An accumulator over the clips of both (disjoint clip sets, e.g. shards): the per-clip distances and maps
        of ``self`` then ``other``, so the merged means are those of one run over all the clips."""
        if (other.layout, other.roles, other.renormalize, other.head_fusion, other.part) != \
                (self.layout, self.roles, self.renormalize, self.head_fusion, self.part):
            raise InvalidParameterError("only accumulators of one model's layout and the same parameters merge.")
        out = SpaceTimeAccumulator.__new__(SpaceTimeAccumulator)
        out.__dict__.update(self.__dict__)
        out.per_clip, out.rollouts = self.per_clip + other.per_clip, self.rollouts + other.rollouts
        out._batch_distances, out._batch_fused = {}, {}
        return out

    def state(self) -> dict[str, np.ndarray]:
        """Plain arrays (a survey shard's npz): every clip's distances [clips, maps, heads] and rollout maps, the
        layout and the parameters; ``from_state`` gives the accumulator back, so shards merge exactly (``merge``)."""
        per = {k: np.concatenate([p[k] for p in self.per_clip]) for k in ("spatial", "within", "temporal")}
        lay = self.layout
        return {**per, "rollout": np.concatenate(self.rollouts),
                "layout": np.array([lay.frames, lay.tubelet, *lay.grid, *lay.stride_px, int(lay.divided)]),
                "prefix": np.array(lay.prefix, dtype=str), "order": np.array(lay.order),
                "blocks": np.array(len(self.roles) // (2 if lay.divided else 1)),
                "renormalize": np.array(self.renormalize), "head_fusion": np.array(self.head_fusion)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "SpaceTimeAccumulator":
        """The accumulator a ``state()`` was taken from (its clips' distances and maps, its layout)."""
        frames, tubelet, gh, gw, sy, sx, divided = (int(v) for v in np.asarray(state["layout"]))
        layout = ClipLayout(frames=frames, tubelet=tubelet, grid=(gh, gw), stride_px=(sy, sx),
                            prefix=tuple(str(p) for p in np.atleast_1d(state["prefix"]) if str(p)),
                            order=str(state["order"]), divided=bool(divided))
        out = cls(layout, int(state["blocks"]), bool(state["renormalize"]), str(state["head_fusion"]))
        out.per_clip = [{k: np.asarray(state[k]) for k in ("spatial", "within", "temporal")}]
        out.rollouts = [np.asarray(state["rollout"])]
        return out

    def distance(self, name: str, fps: float | None = None) -> SpaceTimeDistanceResult:
        if not self._distances:
            raise InvalidParameterError("this accumulator computes the space-time rollout alone (part='rollout').")
        if not self.per_clip:
            raise InvalidParameterError("no clips were run: pass at least one clip [B, frames, 3, H, W].")
        per = {k: np.concatenate([p[k] for p in self.per_clip]) for k in ("spatial", "within", "temporal")}
        base = [baselines(self.geometries[role]) for role in self.roles]
        t, y, x = self.layout.cell_positions()
        step = 2 if self.layout.divided else 1
        return SpaceTimeDistanceResult(
            model=name, roles=self.roles, blocks=tuple(i // step for i in range(len(self.roles))),
            spatial_px=per["spatial"].mean(0), within_px=per["within"].mean(0), temporal_frames=per["temporal"].mean(0),
            spatial_std_px=per["spatial"].std(0), temporal_std_frames=per["temporal"].std(0),
            baseline_spatial_px=np.array([b["spatial"] for b in base]),
            baseline_within_px=np.array([b["within"] for b in base]),
            baseline_temporal_frames=np.array([b["temporal"] for b in base]),
            max_spatial_px=float(np.hypot(y.max() - y.min(), x.max() - x.min())),
            max_temporal_frames=float(t.max() - t.min()), n_clips=int(per["spatial"].shape[0]), fps=fps,
            renormalized=self.renormalize)

    def rollout(self, name: str) -> SpaceTimeRolloutResult:
        if not self._rollout:
            raise InvalidParameterError("this accumulator computes the space-time distance alone (part='distance').")
        if not self.rollouts:
            raise InvalidParameterError("no clips were run: pass at least one clip [B, frames, 3, H, W].")
        return SpaceTimeRolloutResult(model=name, maps=np.concatenate(self.rollouts),
                                      source_token="class" if "class" in self.layout.prefix else "mean of cells",
                                      head_fusion=self.head_fusion, time_centres=self.layout.time_centres())


def fuse_heads(probs: torch.Tensor, head_fusion: str) -> np.ndarray:
    """A map's heads fused ([..., heads, Q, K] -> [..., Q, K], float64): mean, max or min."""
    a = probs.detach().double().cpu()
    return {"mean": a.mean(-3), "max": a.amax(-3), "min": a.amin(-3)}[head_fusion].numpy()


def dense_block_map(probs: torch.Tensor, layout: ClipLayout, role: str, head_fusion: str = "mean") -> np.ndarray:
    """A map as a dense [B, N, N] token-to-token matrix over every token, canonical order, heads fused: a joint
    map as it is; a temporal map's cell rows over the same cell's time steps, the class token's row the identity
    (it takes no part); a spatial map's cell rows over the class token and their step's cells, the class token's
    row the mean over time steps of its per-step copies' rows, each copy's weight on itself and on the other
    copies' class key transported to the one class token (every copy is that token; the model adds the mean of
    the copies' outputs to it)."""
    return dense_from_fused(fuse_heads(probs, head_fusion), layout, role)


def dense_from_fused(f: np.ndarray, layout: ClipLayout, role: str) -> np.ndarray:
    """``dense_block_map`` of a map whose heads are fused already (``fuse_heads``)."""
    p, cells, steps, n = layout.num_prefix, layout.cells, layout.steps, layout.num_tokens
    if role == "joint":
        return layout.to_canonical(torch.from_numpy(f)).numpy()
    b = f.shape[0] // (cells if role == "temporal" else steps)
    dense = np.zeros((b, n, n))
    dense[:, range(p), range(p)] = 1.0
    idx = p + np.arange(steps)[:, None] * cells + np.arange(cells)[None, :]  # [step, cell] -> canonical token
    if role == "temporal":
        f = f.reshape(b, cells, steps, steps)
        for c in range(cells):
            dense[:, idx[:, c][:, None], idx[:, c][None, :]] = f[:, c]
        return dense
    f = f.reshape(b, steps, p + cells, p + cells)
    dense[:, range(p)] = 0.0
    for s in range(steps):
        dense[:, idx[s][:, None], idx[s][None, :]] = f[:, s, p:, p:]
        dense[:, idx[s], :p] = f[:, s, p:, :p]
        dense[:, :p, idx[s]] += f[:, s, :p, p:] / steps
        dense[:, :p, :p] += f[:, s, :p, :p] / steps
    return dense


def rollout_clips(maps: Sequence[torch.Tensor], layout: ClipLayout, roles: Sequence[str],
                  head_fusion: str = "mean") -> np.ndarray:
    """[B, T', gh, gw] rollout of a batch: A' = (A + I) / rowsum(A + I) of each dense map (``dense_block_map``),
    R = A'_M ... A'_1 (the first map applied first; a divided block's temporal map before its spatial one), the
    source's row of R (the class token, or the mean of the cells' rows) over the cells, divided by its maximum over
    the clip (a row with no weight on any cell stays 0)."""
    return rollout_fused([fuse_heads(a, head_fusion) for a in maps], layout, roles)


def rollout_fused(fused: Sequence[np.ndarray], layout: ClipLayout, roles: Sequence[str]) -> np.ndarray:
    """``rollout_clips`` of maps whose heads are fused already (``fuse_heads``)."""
    p, n = layout.num_prefix, layout.num_tokens
    row = None
    for f, role in zip(reversed(fused), reversed(roles)):
        dense = dense_from_fused(f, layout, role) + np.eye(n)
        dense /= dense.sum(-1, keepdims=True)
        if row is None:
            row = np.zeros((dense.shape[0], n))
            if p and "class" in layout.prefix:
                row[:, layout.prefix.index("class")] = 1.0
            else:
                row[:, p:] = 1.0 / (n - p)
        row = np.einsum("bi,bij->bj", row, dense)
    if row is None:
        raise InvalidParameterError("a clip's rollout needs the maps of at least one block; got none.")
    out = row[:, p:].reshape(-1, layout.steps, *layout.grid)
    top = out.reshape(len(out), -1).max(-1)[:, None, None, None]
    return np.divide(out, top, out=np.zeros_like(out), where=top > 0)  # a row with nothing on the cells stays 0


__all__ = ["PARTS", "SpaceTimeAccumulator", "SpaceTimeDistanceResult", "SpaceTimeRolloutResult", "baselines",
           "cell_maps", "dense_block_map", "dense_from_fused", "joint_geometry", "map_distances", "rollout_clips",
           "rollout_fused", "spatial_geometry", "temporal_geometry"]
