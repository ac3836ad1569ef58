"""A feature ablated or clamped at its site, and what the model does then (issue 66, item 3; docs/definitions.md,
"SAE feature interventions"): the logits and the attention rollout (Fig. 6) with and without the edit, each from one
forward per batch of the engine's stream, the edit a ``SiteSession`` that returns a new tensor at the SAE's site.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..engine.consumer import AttentionConsumer
from ..engine.sites import SiteSession
from ..engine.stream import stream_attention
from ..errors import InvalidParameterError, UnsupportedModelError
from ..images import Images
from ..loading.model import LoadedModel
from ..progress import ProgressArg
from ..results import Result
from ..views.registry import VIEWS, ViewParams
from ..words import class_label
from .activations import check_images_model, site_point
from .evaluate import as_sae
from .model import TOKEN_SETS, SparseAutoencoder

#: what an intervention does to the feature: remove its contribution, or set its activation to a value
INTERVENTIONS = ("ablate", "clamp")


@dataclass(eq=False, repr=False)
class SAEInterventionResult(Result):
    """The logits and the rollout of a set of images with one feature ablated or clamped at the SAE's site.

    Attributes:
        feature: the feature edited.
        mode: "ablate" (its decoder contribution removed) or "clamp" (its activation set to ``value``).
        value: the clamped activation (0 for an ablation).
        activation: [B] the feature's largest activation on each image before the edit (over the SAE's tokens).
        logits_before: [B, C] the model's output untouched.
        logits_after: [B, C] with the edit.
        rollout_before: [B, gh, gw] attention rollout untouched (each divided by its maximum).
        rollout_after: [B, gh, gw] with the edit.
        class_names: the C outputs' names.
        site: the SAE's site.
        tokens: the tokens edited ("patches", "prefix", "all": those the SAE reads).
        model_name: the model's name.
    """

    kind = "sae_intervention"
    feature: int
    mode: str
    value: float
    activation: np.ndarray
    logits_before: np.ndarray
    logits_after: np.ndarray
    rollout_before: np.ndarray
    rollout_after: np.ndarray
    class_names: list = field(default_factory=list)
    site: str = ""
    tokens: str = "patches"
    model_name: str = ""

    def predicted(self) -> tuple[np.ndarray, np.ndarray]:
        """([B] top class before, [B] after)."""
        return self.logits_before.argmax(-1), self.logits_after.argmax(-1)

    def name(self, c: int) -> str:
        return class_label(self.class_names, int(c))

    def summary(self) -> str:
        before, after = self.predicted()
        what = "ablated" if self.mode == "ablate" else f"clamped to {self.value:g}"
        change = np.abs(self.logits_after - self.logits_before).max() if self.logits_before.size else 0.0
        moved = np.abs(self.rollout_after - self.rollout_before).max() if self.rollout_before.size else 0.0
        return (f"{self.model_name or 'model'}: feature {self.feature} {what} at {self.site}: top class kept on "
                f"{float(np.mean(before == after)):.0%} of {len(before)} images, largest logit change {change:.3g}, "
                f"largest rollout change {moved:.3g}")

    def to_rows(self) -> list[dict]:
        """One row per image: the feature's activation, top class and its logit before and after."""
        before, after = self.predicted()
        return [{"image": b, "activation": float(self.activation[b]), "before": self.name(before[b]),
                 "after": self.name(after[b]), "logit_before": float(self.logits_before[b, before[b]]),
                 "logit_after": float(self.logits_after[b, before[b]]),
                 "rollout_change": float(np.abs(self.rollout_after[b] - self.rollout_before[b]).max())}
                for b in range(len(before))]


