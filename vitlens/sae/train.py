"""``train_sae``: a sparse autoencoder of a named site trained online, batch by batch, from the activations one
forward of the model hands over (docs/definitions.md, "Sparse autoencoder"); with ``cache_bytes`` the later epochs
read a float16 cache within that budget (``cache``).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..errors import InvalidParameterError
from ..images import Images, count_images
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from .activations import check_images_model, iter_site_batches, select_tokens, site_point
from .cache import ActivationCache, check_cache_bytes
from .model import SAE_KINDS, TOKEN_SETS
from .result import SAETrainingResult, new_config, training_result
from .trainer import AUX_COEF, DEAD_AFTER, SAETrainer, check_positive

#: where ``train_sae`` runs the forward: this process, or Ray Data's workers (``ray_train``)
TRAIN_ON = ("local", "ray")


def check_train_arguments(m: LoadedModel, images: Images, site: str, n_features: int, k: int | None, kind: str,
                          tokens: str, epochs: int, batch_size: int, lr: float, cache_bytes: int) -> None:
    """Every argument of ``train_sae`` checked before any forward, each refusal naming the value and what fits."""
    check_images_model(m)
    site_point(m, site)
    if kind not in SAE_KINDS:
        raise InvalidParameterError(f"kind must be one of {', '.join(SAE_KINDS)}; got {kind!r}.")
    if tokens not in TOKEN_SETS:
        raise InvalidParameterError(f"tokens must be one of {', '.join(TOKEN_SETS)}; got {tokens!r}.")
    if tokens == "prefix" and m.spec.num_prefix_tokens < 1:
        raise InvalidParameterError(f"tokens='prefix' reads the prefix tokens, and {m.spec.name} has none: use "
                                    "tokens='patches' or 'all'.")
    check_positive("n_features", n_features, integer=True)
    if kind == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_features:
            raise InvalidParameterError(f"k (active features per token) must be an integer from 1 to n_features "
                                        f"({n_features}); got {k!r}.")
    check_positive("epochs", epochs, integer=True)
    check_positive("batch_size", batch_size, integer=True)
    check_positive("lr", lr)
    check_cache_bytes(cache_bytes)
    n = count_images(images)
    if n == 0:
        raise InvalidParameterError("No images given: pass at least one image.")
    if n is None and epochs > 1 and isinstance(images, Iterator):
        raise InvalidParameterError(f"epochs={epochs} reads the images {epochs} times, and an iterator is read once: "
                                    "pass a list, a tensor or a re-iterable dataset.")


def token_batches(m: LoadedModel, images: Images, site: str, tokens: str, batch_size: int, epochs: int,
                  cache: ActivationCache) -> Iterator[tuple[torch.Tensor, int, bool]]:
    """``(tokens [N, d], images, cached)`` of every batch of every epoch: the first epoch's forward batches kept in
    ``cache`` while they fit (the first batches, in order), the later epochs reading those and running the forward
    for the rest only."""
    sizes: list[int] = []
    for b in iter_site_batches(m, images, site, batch_size):
        x = select_tokens(b.acts, b.prefix, tokens)
        if len(cache) == len(sizes):  # the cache holds a prefix of the batches: a later epoch skips exactly those
            cache.add(len(sizes), x)
        sizes.append(int(b.acts.shape[0]))
        yield x, sizes[-1], False
    for _ in range(1, epochs):
        for index in range(len(cache)):
            yield cache.get(index), sizes[index], True
        if len(cache) < len(sizes):
            for b in iter_site_batches(m, images, site, batch_size, skip=len(cache)):
                yield select_tokens(b.acts, b.prefix, tokens), int(b.acts.shape[0]), False


def train_sae(m: LoadedModel, images: Images, site: str = "", n_features: int = 1024, k: int | None = 32,
              kind: str = "topk", tokens: str = "patches", epochs: int = 1, batch_size: int = 16, lr: float = 1e-3,
              seed: int = 0, l1: float = 1.0, cache_bytes: int = 0, dead_after: int = DEAD_AFTER,
              aux_coef: float = AUX_COEF, on: str = "local", workers: int = 2,
              worker_cpus: float = 1.0, progress: ProgressArg = None) -> SAETrainingResult:
    """Train a sparse autoencoder on a named site's tokens as the images stream (docs/definitions.md, "Sparse
    autoencoder"): one forward per batch, one optimisation step on its tokens, nothing kept beyond the batch unless
    ``cache_bytes`` allows a float16 cache for the later epochs.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors (re-iterable
            when ``epochs`` > 1).
        site: a named site (``blocks.5.hook_resid_post``; ``vitlens.engine.sites``); default the last block's output.
        n_features: the dictionary's size.
        k: active features per token of a TopK SAE.
        kind: "topk" (Gao et al. 2024) or "relu" (ReLU and an L1 penalty, Bricken et al. 2023).
        tokens: "patches", "prefix" (class token, registers) or "all".
        epochs: passes over the images.
        batch_size: images per forward (one optimisation step on all their tokens).
        lr: Adam's learning rate.
        seed: the initialisation's and the order's seed: the same seed on the same images gives the same weights.
        l1: the L1 coefficient of a ReLU SAE (``trainer``: relative to the batch's rms distance from its mean).
        cache_bytes: the on-disk float16 cache's budget in bytes (0: every epoch runs the forward).
        dead_after: tokens without a firing after which a feature is dead and AuxK revives it.
        aux_coef: AuxK's weight (0: off).
        on: "local" (this process) or "ray" (Ray Data's workers run the forward; ``ray_train``).
        workers: Ray Data's workers with ``on="ray"`` (each holds the model and runs the forward).
        worker_cpus: CPUs each Ray worker takes (a fraction lets several share a core).
        progress: True for a bar with the loss, L0 and FVU, or a callable ``f(done, total)`` (images).

    Returns:
        A ``SAETrainingResult``: the SAE (``.sae``) and its per-step history.
    """
    site = site or f"blocks.{m.spec.num_layers - 1}.hook_resid_post"
    if on not in TRAIN_ON:
        raise InvalidParameterError(f"on must be one of {', '.join(TRAIN_ON)}; got {on!r}.")
    check_train_arguments(m, images, site, n_features, k, kind, tokens, epochs, batch_size, lr, cache_bytes)
    if on == "ray":
        if cache_bytes:
            raise InvalidParameterError("cache_bytes is the one-process training's disk cache; with on='ray' the "
                                        "activations stay in Ray's object store: leave cache_bytes at 0.")
        check_positive("workers", workers, integer=True)
        check_positive("worker_cpus", worker_cpus)
        from .ray_train import train_sae_ray

        return train_sae_ray(m, images, site=site, n_features=n_features, k=k, kind=kind, tokens=tokens,
                             epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, l1=l1, dead_after=dead_after,
                             aux_coef=aux_coef, workers=workers, worker_cpus=worker_cpus, progress=progress)
    n = count_images(images)
    start = time.perf_counter()
    trainer: SAETrainer | None = None
    cached = 0
    with ActivationCache(cache_bytes) as cache, Progress(progress, None if n is None else n * epochs, "sae") as bar:
        done = 0
        for x, count, from_cache in token_batches(m, images, site, tokens, batch_size, epochs, cache):
            if trainer is None:
                trainer = SAETrainer(new_config(x.shape[1], n_features, k, kind, l1, site, tokens, m, seed), lr,
                                     m.device, dead_after, aux_coef)
            trainer.step(x)
            cached += int(from_cache)
            done += count
            bar.update(done)
            h = trainer.history
            bar.describe(f"sae loss {h.last('loss'):.3g} L0 {h.last('l0'):.1f} FVU {h.last('fvu'):.3f}")
    assert trainer is not None  # check_train_arguments refused no images
    return training_result(trainer, n or done // max(epochs, 1), epochs, cached, time.perf_counter() - start,
                           m.spec.name)


__all__ = ["TRAIN_ON", "check_train_arguments", "token_batches", "train_sae"]
