"""One SAE's optimisation, step by step, on whatever hands it token batches: the engine's stream on one machine
(``train_sae``) or Ray Data's batches on many (``train_sae(on="ray")``). Docs: docs/definitions.md, "Sparse
autoencoder", "FVU", "L0", "Dead and always-on features", "AuxK".

Each step on tokens ``x`` [N, d_in]:

- the loss is the batch's fraction of variance unexplained, ``||x - x_hat||^2 / ||x - mean(x)||^2`` (the normalised
  MSE of Gao et al. 2024: the same number for any scale of the residual stream, so one learning rate fits every
  site); a ReLU SAE adds ``l1 * mean_tokens(sum_f z_f) / rms`` (Bricken et al. 2023's penalty on the code, with
  ``rms`` the batch's root mean square distance from its mean: a number without units as well);
- a feature that has not fired on any of the last ``dead_after`` tokens is dead, and AuxK (Gao et al. 2024, sec.
  A.2) asks the ``k_aux`` largest pre-activations among the dead features to reconstruct what the live ones left,
  ``e = x - x_hat``: ``aux_coef * ||e - e_hat||^2 / ||e - mean(e)||^2``, so a dead feature's encoder gets a gradient
  again;
- after Adam's update every decoder row goes back to unit norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .model import SAEConfig, SparseAutoencoder

#: Gao et al. 2024's weight of the AuxK loss
AUX_COEF = 1 / 32
#: tokens without a firing after which a feature counts as dead for AuxK (Gao et al. count 10M on their LMs; a
#: ViT's site sees ~200 tokens an image, so this is ~500 images)
DEAD_AFTER = 100_000
#: the history's columns, one value per step
HISTORY = ("tokens", "loss", "fvu", "l0", "aux_loss", "dead_fraction")


def check_positive(name: str, value: object, integer: bool = False) -> None:
    """Refuse a number that is not > 0 (an integer where ``integer``) in one line naming it."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
        raise InvalidParameterError(f"{name} must be {'an integer' if integer else 'a finite number'} > 0; got "
                                    f"{value!r}.")


@dataclass
class History:
    """Per-step figures of a training (``HISTORY``)."""

    rows: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in HISTORY})

    def add(self, **values: float) -> None:
        for key in HISTORY:
            self.rows[key].append(float(values[key]))

    def last(self, key: str) -> float:
        return self.rows[key][-1] if self.rows[key] else float("nan")


class SAETrainer:
    """The SAE of ``config`` trained step by step (built on the first batch, whose mean is its first ``b_dec``).

    Args:
        config: what to train (``d_in`` is checked against the first batch).
        lr: Adam's learning rate.
        device: where the SAE lives.
        dead_after: tokens without a firing after which a feature is dead (AuxK's set).
        aux_coef: AuxK's weight (0: no AuxK).
        k_aux: how many dead features AuxK lets reconstruct a token (None: d_in // 2, Gao et al.'s choice).
    """

    def __init__(self, config: SAEConfig, lr: float = 1e-3, device: torch.device | str = "cpu",
                 dead_after: int = DEAD_AFTER, aux_coef: float = AUX_COEF, k_aux: int | None = None) -> None:
        check_positive("lr", lr)
        check_positive("dead_after", dead_after, integer=True)
        if isinstance(aux_coef, bool) or not isinstance(aux_coef, (int, float)) or not aux_coef >= 0:
            raise InvalidParameterError(f"aux_coef must be a number >= 0; got {aux_coef!r}.")
        if k_aux is not None:
            check_positive("k_aux", k_aux, integer=True)
        self.config = config
        self.lr = float(lr)
        self.device = torch.device(device)
        self.dead_after = int(dead_after)
        self.aux_coef = float(aux_coef)
        self.k_aux = int(k_aux) if k_aux is not None else max(1, config.d_in // 2)
        self.sae = SparseAutoencoder(config).to(self.device)
        self.opt = torch.optim.Adam(self.sae.parameters(), lr=self.lr)
        self.since_fired = torch.zeros(config.n_features, dtype=torch.long, device=self.device)
        self.tokens = 0
        self.history = History()

    def step(self, x: torch.Tensor) -> None:
        """One optimisation step on tokens ``x`` [N, d_in]."""
        x = x.to(self.device, torch.float32)
        if x.ndim != 2 or x.shape[1] != self.config.d_in:
            raise InvalidParameterError(f"the SAE reads tokens [N, {self.config.d_in}]; got {tuple(x.shape)}.")
        sae = self.sae
        if self.tokens == 0:
            with torch.no_grad():
                sae.b_dec.copy_(x.mean(0))  # the features measured from the data's centre from the first step
        pre = sae.pre_acts(x)
        z = sae.activate(pre)
        recon = sae.decode(z)
        centred = x - x.mean(0)
        denom = centred.pow(2).sum().clamp_min(1e-12)
        fvu = (recon - x).pow(2).sum() / denom
        loss = fvu
        if self.config.kind == "relu" and self.config.l1 > 0:
            rms = (denom / x.shape[0]).sqrt()
            loss = loss + self.config.l1 * z.sum(-1).mean() / rms
        dead = self.since_fired >= self.dead_after
        aux = torch.zeros((), device=self.device)
        if self.aux_coef > 0 and bool(dead.any()):
            aux = self._aux_loss(x, recon, pre, dead)
            loss = loss + self.aux_coef * aux
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        sae.normalize_decoder()
        with torch.no_grad():
            fired = (z > 0).any(0)
            self.since_fired += x.shape[0]
            self.since_fired[fired] = 0
            self.tokens += int(x.shape[0])
            self.history.add(tokens=self.tokens, loss=loss.item(), fvu=fvu.item(),
                             l0=(z > 0).sum(-1).float().mean().item(), aux_loss=aux.item(),
                             dead_fraction=(self.since_fired >= self.dead_after).float().mean().item())

    def progress_text(self) -> str:
        """The last step's loss, L0 and FVU, as the progress bar shows them."""
        h = self.history
        return f"sae loss {h.last('loss'):.3g} L0 {h.last('l0'):.1f} FVU {h.last('fvu'):.3f}"

    def _aux_loss(self, x: torch.Tensor, recon: torch.Tensor, pre: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
        """AuxK: the dead features' top ``k_aux`` pre-activations reconstruct the live ones' error."""
        e = (x - recon).detach()
        dead_pre = pre[:, dead]
        k = min(self.k_aux, int(dead_pre.shape[1]))
        values, idx = dead_pre.topk(k, dim=-1, sorted=False)
        z_aux = torch.zeros_like(dead_pre).scatter(-1, idx, torch.relu(values))
        e_hat = z_aux @ self.sae.W_dec[dead]
        return (e_hat - e).pow(2).sum() / (e - e.mean(0)).pow(2).sum().clamp_min(1e-12)


__all__ = ["AUX_COEF", "DEAD_AFTER", "HISTORY", "History", "SAETrainer", "check_positive"]