def feature_edit(sae: nn.Module, feature: int, mode: str, value: float = 0.0
                 ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``edit(acts [B, T, D]) -> acts'`` for the SAE's tokens: ablate, ``x - z_f W_dec[f]`` (the feature's decoder
    contribution removed, the reconstruction error kept); clamp, ``x + (value - z_f) W_dec[f]`` (its activation set to
    ``value`` on every token it reads). Tokens the SAE does not read are left as they are."""
    tokens = sae.config.tokens
    if tokens not in TOKEN_SETS:
        raise InvalidParameterError(f"The SAE's tokens must be one of {', '.join(TOKEN_SETS)}; got {tokens!r}.")
    direction = sae.W_dec.detach()[feature]

    def edit(acts: torch.Tensor, prefix: int) -> torch.Tensor:
        part = slice(prefix, None) if tokens == "patches" else slice(0, prefix) if tokens == "prefix" else slice(None)
        x = acts[:, part]
        b, t, d = x.shape
        with torch.no_grad():
            z = sae.encode(x.reshape(b * t, d).to(direction.dtype))[:, feature].reshape(b, t, 1)
        target = torch.zeros_like(z) if mode == "ablate" else torch.full_like(z, float(value))
        out = acts.clone()
        out[:, part] = x + ((target - z) * direction).to(acts.dtype)
        return out
    return edit


class _Logits(AttentionConsumer):
    """The model's output of every batch, kept in order (the logits the intervention compares)."""

    reads_every_kind = True

    def __init__(self) -> None:
        self.kept: list[np.ndarray] = []

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        if logits is None or logits.ndim != 2:
            raise UnsupportedModelError("The model gives no logits [B, C]; an intervention compares them.")
        self.kept.append(logits.double().cpu().numpy())

    def result(self, spec: Any) -> np.ndarray:
        return np.concatenate(self.kept) if self.kept else np.zeros((0, 0))


class _Activation(AttentionConsumer):
    """The feature's largest activation on each image, read at the SAE's site in the untouched pass."""

    reads_every_kind = True

    def __init__(self, m: LoadedModel, sae: nn.Module, feature: int) -> None:
        self.m, self.sae, self.feature = m, sae, feature
        self.kept: list[np.ndarray] = []

    def hooks(self) -> contextlib.AbstractContextManager:
        prefix, tokens = self.m.spec.num_prefix_tokens, self.sae.config.tokens

        def keep(_name: str, acts: torch.Tensor) -> None:
            part = acts[:, prefix:] if tokens == "patches" else acts[:, :prefix] if tokens == "prefix" else acts
            b, t, d = part.shape
            with torch.no_grad():
                z = self.sae.encode(part.reshape(b * t, d).to(self.sae.W_dec.dtype))[:, self.feature]
            self.kept.append(z.reshape(b, t).amax(1).double().cpu().numpy())
        return SiteSession(self.m.model, site_point(self.m, self.sae.config.site), keep)

    def result(self, spec: Any) -> np.ndarray:
        return np.concatenate(self.kept) if self.kept else np.zeros(0)


@contextlib.contextmanager
def edited(m: LoadedModel, sae: nn.Module, feature: int, mode: str, value: float = 0.0) -> Iterator[None]:
    """Forwards inside the block run with the feature ablated or clamped at the SAE's site (``feature_edit``)."""
    edit = feature_edit(sae, feature, mode, value)
    prefix = m.spec.num_prefix_tokens
    with SiteSession(m.model, site_point(m, sae.config.site), lambda _name, acts: edit(acts, prefix)):
        yield


def _pass(m: LoadedModel, images: Images, batch_size: int, progress: ProgressArg, extra: list[AttentionConsumer]
          ) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, C], rollout [B, gh, gw]) from one stream: the registry's rollout view of the model's kind."""
    rollout = VIEWS["rollout"].build(m, ViewParams())
    logits = _Logits()
    stream_attention(m, images, [rollout, logits, *extra], batch_size, progress, desc="sae intervention",
                     capture_mode=None)
    return logits.result(m.spec), rollout.result(m.spec).maps


def sae_intervene(m: LoadedModel, sae: SparseAutoencoder | str | Path | Any, images: Images, feature: int,
                  mode: str = "ablate", value: float | None = None, batch_size: int = 16, progress: ProgressArg = None
                  ) -> SAEInterventionResult:
    """One feature ablated or clamped at the SAE's site: the logits and the attention rollout (Fig. 6) of ``images``
    with and without the edit (docs/definitions.md, "SAE feature interventions").

    Args:
        m: the model the SAE was trained on.
        sae: a ``SparseAutoencoder`` whose ``config.site`` is a site of ``m``, a ``train_sae`` result or the path of
            an SAE file.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        feature: the feature edited.
        mode: "ablate" (its decoder contribution removed from the tokens the SAE reads) or "clamp" (its activation set
            to ``value`` on them).
        value: the clamped activation (required with ``mode="clamp"``).
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.

    Returns:
        A ``SAEInterventionResult``.

    Raises:
        InvalidParameterError: an unknown mode, a feature out of range, a clamp without a value.
    """
    check_images_model(m)
    sae = as_sae(sae)
    if mode not in INTERVENTIONS:
        raise InvalidParameterError(f"mode must be one of {', '.join(INTERVENTIONS)}; got {mode!r}.")
    n = int(sae.config.n_features)
    if isinstance(feature, bool) or not isinstance(feature, (int, np.integer)) or not 0 <= int(feature) < n:
        raise InvalidParameterError(f"feature must be a feature index in [0, {n}); got {feature!r}.")
    if mode == "clamp" and (value is None or not np.isfinite(float(value))):
        raise InvalidParameterError("mode='clamp' sets the feature's activation: give value= a finite number (e.g. "
                                    "its top activation, SAEFeaturesResult.top_values).")
    if mode == "ablate" and value not in (None, 0, 0.0):
        raise InvalidParameterError("mode='ablate' removes the feature (value 0); use mode='clamp' to set a value.")
    feature, clamp = int(feature), float(value or 0.0)
    site_point(m, sae.config.site)  # an unknown site refused before any forward
    activation = _Activation(m, sae, feature)
    logits_before, rollout_before = _pass(m, images, batch_size, progress, [activation])
    with edited(m, sae, feature, mode, clamp):
        logits_after, rollout_after = _pass(m, images, batch_size, progress, [])
    names = list(m.label_names() or [])
    return SAEInterventionResult(
        feature=feature, mode=mode, value=clamp, activation=activation.result(m.spec), logits_before=logits_before,
        logits_after=logits_after, rollout_before=rollout_before, rollout_after=rollout_after,
        class_names=[class_label(names, c) for c in range(logits_before.shape[-1])], site=sae.config.site,
        tokens=sae.config.tokens, model_name=m.spec.name)


__all__ = ["INTERVENTIONS", "SAEInterventionResult", "edited", "feature_edit", "sae_intervene"]
