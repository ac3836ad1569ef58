"""What one survey worker does: load a model once, then turn image shards into partial states.

``run_shard`` is plain Python (a single process can call it); ``SurveyWorker`` holds one model and loads it on
first use; ``survey_task`` is what a Ray task runs: a worker process keeps the last model it was given
(``SurveyWorker``) for the next task, so the process Ray reuses task after task imports torch once and loads each
model once, and a task whose process died is retried in another, which loads the model again.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ViewNotAvailableError, VitlensError
from ..loading import load_model
from ..loading.model import LoadedModel
from ..memory import peak_rss_mb
from ..engine.stream import stream_attention
from ..views.registry import VIEWS as VIEW_REGISTRY, View, ViewParams, register_view
from .sources import ImageSource, Shard
from .spacetime import clip_reader
from .stats import survey_views
from .store import checkpoint_of, file_sha256


def consumers_for(m: LoadedModel, views: tuple[str, ...], num_classes: int,
                  renormalize: bool = True) -> dict[str, Any]:
    """The survey statistics of ``views`` (``stats.survey_views``) as consumers."""
    out: dict[str, Any] = {}
    known = survey_views()
    for name in views:
        build = known[name].build
        if build is not None:
            consumer = build(m, num_classes, renormalize)
            if consumer is not None:
                out[name] = consumer
    return out


def run_shard(m: LoadedModel, source: ImageSource, shard: Shard, views: tuple[str, ...], batch_size: int,
              renormalize: bool = True) -> dict[str, Any]:
    """One shard's partial states ({stat: {key: array}}), its image count and what was skipped."""
    t0 = time.perf_counter()
    clips = source.kind == "clips"  # a shard of clips: the statistics that read clips alone (``SurveyView.clips``)
    images, labels, masks, skipped = source.read(shard, clip_reader(m) if clips else None, m.data_config)
    consumers = {} if clips else consumers_for(m, views, len(source.classes), renormalize)
    n = 0
    if images and consumers:
        n = stream_attention(m, images, list(consumers.values()), batch_size, labels=labels, masks=masks,
                             desc=shard.name, capture_mode=None)
    elif images:
        n = len(images)
    states = {name: c.state() for name, c in consumers.items()}
    for name in views:  # the statistics that run their own pass over the images (``SurveyView.compute``)
        compute = survey_views()[name].compute
        if compute is not None and images and survey_views()[name].clips == clips:
            kept = compute(m, images, batch_size, renormalize)
            if kept is not None:
                states[name] = kept.state()
    return {"states": states, "n_images": n, "skipped": skipped,
            "seconds": time.perf_counter() - t0, "pid": os.getpid(),
            "peak_rss_mb": peak_rss_mb()}


def weight_views(m: LoadedModel) -> dict[str, Any]:
    """The weight-only views, once per model, as the registry summarises them (filter PCA's explained
    variance, E_pos structure); a view this model does not have is left out."""
    out: dict[str, Any] = {}
    for view in VIEW_REGISTRY.values():
        if view.kind == "weights" and view.summary is not None:
            try:
                out.update(view.summary(view.build(m, ViewParams())))
            except ViewNotAvailableError:
                pass
    return out


class SurveyWorker:
    """One model, loaded once, many shards: what a survey worker process holds (see ``survey_task``)."""

    def __init__(self, name: str, pretrained: bool, num_threads: int, use_gpu: bool) -> None:
        """``name`` as ``vl.load_model`` takes it, or ``PATH@ARCH`` for a local checkpoint."""
        self.name, self.pretrained, self.use_gpu = name, pretrained, use_gpu
        self.m: LoadedModel | None = None
        self.checkpoint_sha256: str | None = None
        torch.set_num_threads(max(1, num_threads))

    def _model(self) -> LoadedModel:
        if self.m is None:
            torch.manual_seed(0)  # random-init models are the same in every worker
            device = "cuda" if self.use_gpu and torch.cuda.is_available() else "cpu"
            ckpt = checkpoint_of(self.name)
            if ckpt is not None:  # a local checkpoint, safe-loaded with its architecture
                self.checkpoint_sha256 = file_sha256(ckpt[0]) if Path(ckpt[0]).is_file() else None
                self.m = load_model(ckpt[0], arch=ckpt[1], device=device)
            else:
                self.m = load_model(self.name, pretrained=self.pretrained, device=device)
        return self.m

    def load(self) -> dict[str, Any]:
        """The model's spec and where its weights came from; a vitlens error becomes a reason."""
        try:
            m = self._model()
        except VitlensError as e:
            return {"ok": False, "reason": e.message_for("cli"), "error": type(e).__name__}
        return {"ok": True, "spec": m.spec.to_dict(), "source": m.source, "weights": m.weights,
                "device": str(m.device), "checkpoint_sha256": self.checkpoint_sha256}

    def run(self, source: dict[str, Any], shard: tuple[int, int, int], views: tuple[str, ...], batch_size: int,
            renormalize: bool = True) -> dict[str, Any]:
        m = self._model()
        return run_shard(m, ImageSource.from_dict(source), Shard(*shard), tuple(views), batch_size, renormalize)

    def weights(self) -> dict[str, Any]:
        return weight_views(self._model())


#: the one model this process holds for survey tasks (``survey_task``): its key and its worker
_HELD: dict[tuple[Any, ...], SurveyWorker] = {}


def survey_task(cls: type[SurveyWorker], model: tuple[str, bool, str | None], op: str, threads: int,
                use_gpu: bool, keep: bool, *args: Any, registered: tuple[View, ...] = ()) -> Any:
    """One survey task (``op``: "load", "weights" or "run" with its arguments) on ``model`` = (name as
    ``SurveyWorker`` takes it, pretrained, the checkpoint's sha256 when the survey started or None).

    The rule: a process holds one model at a time; a task on the model it holds reuses it, a task on another drops
    it first (so a process never holds two), and a task sent with ``keep`` false (the driver's last tasks of that
    model) drops it when done, so no process holds a model after its survey (it keeps only its imports). A
    checkpoint is held under the digest the driver recorded, so a file changed since is loaded again, and the load
    reports the digest it read (the driver refuses a mismatch). ``cls`` is ``SurveyWorker`` or a subclass (tests
    inject faults through it). ``registered``: the views registered in the driver (``registry.registered_views``),
    registered here too before the task runs, so a view the driver knows is one its workers know."""
    for view in registered:
        if VIEW_REGISTRY.get(view.name) is not view:
            register_view(view, replace=True)
    key = (cls, *model, use_gpu)
    worker = _HELD.get(key)
    if worker is None:
        _release()
        worker = cls(model[0], model[1], threads, use_gpu)
        _HELD[key] = worker
    torch.set_num_threads(max(1, threads))
    try:
        return getattr(worker, op)(*args)
    finally:
        if not keep:
            _release()


def _release() -> None:
    """Drop the held model (and the GPU memory its tensors kept cached)."""
    if _HELD:
        _HELD.clear()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
