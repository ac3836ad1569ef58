"""What a training gives: ``SAETrainingResult``, the trained SAE's weights and the per-step history, plain data that
saves and loads like every result (``train_sae``, in one process or on Ray)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..loading.model import LoadedModel
from ..results import Result
from .files import PARAMETERS, build_sae
from .model import SAEConfig, SparseAutoencoder
from .trainer import HISTORY, SAETrainer


@dataclass(eq=False, repr=False)
class SAETrainingResult(Result):
    """A trained SAE and how its training went.

    Attributes:
        config: the ``SAEConfig`` as a dict.
        W_enc: [d_in, F] the encoder (``sae`` builds the module).
        b_enc: [F].
        W_dec: [F, d_in] the decoder, rows at unit norm.
        b_dec: [d_in].
        tokens: [S] tokens seen after each step.
        loss: [S] each step's loss (FVU, plus the L1 term and the weighted AuxK loss where they apply).
        fvu: [S] each step's fraction of variance unexplained on its batch.
        l0: [S] mean active features per token.
        aux_loss: [S] the AuxK loss (0 while no feature is dead).
        dead_fraction: [S] features dead (no firing in the last ``dead_after`` tokens) after each step.
        n_images: images per epoch.
        epochs: passes over the images.
        cached_batches: batches the later epochs read from the cache instead of a forward.
        seconds: wall time of the training.
        model_name: the model's name.
    """

    kind = "sae_training"
    config: dict
    W_enc: np.ndarray
    b_enc: np.ndarray
    W_dec: np.ndarray
    b_dec: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    fvu: np.ndarray
    l0: np.ndarray
    aux_loss: np.ndarray
    dead_fraction: np.ndarray
    n_images: int = 0
    epochs: int = 1
    cached_batches: int = 0
    seconds: float = 0.0
    model_name: str = ""

    @cached_property
    def sae(self) -> SparseAutoencoder:
        """The trained ``SparseAutoencoder`` (built once from the arrays, on the CPU)."""
        config = SAEConfig.from_dict(dict(self.config))
        return build_sae(config, {n: torch.from_numpy(np.array(getattr(self, n), dtype=np.float32))
                                  for n in PARAMETERS}, Path("the training result"))

    def summary(self) -> str:
        c = self.config
        sparsity = f"k={c['k']}" if c["kind"] == "topk" else f"l1={c['l1']:g}"
        last = (f"last step: FVU {self.fvu[-1]:.3g}, L0 {self.l0[-1]:.1f}, {self.dead_fraction[-1]:.0%} dead"
                if len(self.fvu) else "no step")
        seen = int(self.tokens[-1]) if len(self.tokens) else 0
        return (f"{c['kind']} SAE of {c['n_features']} features ({sparsity}) on {c['tokens']} tokens of "
                f"{c['site']} of {self.model_name or 'the model'}: {len(self.fvu)} steps, {seen} tokens; {last}")

    def to_rows(self) -> list[dict]:
        """One row per step: tokens seen and the step's figures."""
        return [{"step": s + 1, **{k: float(getattr(self, k)[s]) for k in HISTORY}} for s in range(len(self.fvu))]


def new_config(d_in: int, n_features: int, k: int | None, kind: str, l1: float, site: str, tokens: str,
               m: LoadedModel, seed: int) -> SAEConfig:
    """The ``SAEConfig`` of a training (``k`` only for TopK, ``l1`` only for ReLU)."""
    return SAEConfig(d_in=int(d_in), n_features=int(n_features), kind=kind, k=k if kind == "topk" else None,
                     l1=float(l1) if kind == "relu" else 0.0, site=site, tokens=tokens, model_name=m.spec.name,
                     seed=int(seed))


def training_result(trainer: SAETrainer, n_images: int, epochs: int, cached: int, seconds: float,
                    model_name: str) -> SAETrainingResult:
    """The result of a finished ``SAETrainer``."""
    sae = trainer.sae.cpu()
    h = trainer.history.rows
    weights = {n: getattr(sae, n).detach().numpy().copy() for n in PARAMETERS}
    return SAETrainingResult(config=sae.config.to_dict(), **weights,
                             **{key: np.asarray(h[key], dtype=np.int64 if key == "tokens" else np.float64)
                                for key in HISTORY},
                             n_images=int(n_images), epochs=int(epochs), cached_batches=int(cached),
                             seconds=float(seconds), model_name=model_name)


__all__ = ["SAETrainingResult", "new_config", "training_result"]
