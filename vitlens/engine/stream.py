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
  (``.clone()``, ``.cpu().numpy()``, a reduction) what it keeps; so is a whole map where the capture
  keeps none itself (``CaptureRequest.reuse_maps``: SAM's inline capture makes every block's map in
  one reused buffer);
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

The engine (``vitlens.engine``: this stream, the capture it drives, the plan it asks and the consumer
protocol) sits below the views, which are its consumers. A new attention view is one consumer class in
``vitlens/views/`` and one entry in ``vitlens.views.registry``: attention distance (Fig. 7 right, Fig. 11) and rollout
(Fig. 6) are
two, and ``analyze`` feeds every one asked for from one forward per batch.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError, UnsupportedModelError
from ..kinds import find_kind
from ..images import Images, preprocess_masks
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..progress import Progress, ProgressArg
from .capture import capture_attention
from . import consumer as protocol
from .consumer import AttentionConsumer, BatchInfo
from .plan import capture_plan, default_budget_mb, images_per_forward
from .sources import batch_source


#: the consumer protocol's reading of a row block, re-exported from here beside the stream (stream_attention's own
#: ``query_rows`` argument is a count of rows, hence the assignment rather than an import of the name)
query_rows = protocol.query_rows


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
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors; for a
            model whose kind reads clips (``Kind.clips``: a video model), preprocessed clips [B, frames, 3, H, W]
            (``vitlens.engine.sources``: the kind's batch source).
        consumers: the attention consumers to feed.
        batch_size: images per forward (at most: with the plan's choice, ``images_per_forward`` lowers it where the
            consumers would hold more across blocks than the plain forward's own peak, e.g. rollout at 1024 px).
        progress: True for a progress bar, or a callable ``f(done, total)``.
        labels: [N] class labels of the images, passed to consumers in ``BatchInfo``.
        masks: [N, h, w] bool object masks of the images, passed likewise after the images' own resize
            and crop (so they line up with the model's input).
        desc: progress-bar label.
        capture_mode: "side" (the model's fused forward untouched, its logits bit-identical),
            "inline" (the non-fused path; see ``vitlens.engine.capture``), or None for the plan's choice
            (``capture_plan``; what the views use).
        query_rows: compute each block's probabilities this many queries at a time (side capture;
            families that compute them themselves honour it) and feed the consumers row blocks, so
            no whole [B, heads, T, T] map is made: memory for high resolutions
            (``query_rows_for_budget`` picks it from a memory budget). None: whole maps, unless
            ``capture_mode`` is None too: then ``capture_plan`` chooses both.
        memory_budget_mb: with ``capture_mode`` and ``query_rows`` None, the megabytes of probabilities
            allowed at once (None: ``default_budget_mb``, one block's MLP activation at the caller's batch, also
            where ``images_per_forward`` runs fewer images per forward); see ``capture_plan``.

    Returns:
        The number of images run; each consumer then answers ``result(spec)``.
    """
    kind = find_kind(m)  # maps of another shape than a ViT's (Kind.reader): only consumers that say they read them
    wrong = sorted({type(c).__name__ for c in consumers if not kind.reads(c)}) if kind is not None else []
    if kind is not None and wrong:
        raise UnsupportedModelError(
            f"{m.spec.name} {kind.maps}, which {', '.join(wrong)} would read as a ViT's [B, heads, T, T] maps; use "
            f"{kind.use} (attention distance and rollout: vl.attention_distance, vl.attention_rollout, vl.analyze) or "
            f"a consumer with {kind.reader} = True.")
    source = batch_source(m, images)  # the kind's inputs (images, or a video model's clips), checked before any forward
    n = source.count
    if capture_mode is None and query_rows is None:  # the plan's choice: what the consumers hold caps the batch
        t = m.spec.num_tokens()
        held = sum(int(getattr(c, "held_bytes_per_image", lambda _t: 0)(t)) for c in consumers)
        asked = max(1, min(batch_size, n) if n else batch_size)
        batch_size = images_per_forward(asked, t, m.spec.embed_dim, held)
        if memory_budget_mb is None and batch_size < asked:
            # the probabilities' budget stays the caller's batch's (one block's MLP activation, which a plain forward
            # of that batch allocates): fewer images per forward hold the maps, not smaller blocks of query rows
            memory_budget_mb = default_budget_mb(asked, t, m.spec.embed_dim)
    plan = capture_plan(m, max(1, min(batch_size, n) if n else batch_size), memory_budget_mb=memory_budget_mb,
                        mode=capture_mode, query_rows=query_rows)
    done, index = 0, 0
    with Progress(progress, n, desc) as bar, contextlib.ExitStack() as hooks, \
            capture_attention(m, store=False, consumers=consumers, mode=plan.mode, query_rows=plan.query_rows), \
            torch.no_grad():
        for c in consumers:
            hooks.enter_context(c.hooks())
        for x in source.batches(batch_size):
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
