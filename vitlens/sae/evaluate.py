"""``evaluate_sae``: an SAE measured on held-out images as the field measures SAEs (docs/definitions.md, "FVU", "L0",
"Dead and always-on features", "Spliced KL and top-1 agreement"): how much of the site's variance its reconstruction
leaves, how many features a token uses, which never or nearly always fire, and what the model's own output becomes
when the reconstruction takes the site's place in the forward.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.sites import SiteSession
from ..errors import InvalidParameterError, UnsupportedModelError
from ..images import Images, count_images
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result
from .activations import check_images_model, iter_site_batches, select_tokens, site_point, tokens_of
from .files import load_sae
from .model import SparseAutoencoder
from .trainer import check_positive

#: a feature that fires on more than this share of the held-out tokens is always on
ALWAYS_ON = 0.9


@dataclass(eq=False, repr=False)
class SAEEvaluationResult(Result):
    """An SAE's figures on held-out images.

    Attributes:
        fvu: fraction of variance unexplained, ``sum ||x - x_hat||^2 / sum ||x - mean(x)||^2`` over every token.
        l0: mean active features per token.
        dead_fraction: share of features that fire on no held-out token.
        always_on_fraction: share of features that fire on more than ``always_on`` of the tokens.
        frequency: [F] the share of tokens each feature fires on.
        kl: mean over images of KL(p || q) in nats, p the untouched output's softmax, q the output with the SAE's
            reconstruction spliced in at the site (NaN without a classifier).
        top1_agreement: share of images whose top class is the same with the reconstruction spliced in (NaN
            without a classifier).
        kl_per_image: [B] each image's KL.
        n_images: held-out images.
        n_tokens: tokens the SAE read.
        site: the site read and spliced.
        tokens: which of its tokens ("patches", "prefix", "all").
        always_on: the always-on threshold.
        model_name: the model's name.
    """

    kind = "sae_evaluation"
    fvu: float
    l0: float
    dead_fraction: float
    always_on_fraction: float
    frequency: np.ndarray
    kl: float
    top1_agreement: float
    kl_per_image: np.ndarray
    n_images: int
    n_tokens: int
    site: str
    tokens: str
    always_on: float = ALWAYS_ON
    model_name: str = ""

    def summary(self) -> str:
        spliced = (f"spliced in: KL {self.kl:.3g} nats, top-1 agreement {self.top1_agreement:.1%}"
                   if np.isfinite(self.kl) else "no classifier to splice against")
        return (f"SAE at {self.site} of {self.model_name or 'the model'} on {self.n_images} held-out images: FVU "
                f"{self.fvu:.3g}, L0 {self.l0:.1f}, {self.dead_fraction:.1%} dead, {self.always_on_fraction:.1%} "
                f"always on; {spliced}")

    def to_rows(self) -> list[dict]:
        """One row per figure (measure, value)."""
        names = ("fvu", "l0", "dead_fraction", "always_on_fraction", "kl", "top1_agreement", "n_images", "n_tokens")
        return [{"measure": n, "value": float(getattr(self, n))} for n in names]


def as_sae(sae: Any) -> SparseAutoencoder:
    """A ``SparseAutoencoder`` from one, a training result (``.sae``) or a path ``load_sae`` reads."""
    if isinstance(sae, SparseAutoencoder):
        return sae
    if isinstance(getattr(sae, "sae", None), SparseAutoencoder):
        return sae.sae
    if isinstance(sae, (str, Path)):
        return load_sae(sae)
    raise InvalidParameterError(f"sae must be a SparseAutoencoder, a train_sae result or the path of an SAE file; "
                                f"got a {type(sae).__name__}.")


class Splice:
    """What a ``SiteSession`` does at the site: the selected tokens replaced by the SAE's reconstruction (a new
    tensor, the forward's own left as it was)."""

    def __init__(self, m: LoadedModel, sae: SparseAutoencoder, site: str, tokens: str, x: torch.Tensor) -> None:
        self.m, self.sae, self.site, self.tokens, self.x = m, sae, site, tokens, x

    def __call__(self, name: str, value: Any) -> torch.Tensor:
        acts, prefix, _ = tokens_of(value, self.m, self.x, self.site)
        b, t, d = acts.shape
        recon = self.sae(select_tokens(acts, prefix, self.tokens))[0]
        new = acts.clone()
        part = slice(prefix, t) if self.tokens == "patches" else slice(0, prefix) if self.tokens == "prefix" \
            else slice(0, t)
        new[:, part] = recon.reshape(b, -1, d)
        return new.to(value.dtype).reshape(value.shape)


