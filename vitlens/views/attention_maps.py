"""One image's attention, block by block and head by head: where one query token looks
(the per-head detail behind paper Fig. 6 and the distances of Fig. 7 right).

Token indices: the prefix tokens come first (the class token, when there is one, is token 0),
then the patch tokens row by row, so patch (r, c) is token ``prefix + r * gw + c``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import numpy as np
import torch

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..kinds import refuse_other_maps
from ..images import ImageLike
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..results import Result
from ..engine.capture import capture_attention
from ..engine.consumer import AttentionConsumer, query_rows
from ..engine.stream import stream_attention
from ..families.pooling import capture_pool_attention
from .prefix import parked_heads, prefix_mass


def query_token(spec: ModelSpec, row: int | None = None, col: int | None = None,
                grid: tuple[int, int] | None = None) -> int:
    """Token index of patch (row, col), or of the class token when ``row`` and ``col`` are None.

    Args:
        spec: the model's spec (its grid and prefix tokens).
        row: the patch's row on the grid (0-based), or None for the class token.
        col: the patch's column on the grid (0-based), or None for the class token.
        grid: the token grid of the actual input, (gh, gw); None: ``spec.grid``.

    Returns:
        The token's index in the sequence (prefix tokens first, then patches row by row).

    Raises:
        InvalidParameterError: a patch outside the grid, or the class token of a model without one.
    """
    gh, gw = grid or spec.grid
    if row is None and col is None:
        if not spec.has_class_token:
            raise InvalidParameterError(f"{spec.name} has no class token; choose a patch (row, col) as the query.")
        return 0
    if row is None or col is None or not (0 <= row < gh and 0 <= col < gw):
        raise InvalidParameterError(f"The query patch must lie in the {gh}x{gw} grid; got ({row}, {col}).")
    return spec.num_prefix_tokens + int(row) * gw + int(col)


def query_label(row: int | None = None, col: int | None = None) -> str:
    """'the class token' or 'patch (r, c)', for titles."""
    return "the class token" if row is None else f"patch ({int(row)}, {int(cast(int, col))})"  # a patch: both


@dataclass(eq=False, repr=False)
class AttentionMapsResult(Result):
    """Every block's attention for one image.

    Attributes:
        maps: [layers, heads, T, T] float32 post-softmax attention, T = prefix + patch tokens.
        grid: (gh, gw) patch-token grid.
        num_prefix_tokens: tokens before the patches.
        image_size: (H, W) input pixels.
        model_name: the model's name.
        pool: for a model that pools through an attention pool (a MAP head: timm's ``AttentionPoolLatent``,
            SigLIP's probe), that pool's own attention [heads, queries, T] over every token it reads
            (``vitlens.families.pooling``); None for models that pool otherwise (class token, mean).
        queries: None when ``maps`` hold every query's row; else the query tokens whose rows they hold
            ([layers, heads, Q, T], in this order).
    """

    kind = "attention_maps"
    maps: np.ndarray
    grid: tuple[int, int]
    num_prefix_tokens: int
    image_size: tuple[int, int]
    model_name: str = ""
    pool: np.ndarray | None = None
    queries: tuple[int, ...] | None = None

    def summary(self) -> str:
        layers, heads, _q, t = self.maps.shape
        pool = ", and its attention pool's" if self.pool is not None else ""
        kept = f" ({len(self.queries)} queries kept)" if self.queries is not None else ""
        return (f"{self.model_name or 'model'}: {layers} layers x {heads} heads over {t} tokens of one image"
                f"{kept}{pool}")

    def pool_attention(self, query: int = 0) -> np.ndarray:
        """Where the attention pool's probe ``query`` (0-based; SigLIP and timm MAP heads have one) attends among
        the patch tokens: [heads, gh, gw], raw weights (they sum to 1 over every token the pool reads).

        Raises:
            ViewNotAvailableError: the model has no attention pool.
        """
        if self.pool is None:
            raise ViewNotAvailableError(f"{self.model_name or 'this model'} pools without an attention pool (a class "
                                        "token or the mean), so there is no pool attention to show.")
        heads, queries, _t = self.pool.shape
        if not 0 <= query < queries:
            raise InvalidParameterError(f"query must be a pool query in [0, {queries}); got {query}.")
        n = self.grid[0] * self.grid[1]  # the patch tokens come last, whether or not the pool reads the prefix
        return self.pool[:, query, -n:].reshape(heads, *self.grid)

    def query_attention(self, layer: int, query: int) -> np.ndarray:
        """Where token ``query`` attends among the patch tokens in block ``layer`` (0-based): [heads, gh, gw].

        The values are the raw attention weights (they sum to 1 over all keys, prefix included).
        """
        layers, heads, _q, t = self.maps.shape
        if not 0 <= layer < layers:
            raise InvalidParameterError(f"layer must be in [0, {layers}); got {layer}.")
        if self.queries is not None:
            if query not in self.queries:
                raise InvalidParameterError(f"These maps keep the rows of queries {list(self.queries)}; got {query}. "
                                            "Ask attention_maps for that query (or for every query: queries=None).")
            row = self.queries.index(query)
        elif not 0 <= query < t:
            raise InvalidParameterError(f"query must be a token index in [0, {t}); got {query}.")
        else:
            row = query
        return self.maps[layer, :, row, self.num_prefix_tokens:].reshape(heads, *self.grid)

    def prefix_mass(self) -> np.ndarray:
        """[layers, heads, P] share of the patch queries' attention on each prefix token (mean over queries)."""
        if self.queries is not None:
            raise InvalidParameterError("The prefix mass averages every patch query's row; these maps keep "
                                        f"{len(self.queries)} queries. Call attention_maps without queries.")
        return cast(np.ndarray, prefix_mass(self.maps, self.num_prefix_tokens))  # numpy maps in, numpy out

    def parked_heads(self, labels: list[str], threshold: float = 0.5) -> list[dict]:
        """Heads of this image whose patch queries put more than ``threshold`` on one prefix token."""
        return parked_heads(self.prefix_mass(), labels, threshold)

    def query_rows(self, layer: int, query: int) -> list[dict]:
        """One row per (head, key patch) for one query in one block; head 1-based, rows/cols 0-based."""
        att = self.query_attention(layer, query)
        return [{"layer": layer + 1, "head": h + 1, "query": query, "row": r, "col": c,
                 "attention": float(att[h, r, c])}
                for h in range(att.shape[0]) for r in range(att.shape[1]) for c in range(att.shape[2])]


WHOLE_MAPS_MB = 256.0
"""Up to this many megabytes of whole maps for one image (``whole_maps_mb``), the app's Attention maps view
keeps every query's rows (one computation serves every query picked); above it (a ViT-B at 448 px and up),
it asks ``attention_maps`` for the picked query's rows only."""


def whole_maps_mb(spec: ModelSpec, grid: tuple[int, int] | None = None) -> float:
    """Megabytes of one image's whole maps [layers, heads, T, T] in float32 (``grid``: another input's grid)."""
    t = spec.num_tokens(grid)
    return 4.0 * spec.num_layers * spec.num_heads * t * t / 2**20


class QueryRows(AttentionConsumer):
    """Keeps only the rows of some query tokens of every block (one image): [heads, Q, T] per block, from
    whole maps or row blocks alike, so ``attention_maps(..., queries=...)`` never holds a whole map."""

    def __init__(self, queries: Sequence[int]) -> None:
        self.queries = tuple(int(q) for q in queries)
        self.rows: list[np.ndarray] = []  # per block: [heads, Q, T] float32
        self._layer: np.ndarray | None = None

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        start, stop, last = query_rows(attn, rows)
        if layer != len(self.rows):
            raise RuntimeError(f"Query rows expected block {len(self.rows)}, got block {layer}.")
        if self._layer is None:
            self._layer = np.zeros((attn.shape[1], len(self.queries), attn.shape[-1]), dtype=np.float32)
        for i, q in enumerate(self.queries):
            if start <= q < stop:
                self._layer[:, i] = attn[0, :, q - start].float().cpu().numpy()
        if last:
            self.rows.append(self._layer)
            self._layer = None


def attention_maps(m: LoadedModel, image: ImageLike | torch.Tensor, queries: Sequence[int] | None = None,
                   memory_budget_mb: float | None = None) -> AttentionMapsResult:
    """Every block's attention for one image, and the attention pool's for a model with a MAP head.

    Whole maps (``queries=None``) come from side capture (the model's own forward untouched); the rows of
    ``queries`` come from the views' capture plan (``capture_plan``), which on timm ViTs is inline capture
    at the non-fused path: the probabilities the block's output is computed from, a block of query rows at
    a time.

    Args:
        m: the model.
        image: one image (or a preprocessed tensor; its first image is used).
        queries: None for every query's row (the whole [layers, heads, T, T] maps); or the token indices
            (``query_token``) whose rows to keep, [layers, heads, Q, T]: the probabilities are then computed
            as the views' capture plan says (a block of query rows at a time at high resolution), so memory
            stays at one block of rows plus the kept rows whatever T.
        memory_budget_mb: with ``queries``, as for ``attention_distance`` (``capture_plan``).

    Returns:
        An ``AttentionMapsResult``: ``maps`` [layers, heads, T, T] (or [layers, heads, Q, T] for ``queries``),
            probabilities summing to 1 over keys, and ``pool`` for a MAP head.
    """
    import contextlib


    refuse_other_maps(m.spec, "attention_maps")
    x = image if isinstance(image, torch.Tensor) else m.preprocess([image])
    x = (x.unsqueeze(0) if x.ndim == 3 else x)[:1].to(m.device)
    grid = m.grid_for(x.shape[-2:])
    t = m.spec.num_tokens(grid)
    if queries is not None:
        queries = tuple(int(q) for q in queries)
        bad = [q for q in queries if not 0 <= q < t]
        if bad or not queries:
            raise InvalidParameterError(f"queries must be token indices in [0, {t}) (see query_token); got "
                                        f"{list(queries)}.")
    with contextlib.ExitStack() as stack:
        try:
            pool = stack.enter_context(capture_pool_attention(m))
        except ViewNotAvailableError:  # pools by a class token or the mean: no pool attention
            pool = None
        if queries is None:
            with torch.no_grad(), capture_attention(m) as cap:
                m.forward(x)
            maps = np.stack([a[0].cpu().numpy() for a in cap.maps])
        else:
            keep = QueryRows(queries)
            stream_attention(m, x, [keep], batch_size=1, capture_mode=None, memory_budget_mb=memory_budget_mb)
            maps = np.stack(keep.rows)
    return AttentionMapsResult(maps=maps, grid=grid, num_prefix_tokens=m.spec.num_prefix_tokens,
                               image_size=(int(x.shape[-2]), int(x.shape[-1])), model_name=m.spec.name,
                               pool=None if pool is None or not pool.maps else pool.maps[0][0].float().cpu().numpy(),
                               queries=queries)
