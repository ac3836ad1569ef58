"""The streaming engine: images go through the model once, batch by batch, and every attention
consumer reads each block's attention as it is made. This is the extension point of vitlens.

A consumer (``AttentionConsumer``) is told four things and answers two:

- ``begin_batch(batch)``: a new batch (``BatchInfo``: its size, input size, token grid, device,
  and the images' labels and object masks when the image set has them);
- ``on_attention(layer, attn, rows=None)``: block ``layer``'s post-softmax attention, first
  block first (float32, detached; nothing is kept unless the consumer keeps it). Whole
  (``rows=None``, attn [B, heads, T, T]) or as blocks of query rows: ``rows`` is the slice of
  queries ``attn`` [B, heads, rows.stop - rows.start, T] holds; a layer's blocks arrive in order,
  cover every query once, and the one with ``rows.stop == T`` is its last (an engine that
  computes the probabilities a block of queries at a time never holds a whole map). A row block
  is valid during the call only: its memory holds the next block after it, so a consumer copies
  (``.clone()``, ``.cpu().numpy()``, a reduction) what it keeps;
- ``end_batch(logits)``: the batch's model output (float32), after the last block;
- ``result(spec)``: the finished result object (a ``vitlens.results.Result``);
- ``merge(other)``: the consumer state over the images of both (partial states of disjoint
  image sets, e.g. shards computed on different workers, combine into the state over all).

Two more, where they serve:

- ``hooks()``: a context manager of further hooks the consumer needs during the pass (token
  norms of the block outputs, a pool's attention); the engine holds it for the whole stream,
  and a ``HookSession`` removes its hooks on exit and on error;
- ``state()`` / ``from_state(state)``: the consumer's partial state as plain numpy arrays and
  back, which is how a survey's statistics cross process boundaries and land in npz files
  (loaded without pickle); ``merge`` is the one way states combine.

A new attention view is one consumer class in ``vitlens/views/`` and one entry in
``vitlens.views.registry``: attention distance (Fig. 7 right, Fig. 11) and rollout (Fig. 6) are
two, and ``analyze`` feeds every one asked for from one forward per batch.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..images import Images, count_images, iter_batches, preprocess_masks
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..progress import Progress, ProgressArg
from .capture import capture_attention
from .consumer import AttentionConsumer, BatchInfo, query_rows  # the protocol, re-exported from here

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


MIN_BUDGET_MB = 4.0

ROW_BLOCK_MB = 48.0
"""The largest block of query rows the plan computes at once, whatever the budget. Rule: a block a little
above the last-level cache stays fast to reduce, and no larger block measured faster (the runs behind the
number are in the README's Performance section)."""


@dataclass(frozen=True)
class CapturePlan:
    """How the views capture attention for a stream (``capture_plan``).

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


def capture_plan(m: LoadedModel, batch: int, tokens: int | None = None,
                 memory_budget_mb: float | None = None) -> CapturePlan:
    """The views' choice between whole maps and capture by blocks of query rows.

    Rule: where the family's view capture is inline and vitlens computes its non-fused path by query
    rows (``Family.chunks_inline``: timm ViTs with the standard ``Attention``), the views run that path
    in blocks of ``query_rows_for_budget(batch, heads, T, min(budget, ROW_BLOCK_MB))`` rows: one block
    of every row (``query_rows == T``, a whole map) when that fits, more above. The probabilities are
    made once and the block's output computed from them, with contiguous keys and values and the
    softmax in place, which is why it is not timm's own non-fused code (the measurements: README,
    Performance; ``analyses/bench.py`` prints them again).
    Otherwise a block's whole map [batch, heads, T, T] (float32) is made when it fits in the budget,
    with the family's view capture (``Family.view_mode``); above it, families that compute the
    probabilities by query rows beside their own forward (timm ViTs with parallel blocks, EVA) run
    side capture in blocks of that many rows (q k^T and softmax then run a second time beside the
    fused kernel); other families keep whole maps. No more than the budget of probabilities exists at
    once, and no block is above ``ROW_BLOCK_MB`` (faster). The default budget
    is one block's MLP activation at this batch and T (``default_budget_mb``), so whole maps are
    made up to T = 4 * embed_dim / heads tokens (256 for every ViT with 64-dim heads, whatever the
    batch: 224 px runs whole, 256 px and up in blocks of query rows), and whenever a whole map
    takes under ``MIN_BUDGET_MB``.

    Args:
        m: the model.
        batch: images per forward.
        tokens: tokens per image (default: the model's at its spec input size).
        memory_budget_mb: megabytes of probabilities allowed at once (None: ``default_budget_mb``).
    """
    s = m.spec
    t = int(tokens) if tokens is not None else s.num_tokens()
    if memory_budget_mb is not None and not float(memory_budget_mb) > 0:
        raise InvalidParameterError(f"memory_budget_mb must be > 0 (megabytes); got {memory_budget_mb!r}.")
    budget = float(memory_budget_mb) if memory_budget_mb is not None else default_budget_mb(batch, t, s.embed_dim)
    whole = 4.0 * batch * s.num_heads * t * t / 2**20
    rows = query_rows_for_budget(batch, s.num_heads, t, min(budget, ROW_BLOCK_MB))
    if m.family.view_mode == "inline" and m.family.chunks_inline(m.model):
        return CapturePlan("inline", rows, budget, whole)  # one block (rows == T) when the whole map fits
    if whole <= budget or not m.family.chunks_queries:
        return CapturePlan(m.family.view_mode, None, budget, whole)
    return CapturePlan("side", rows, budget, whole)


def model_name(spec: ModelSpec | str | None) -> str:
    return spec if isinstance(spec, str) else (spec.name if spec is not None else "")


def stream_attention(
    m: LoadedModel,
    images: Images,
    consumers: Sequence[AttentionConsumer],
    batch_size: int = 32,
    progress: ProgressArg = None,
    labels: np.ndarray | None = None,
    masks: np.ndarray | None = None,
    desc: str = "vitlens",
    capture_mode: str | None = "side",
    query_rows: int | None = None,
    memory_budget_mb: float | None = None,
) -> int:
    """Run ``images`` through the model once, batch by batch, feeding every consumer; returns the count.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        consumers: the attention consumers to feed.
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.
        labels: [N] class labels of the images, passed to consumers in ``BatchInfo``.
        masks: [N, h, w] bool object masks of the images, passed likewise after the images' own resize
            and crop (so they line up with the model's input).
        desc: progress-bar label.
        capture_mode: "side" (the model's fused forward untouched, its logits bit-identical),
            "inline" (the non-fused path; see ``vitlens.views.capture``), or None for the model
            family's faster one (``Family.view_mode``; what the views use).
        query_rows: compute each block's probabilities this many queries at a time (side capture;
            families that compute them themselves honour it) and feed the consumers row blocks, so
            no whole [B, heads, T, T] map is made: memory for high resolutions
            (``query_rows_for_budget`` picks it from a memory budget). None: whole maps, unless
            ``capture_mode`` is None too: then ``capture_plan`` chooses both.
        memory_budget_mb: with ``capture_mode`` and ``query_rows`` None, the megabytes of probabilities
            allowed at once (None: ``default_budget_mb``, one block's MLP activation); see ``capture_plan``.

    Returns:
        The number of images run; each consumer then answers ``result(spec)``.
    """
    if query_rows is not None:
        capture_mode = capture_mode or "side"
    elif capture_mode is None:
        n = count_images(images)
        plan = capture_plan(m, max(1, min(batch_size, n) if n else batch_size), memory_budget_mb=memory_budget_mb)
        capture_mode, query_rows = plan.mode, plan.query_rows
    done, index = 0, 0
    with Progress(progress, count_images(images), desc) as bar, contextlib.ExitStack() as hooks, \
            capture_attention(m, store=False, consumers=consumers, mode=capture_mode, query_rows=query_rows), \
            torch.no_grad():
        for c in consumers:
            hooks.enter_context(c.hooks())
        for x in iter_batches(images, m.data_config, batch_size):
            x = x.to(m.device)
            size = int(x.shape[0])
            batch_masks = None
            if masks is not None:
                batch_masks = preprocess_masks(np.asarray(masks)[done: done + size], m.data_config)
                if batch_masks.shape[-2:] != tuple(x.shape[-2:]):
                    raise InvalidParameterError(f"Masks of {batch_masks.shape[-2:]} pixels do not match inputs of "
                                                f"{tuple(x.shape[-2:])}; pass masks at the images' own size.")
            info = BatchInfo(index=index, start=done, size=size, input_size=(int(x.shape[-2]), int(x.shape[-1])),
                             grid=m.grid_for(x.shape[-2:]), device=m.device,
                             labels=None if labels is None else np.asarray(labels)[done: done + size],
                             masks=batch_masks)
            for c in consumers:
                c.begin_batch(info)
            logits = m.forward(x).float()
            for c in consumers:
                c.end_batch(logits)
            done += size
            index += 1
            bar.update(done)
    return done
