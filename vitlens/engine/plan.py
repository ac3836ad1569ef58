"""How a stream captures attention: the one planning entry point, ``capture_plan``, which every caller
of the engine (the views, ``stream_attention``, ``attention_maps``, the bench) asks, whether it names
the capture itself or lets the plan choose. It serves every attention view (Fig. 6/14 rollout, Fig. 7
right and Fig. 11 attention distance) at any resolution: memory is bounded by computing the
probabilities a block of query rows at a time where the family can, and by ``images_per_forward``, the images a
forward takes where the consumers hold maps across blocks (rollout's).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel

CAPTURE_MODES = ("side", "inline")

MIN_BUDGET_MB = 4.0

ROW_BLOCK_MB = 48.0
"""The largest block of query rows the plan computes at once, whatever the budget. Rule: a block a little
above the last-level cache stays fast to reduce, and no larger block measured faster (the runs behind the
number are in the Performance page)."""


def query_rows_for_budget(batch: int, heads: int, tokens: int, budget_mb: float = 256.0) -> int:
    """How many query rows of a block's float32 probabilities [batch, heads, rows, tokens] fit in
    ``budget_mb`` megabytes (at least 1, at most ``tokens``)."""
    per_row = 4 * batch * heads * tokens
    return int(max(1, min(tokens, budget_mb * 2**20 // max(per_row, 1))))


def default_budget_mb(batch: int, tokens: int, embed_dim: int) -> float:
    """The views' default memory budget for captured probabilities: one block's MLP activation
    [batch, tokens, 4 * embed_dim] in float32, which the plain forward allocates anyway (at least
    ``MIN_BUDGET_MB``: smaller maps are not worth computing in blocks)."""
    return max(MIN_BUDGET_MB, 4.0 * batch * tokens * 4 * embed_dim / 2**20)


@dataclass(frozen=True)
class CapturePlan:
    """How a stream captures attention (``capture_plan``).

    Attributes:
        mode: "side" or "inline".
        query_rows: query rows per block of probabilities (None: whole maps).
        budget_mb: the memory budget the plan keeps to.
        whole_map_mb: one block's whole [batch, heads, T, T] float32 map.
    """

    mode: str
    query_rows: int | None
    budget_mb: float
    whole_map_mb: float


def capture_plan(m: LoadedModel, batch: int, tokens: int | None = None, memory_budget_mb: float | None = None,
                 mode: str | None = None, query_rows: int | None = None) -> CapturePlan:
    """The capture of a stream: what the caller named, the rest chosen by the rule below.

    Rule, where neither ``mode`` nor ``query_rows`` is named (what the views ask): where the family's view
    capture is inline and vitlens computes its non-fused path by query rows (``CaptureAbilities.inline_rows``:
    timm ViTs with the standard ``Attention``), the views run that path in blocks of
    ``query_rows_for_budget(batch, heads, T, min(budget, ROW_BLOCK_MB))`` rows: one block of every row
    (``query_rows == T``, a whole map) when that fits, more above. The probabilities are made once and the
    block's output computed from them. Otherwise a block's whole map [batch, heads, T, T] (float32) is made
    when it fits in the budget, with the family's view capture (``CaptureAbilities.view_mode``); above it,
    families that compute the probabilities by query rows beside their own forward
    (``CaptureAbilities.side_rows``: timm ViTs with parallel blocks, EVA, the generic call-level capture)
    run side capture in blocks of that many rows; other families keep whole maps. The default budget is one
    block's MLP activation at this batch and T (``default_budget_mb``), so whole maps are made up to
    T = 4 * embed_dim / heads tokens (256 for every ViT with 64-dim heads, whatever the batch), and whenever a
    whole map takes under ``MIN_BUDGET_MB``.

    Named: ``query_rows`` alone is side capture by that many rows; ``mode`` alone is whole maps in that mode;
    both, that mode by those rows (inline by rows only where the family computes its path by rows).

    Args:
        m: the model.
        batch: images per forward.
        tokens: tokens per image (default: the model's at its spec input size).
        memory_budget_mb: megabytes of probabilities allowed at once (None: ``default_budget_mb``).
        mode: "side", "inline" or None (the rule).
        query_rows: query rows per block of probabilities, or None.

    Returns:
        The ``CapturePlan``.

    Raises:
        InvalidParameterError: a budget that is not positive, an unknown mode, rows below 1.
    """
    s = m.spec
    t = int(tokens) if tokens is not None else s.num_tokens()
    if memory_budget_mb is not None and not float(memory_budget_mb) > 0:
        raise InvalidParameterError(f"memory_budget_mb must be > 0 (megabytes); got {memory_budget_mb!r}.")
    if mode is not None and mode not in CAPTURE_MODES:
        raise InvalidParameterError(f"mode must be one of {', '.join(CAPTURE_MODES)}; got {mode!r}.")
    if query_rows is not None and int(query_rows) < 1:
        raise InvalidParameterError(f"query_rows must be >= 1 (queries per block of probabilities); got "
                                    f"{query_rows!r}.")
    budget = float(memory_budget_mb) if memory_budget_mb is not None else default_budget_mb(batch, t, s.embed_dim)
    whole = 4.0 * batch * s.num_heads * t * t / 2**20
    if mode is not None or query_rows is not None:
        return CapturePlan(mode or "side", None if query_rows is None else int(query_rows), budget, whole)
    rows = query_rows_for_budget(batch, s.num_heads, t, min(budget, ROW_BLOCK_MB))
    can = m.family.abilities(m.model)
    if can.view_mode == "inline" and can.inline_rows:
        return CapturePlan("inline", rows, budget, whole)  # one block (rows == T) when the whole map fits
    if whole <= budget or not can.side_rows:
        return CapturePlan(can.view_mode, None, budget, whole)
    return CapturePlan("side", rows, budget, whole)


HELD_BLOCKS = 4.0
"""What the consumers may hold across blocks per forward, in blocks' MLP activations (``default_budget_mb``): about
the plain forward's own peak above the model (its residual stream, qkv, MLP hidden and GELU activations)."""


HELD_FLOOR_MB = 256.0
"""Held memory a batch may always take, whatever its activations: below it a second forward buys nothing worth its
cost (and the views' numbers stay those of the caller's batch, to the bit)."""


def images_per_forward(batch: int, tokens: int, embed_dim: int, held_bytes_per_image: int) -> int:
    """Images per forward for consumers that hold ``held_bytes_per_image`` across blocks (rollout's head-fused maps,
    L x T x T float32 an image): ``batch`` where they fit in ``HELD_BLOCKS`` of the batch's MLP activations, else as
    many as fit (at least 1), never splitting what holds under ``HELD_FLOOR_MB`` in all.

    Rule: what the views hold stays within about the plain forward's own peak where one image's share fits in it
    (``held`` grows as T^2 an image, the forward as T), so a view's peak stays within about twice the forward's; where
    one image's share alone is larger (rollout at 1024 px on a ViT-B: 0.74 GB), one image per forward is the least it
    can hold. The images run in sub-batches one after the other, the same numbers per image. 224 px, batch 16: 16
    (no split); 768 px, batch 4, and 1024 px, batch 2: 1 for rollout on a ViT-B.
    """
    if held_bytes_per_image <= 0 or batch <= 1:
        return max(1, batch)
    budget = max(HELD_FLOOR_MB, HELD_BLOCKS * default_budget_mb(batch, tokens, embed_dim)) * 2**20
    return int(max(1, min(batch, budget // held_bytes_per_image)))


__all__ = ["CAPTURE_MODES", "CapturePlan", "HELD_BLOCKS", "HELD_FLOOR_MB", "MIN_BUDGET_MB", "ROW_BLOCK_MB",
           "capture_plan", "default_budget_mb", "images_per_forward", "query_rows_for_budget"]
