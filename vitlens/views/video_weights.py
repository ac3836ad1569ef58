"""The weight views of video ViTs (issue 50; docs/definitions.md, "Video: weights"): the paper's Fig. 7 centre
(position-embedding cosine similarity) over space and over time, and Fig. 7 left (PCA of the patch-embedding
filters) for tubelet filters, shown per time step. They read weights only, no clip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..results import Result
from .filters import principal_components
from .position import cosine_similarity_matrix
from .video_tables import video_weights


@dataclass(eq=False, repr=False)
class VideoPositionSimilarityResult(Result):
    """Cosine similarity of a video model's position embeddings over space and over time (Fig. 7 centre).

    Attributes:
        space: [gh, gw, gh, gw]; two cells at the same time step (a joint table: averaged over time steps).
        time: [nt, nt]; two time steps at the same cell (a joint table: averaged over cells); None without a
            time table (TimeSformer "space_only").
        joint: [nt, gh, gw, nt, gh, gw], every pair of tokens of one table over (t, cell); None for separate tables.
        table: "joint", "separate" (TimeSformer's spatial and time tables) or "joint sinusoidal".
        sinusoidal: the table is a fixed sin-cos code (VideoMAE): its structure is the code's, not learned.
        frames_per_step: frames in one time step (a tubelet's length; 1 for per-frame tokens).
        model_name: the model's class name.
    """

    kind = "video_position_similarity"
    space: np.ndarray
    time: np.ndarray | None
    joint: np.ndarray | None
    table: str
    sinusoidal: bool
    frames_per_step: int
    model_name: str = ""

    def summary(self) -> str:
        gh, gw = self.space.shape[:2]
        steps = "no time table" if self.time is None else f"{len(self.time)} time steps"
        code = " (fixed, not learned)" if self.sinusoidal else ""
        return f"{self.model_name or 'model'}: {gh}x{gw} cells, {steps}; {self.table} table{code}"

    def to_rows(self) -> list[dict]:
        """One row per pair of time steps (``axis`` "time") and per pair of cells (``axis`` "space")."""
        rows = []
        if self.time is not None:
            n = len(self.time)
            rows += [{"axis": "time", "a": t, "b": t2, "cosine": float(self.time[t, t2])}
                     for t in range(n) for t2 in range(n)]
        gh, gw = self.space.shape[:2]
        flat = self.space.reshape(gh * gw, gh * gw)
        rows += [{"axis": "space", "a": i, "b": j, "cosine": float(flat[i, j])}
                 for i in range(gh * gw) for j in range(gh * gw)]
        return rows


def video_position_similarity(model: Any) -> VideoPositionSimilarityResult:
    """Position-embedding cosine similarity over space and over time (extends paper Fig. 7 centre to video).

    A joint table E over (t, cell) (ViViT, VideoMAE's sinusoid): ``joint`` = cos of every pair of rows;
    ``time[t, t2]`` = mean over cells p of cos(E[t, p], E[t2, p]); ``space[p, p2]`` = mean over time steps t of
    cos(E[t, p], E[t, p2]). Separate tables (TimeSformer): ``space`` and ``time`` are each table's own cosines.

    Args:
        model: a Hugging Face ViViT, TimeSformer, VideoMAE or V-JEPA 2 model (or a ``LoadedModel`` of one).

    Returns:
        A ``VideoPositionSimilarityResult``.

    Raises:
        ViewNotAvailableError: a model without a position table (V-JEPA 2's rotary embeddings).
        UnsupportedModelError: a model that is not one of these video models.
    """
    w = video_weights(model)
    if w.no_table:
        raise ViewNotAvailableError(f"Position similarity is not available for {w.name}: {w.no_table}.")
    nt, (gh, gw) = w.steps, w.grid
    if w.joint is not None:
        if w.joint.shape[0] != nt * gh * gw:
            raise ViewNotAvailableError(f"{w.name}'s position table has {w.joint.shape[0]} token rows, not the "
                                        f"{nt} x {gh} x {gw} of its config; vitlens reads it at its own size only.")
        joint = cosine_similarity_matrix(w.joint).numpy().reshape(nt, gh * gw, nt, gh * gw)
        cells = np.arange(gh * gw)
        time = joint[:, cells, :, cells].mean(axis=0)  # advanced indices first: [cells, nt, nt]
        steps = np.arange(nt)
        space = joint[steps, :, steps, :].mean(axis=0)  # [nt, cells, cells]
        return VideoPositionSimilarityResult(
            space=space.reshape(gh, gw, gh, gw), time=time, joint=joint.reshape(nt, gh, gw, nt, gh, gw),
            table="joint sinusoidal" if w.sinusoidal else "joint", sinusoidal=w.sinusoidal,
            frames_per_step=w.frames_per_step, model_name=w.name)
    if w.space is None:
        raise ViewNotAvailableError(f"Position similarity is not available for {w.name}: it has neither a joint table "
                                    "nor a spatial one.")
    space = cosine_similarity_matrix(w.space).numpy().reshape(gh, gw, gh, gw)
    time = None if w.time is None else cosine_similarity_matrix(w.time).numpy()
    return VideoPositionSimilarityResult(space=space, time=time, joint=None, table="separate", sinusoidal=False,
                                         frames_per_step=w.frames_per_step, model_name=w.name)


@dataclass(eq=False, repr=False)
class TubeletFilterPCAResult(Result):
    """Top principal components of the 3-D patch-embedding filters, per time step (Fig. 7 left for video).

    Attributes:
        components: [k, tt, C, P, Q]; component i at time step j is ``components[i, j]`` (the whole component
            unit-norm; sign arbitrary).
        explained_variance_ratio: [k] share of the filters' variance each component explains.
        time_energy: [k, tt] squared norm of each component's slice at each time step (rows sum to 1).
        module: dotted name of the convolution read.
        n_filters: number of filters (PCA samples).
        model_name: the model's class name.
    """

    kind = "tubelet_filter_pca"
    components: np.ndarray
    explained_variance_ratio: np.ndarray
    time_energy: np.ndarray
    module: str
    n_filters: int
    model_name: str = ""

    def summary(self) -> str:
        k, tt = self.components.shape[:2]
        return (f"{self.model_name or 'model'}: top {k} of {self.n_filters} tubelet filters' components over {tt} "
                f"time step{'s' * (tt != 1)}, {100 * float(np.sum(self.explained_variance_ratio)):.1f}% of variance")

    def to_rows(self) -> list[dict]:
        """One row per component (1-based): its share of the variance and of its energy at each time step."""
        return [{"component": i + 1, "explained_variance_ratio": float(v),
                 **{f"time_step_{j}": float(e) for j, e in enumerate(self.time_energy[i])}}
                for i, v in enumerate(self.explained_variance_ratio)]


def video_filter_pca(model: Any, n_components: int = 28) -> TubeletFilterPCAResult:
    """PCA of the tubelet filters, shown per time step (extends paper Fig. 7 left to video).

    One centred PCA over the whole 3-D filters (weight [D, C, tt, P, Q], each flattened; a per-frame Conv2d read
    as tt = 1); each component reshaped to [tt, C, P, Q].

    Args:
        model: a Hugging Face ViViT, TimeSformer, VideoMAE or V-JEPA 2 model (or a ``LoadedModel`` of one).
        n_components: components to keep; at most min(filters, C * tt * P * Q).

    Returns:
        A ``TubeletFilterPCAResult``.

    Raises:
        InvalidParameterError: ``n_components`` out of range.
        UnsupportedModelError: a model that is not one of these video models.
    """
    w = video_weights(model)
    d, c, tt, p, q = w.filters.shape
    limit = min(d, c * tt * p * q)
    if not 1 <= n_components <= limit:
        raise InvalidParameterError(f"n_components must be between 1 and {limit} for {w.name} ({d} filters of "
                                    f"{c * tt * p * q} values); got {n_components}.")
    x = w.filters.permute(0, 2, 1, 3, 4).reshape(d, -1).numpy()  # [D, tt * C * P * Q], time step major
    components, ratios = principal_components(x, n_components)
    components = components.reshape(n_components, tt, c, p, q)
    energy = (components.reshape(n_components, tt, -1) ** 2).sum(-1)
    return TubeletFilterPCAResult(components=components, explained_variance_ratio=ratios,
                                  time_energy=energy / energy.sum(1, keepdims=True), module=w.module, n_filters=d,
                                  model_name=w.name)