@torch.no_grad()
def evaluate_sae(m: LoadedModel, sae: Any, images: Images, site: str | None = None, batch_size: int = 16,
                 always_on: float = ALWAYS_ON, progress: ProgressArg = None) -> SAEEvaluationResult:
    """An SAE's FVU, L0, dead and always-on features, and the model's output with the reconstruction spliced in, on
    held-out images (docs/definitions.md, "Sparse autoencoder").

    Args:
        m: the model.
        sae: a ``SparseAutoencoder``, a ``train_sae`` result or the path of an SAE file.
        images: held-out images (tensor, sequence of PIL images / paths / arrays, or iterable of tensors).
        site: the site to read and splice (default the SAE's own ``config.site``; needed for a file that names none).
        batch_size: images per forward (two forwards a batch: untouched and spliced).
        always_on: the share of tokens above which a feature counts as always on.
        progress: True for a bar, or a callable ``f(done, total)`` (images).

    Returns:
        A ``SAEEvaluationResult``.
    """
    model_sae = as_sae(sae)
    site = site or model_sae.config.site
    if not site:
        raise InvalidParameterError("this SAE names no site: pass site='blocks.{i}.hook_resid_post' (the site it "
                                    "was trained on).")
    check_images_model(m)
    points = site_point(m, site)
    check_positive("batch_size", batch_size, integer=True)
    if isinstance(always_on, bool) or not isinstance(always_on, (int, float)) or not 0 < always_on <= 1:
        raise InvalidParameterError(f"always_on is a share of tokens, in (0, 1]; got {always_on!r}.")
    if count_images(images) == 0:
        raise InvalidParameterError("No images given: pass at least one held-out image.")
    tokens = model_sae.config.tokens
    model_sae = copy.deepcopy(model_sae).to(m.device).eval() if model_sae.W_dec.device != m.device else model_sae.eval()
    classifier = m.spec.num_classes > 0
    f = model_sae.n_features
    fired = torch.zeros(f, dtype=torch.float64, device=m.device)
    err = sq = 0.0
    total = torch.zeros(model_sae.config.d_in, dtype=torch.float64, device=m.device)
    n_tok, active, agree, seen_images = 0, 0.0, 0, 0
    kls: list[torch.Tensor] = []
    n = count_images(images)
    with Progress(progress, n, "sae evaluation") as bar:
        for b in iter_site_batches(m, images, site, batch_size):
            x = select_tokens(b.acts, b.prefix, tokens)
            if x.shape[1] != model_sae.config.d_in:
                raise InvalidParameterError(f"the SAE reads {model_sae.config.d_in}-wide tokens and {site} of "
                                            f"{m.spec.name} holds {x.shape[1]}-wide ones: is it this model's SAE?")
            recon, z = model_sae(x)
            x64 = x.double()
            err += float((recon.double() - x64).pow(2).sum())
            sq += float(x64.pow(2).sum())
            total += x64.sum(0)
            n_tok += int(x.shape[0])
            on = z > 0
            active += float(on.sum())
            fired += on.sum(0).double()
            if classifier and b.logits is not None:
                kl, same = spliced_change(m, model_sae, site, tokens, points, b.pixels, b.logits)
                kls.append(kl)
                agree += same
            seen_images = b.start + int(b.acts.shape[0])
            bar.update(seen_images)
    variance = sq - float(total.pow(2).sum()) / max(n_tok, 1)  # sum ||x - mean||^2
    freq = (fired / max(n_tok, 1)).cpu().numpy()
    kl_all = torch.cat(kls).cpu().numpy() if kls else np.zeros(0)
    return SAEEvaluationResult(
        fvu=err / max(variance, 1e-30), l0=active / max(n_tok, 1), dead_fraction=float((freq == 0).mean()),
        always_on_fraction=float((freq > always_on).mean()), frequency=freq,
        kl=float(kl_all.mean()) if len(kl_all) else float("nan"),
        top1_agreement=agree / len(kl_all) if len(kl_all) else float("nan"), kl_per_image=kl_all,
        n_images=seen_images, n_tokens=n_tok, site=site, tokens=tokens, always_on=float(always_on),
        model_name=m.spec.name)


def spliced_change(m: LoadedModel, sae: SparseAutoencoder, site: str, tokens: str, points: dict, x: Any,
                   logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(KL(p || q) per image [B], images whose top class agrees)`` for one batch ``x``: ``p`` the untouched
    output's softmax (``logits``), ``q`` the output's with the SAE's reconstruction in the site's place."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedModelError(f"{m.spec.name}: the batch's pixels were not kept, so the spliced forward "
                                    "cannot run.")
    with SiteSession(m.model, points, Splice(m, sae, site, tokens, x)):
        spliced = m.forward(x).float()
    logp = torch.log_softmax(logits.double(), -1)
    logq = torch.log_softmax(spliced.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return kl, int((logits.argmax(-1) == spliced.argmax(-1)).sum())


__all__ = ["ALWAYS_ON", "SAEEvaluationResult", "Splice", "as_sae", "evaluate_sae", "spliced_change"]
