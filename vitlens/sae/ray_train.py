"""``train_sae(on="ray")``: the SAE's training past one machine, on Ray's own data engine (docs/definitions.md,
"Sparse autoencoder"; docs/security.md, "Surveys on Ray" for how a local Ray is started).

Ray Data reads the images and runs the model's forward on ``workers`` actors (``map_batches`` with a callable class,
``SiteForward``, that holds the model: each worker loads it once), and the trainer in the driver consumes the tokens
as they come (``iter_torch_batches``): the activations go from the workers' memory through Ray's object store to the
trainer and never touch the disk. Each dataset row is one forward's batch (the images ``start .. start +
batch_size`` of the same batches ``train_sae`` runs in one process), and the order is preserved
(``preserve_order``), so the trainer takes the same steps on the same tokens in the same order as in one process: the
same seed gives the same SAE (tests/test_sae_ray.py measures how close).

A worker that dies mid-epoch (its process killed, its node lost): Ray Data's actor pool restarts the actor and runs
the batch it held again (actors are made with unlimited restarts and task retries), and the trainer, which waits
for that batch to keep the order, takes its step once the batch arrives: no batch is lost or taken twice, and the
SAE is the one an undisturbed run gives; the epoch takes longer by the restart (a new process loading the model).
``analyses/sae_bench.py --kill`` measures it: a worker that exits while it holds the fourth batch of eight (ref-vit,
512 images, 2 CPUs) costs ~3.5 s more (10.5 s against 7.5 s) and gives bit-for-bit the one-process SAE.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..engine.sources import batch_source
from ..images import Images, count_images, preprocess
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from .activations import iter_site_batches, select_tokens
from .result import SAETrainingResult, new_config, training_result
from .trainer import SAETrainer


class SiteForward:
    """Ray Data's callable class: one worker's copy of the model, and per dataset row (one forward's batch) the
    site's selected tokens [N, d] with the batch's index on every token row.

    Args:
        m: the model (shipped to the worker once, when its actor starts).
        site: the named site.
        tokens: which of its tokens ("patches", "prefix", "all").
    """

    def __init__(self, m: LoadedModel, site: str, tokens: str) -> None:
        self.m, self.site, self.tokens = m, site, tokens

    def pixels(self, row: dict[str, Any]) -> torch.Tensor:
        if "paths" in row:  # the worker reads and preprocesses its images: the driver never opens them
            return preprocess([str(p) for p in row["paths"][0]], self.m.data_config)
        return torch.from_numpy(np.ascontiguousarray(row["pixels"][0]))

    def __call__(self, row: dict[str, Any]) -> dict[str, np.ndarray]:
        x = self.pixels(row)
        b = next(iter_site_batches(self.m, x, self.site, batch_size=len(x)))
        tokens = select_tokens(b.acts, b.prefix, self.tokens).cpu().numpy()
        return {"tokens": tokens, "batch": np.full(len(tokens), int(row["batch"][0]), dtype=np.int64),
                "images": np.full(len(tokens), int(x.shape[0]), dtype=np.int64)}


def dataset_rows(m: LoadedModel, images: Images, batch_size: int) -> list[dict[str, Any]]:
    """One row per forward: the batch's image paths (read by the workers) or, for images already in memory, its
    preprocessed pixels (the engine's batch source)."""
    if isinstance(images, Sequence) and not isinstance(images, (str, torch.Tensor)) and images \
            and all(isinstance(p, str) or hasattr(p, "__fspath__") for p in images):
        paths = [str(p) for p in images]
        return [{"batch": i, "paths": paths[s:s + batch_size]} for i, s in enumerate(range(0, len(paths), batch_size))]
    return [{"batch": i, "pixels": x.numpy()} for i, x in enumerate(batch_source(m, images).batches(batch_size))]


def forward_batches(ds: Any) -> Iterator[tuple[torch.Tensor, int]]:
    """``(tokens [N, d], images)`` per forward, in the dataset's order, from Ray Data's torch batches (which may cut
    a forward's tokens in several pieces, or join two forwards': regrouped here by the ``batch`` column)."""
    pieces: list[torch.Tensor] = []
    current, images = 0, 0
    for batch in ds.iter_torch_batches(batch_size=None):
        ids = batch["batch"]
        for b in torch.unique_consecutive(ids).tolist():
            if b != current:
                yield torch.cat(pieces), images
                pieces, current = [], b
            take = ids == b
            pieces.append(batch["tokens"][take].float())
            images = int(batch["images"][take][0])
    if pieces:
        yield torch.cat(pieces), images


def train_sae_ray(m: LoadedModel, images: Images, site: str, n_features: int, k: int | None, kind: str, tokens: str,
                  epochs: int, batch_size: int, lr: float, seed: int, l1: float, dead_after: int, aux_coef: float,
                  workers: int = 2, worker_cpus: float = 1.0, progress: ProgressArg = None,
                  forward_class: type = SiteForward) -> SAETrainingResult:
    """``train_sae``'s training with the forward on Ray Data's workers (arguments as ``train_sae``'s, checked there).

    Args:
        workers: actors that hold the model and run the forward.
        worker_cpus: CPUs each actor takes (a fraction lets several share a core).
        forward_class: the callable class the actors run (``SiteForward`` or a subclass of it).

    Returns:
        The ``SAETrainingResult``.
    """
    from ..survey.ray_setup import restore_local_env, start_ray

    ray, started, _ = start_ray(None, num_cpus=None)
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # the trainer's steps in the one-process order
    ctx.enable_progress_bars = False
    n = count_images(images)
    start = time.perf_counter()
    trainer: SAETrainer | None = None
    try:
        once = dataset_rows(m, images, batch_size)
        # every epoch's batches in one dataset: the actors load the model once for the whole training
        rows = [{**row, "batch": e * len(once) + row["batch"]} for e in range(epochs) for row in once]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            forward_class, fn_constructor_kwargs={"m": m, "site": site, "tokens": tokens}, batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=int(workers)), num_cpus=float(worker_cpus),
            batch_format="numpy")
        with Progress(progress, None if n is None else n * epochs, "sae (ray)") as bar:
            done = 0
            for x, count in forward_batches(ds):
                if trainer is None:
                    trainer = SAETrainer(new_config(x.shape[1], n_features, k, kind, l1, site, tokens, m, seed), lr,
                                         m.device, dead_after, aux_coef)
                trainer.step(x)
                done += count
                bar.update(done)
                h = trainer.history
                bar.describe(f"sae loss {h.last('loss'):.3g} L0 {h.last('l0'):.1f} FVU {h.last('fvu'):.3f}")
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        if started:
            ray.shutdown()
            restore_local_env()
    assert trainer is not None  # train_sae refused no images
    return training_result(trainer, n or done // max(epochs, 1), epochs, 0, time.perf_counter() - start, m.spec.name)


__all__ = ["SiteForward", "dataset_rows", "forward_batches", "train_sae_ray"]
