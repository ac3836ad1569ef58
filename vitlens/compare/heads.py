"""Which heads matter? Remove one head at a time and measure what the model loses.

A head is removed where the heads' outputs meet, just before the block's output projection
(``Family.head_outputs``): its slice of that input is replaced by its mean over the image set at
each token position (mean-ablation, default: the head says "nothing unusual") or by zeros
(zero-ablation). For every (layer, head): the mean drop of the intact prediction's logit over the
images and, when labels are given, the drop in accuracy. Ablations run batched: each forward
carries several (image, head) pairs. Set beside mean attention distance (paper Fig. 7 right),
this asks whether the local heads matter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError, UnsupportedModelError
from ..components.edits import set_head
from ..engine.sites import HookPoint, SiteSession, family_sites
from ..kinds import refuse_other_maps
from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result
from ..words import counted

ABLATIONS = ("mean", "zero")


@dataclass(eq=False, repr=False)
class HeadImportanceResult(Result):
    """What removing each head costs.

    Attributes:
        logit_drop: [L, H] mean over images of (intact - ablated) logit of the intact prediction.
        accuracy_drop: [L, H] intact accuracy - ablated accuracy (None without labels).
        base_logit: mean logit of the intact predictions.
        base_accuracy: accuracy of the intact model (None without labels).
        ablation: "mean" or "zero".
        n_images: images used.
        forwards: image forwards spent (intact run included).
        model_name: the model's name.
    """

    kind = "head_importance"
    logit_drop: np.ndarray
    accuracy_drop: np.ndarray | None
    base_logit: float
    base_accuracy: float | None
    ablation: str
    n_images: int
    forwards: int
    model_name: str = ""

    def summary(self) -> str:
        l, h = np.unravel_index(int(np.argmax(self.logit_drop)), self.logit_drop.shape)
        return (f"{self.model_name or 'model'}: {self.ablation}-ablation of {self.logit_drop.size} heads over "
                f"{counted(self.n_images, 'image')}; most important: layer {l + 1} head {h + 1} "
                f"(logit drop {self.logit_drop[l, h]:.3f})")

    def to_rows(self) -> list[dict]:
        """One row per (layer, head), 1-based."""
        rows = []
        for l in range(self.logit_drop.shape[0]):
            for h in range(self.logit_drop.shape[1]):
                row = {"layer": l + 1, "head": h + 1, "logit_drop": float(self.logit_drop[l, h])}
                if self.accuracy_drop is not None:
                    row["accuracy_drop"] = float(self.accuracy_drop[l, h])
                rows.append(row)
        return rows


def cost(m: LoadedModel, n_images: int) -> int:
    """Image forwards ``head_importance`` spends: the intact run plus one per head and image."""
    return n_images * (1 + m.spec.num_layers * m.spec.num_heads)


class HeadAblation(SiteSession):
    """Each block's heads where they meet, before the output projection (the named site ``blocks.{l}.attn.hook_z``),
    with heads removed.

    While ``plan`` is None a forward runs intact and the sites add up their value per token
    (``sums``, for mean-ablation); with ``plan`` a list of (layer, head), the batch holds
    ``len(plan)`` copies of ``rows`` images and copy j has head ``plan[j]`` replaced by zero or
    by its mean output (``means``).
    """

    def __init__(self, sites: Sequence[torch.nn.Module], heads: int, ablation: str,
                 model: torch.nn.Module | None = None) -> None:
        self.sites, self.heads, self.ablation = list(sites), heads, ablation
        self.plan: list[tuple[int, int]] | None = None
        self.rows = 0
        self.sums: list[torch.Tensor | None] = [None] * len(self.sites)
        self.means: list[torch.Tensor] = []
        # the model the sites belong to, whose lock the session holds
        super().__init__(model, {f"blocks.{layer}.attn.hook_z": HookPoint(site, "input")
                                 for layer, site in enumerate(self.sites)}, self._on)

    def _on(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        return self._hook(int(name.split(".")[1]), x)

    def _hook(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        if self.plan is None:  # the intact run: collect the per-token sums
            s = x.detach().double().sum(0)
            before = self.sums[layer]
            self.sums[layer] = s if before is None else before + s
            return None
        d = x.shape[-1] // self.heads
        x = x.clone()
        for j, (l, h) in enumerate(self.plan):
            if l == layer:
                rows = slice(j * self.rows, (j + 1) * self.rows)
                value = 0.0 if self.ablation == "zero" else self.means[layer][:, h * d:(h + 1) * d].to(x.dtype)
                set_head(x, h, d, value, rows)
        return x


def head_importance(
    m: LoadedModel,
    images: Images,
    labels: np.ndarray | None = None,
    ablation: str = "mean",
    batch_size: int = 32,
    progress: ProgressArg = None,
) -> HeadImportanceResult:
    """Drop in the predicted-class logit (and in accuracy, with labels) when each head is removed.

    Args:
        m: a model with a classifier head (BEiT, EVA, timm and Hugging Face ViTs).
        images: the images (kept in memory: every head is ablated on every image).
        labels: [N] class labels, for the accuracy drop.
        ablation: "mean" (the head's mean output over these images, per token) or "zero".
        batch_size: images per forward (several heads share a forward when the set is small).
        progress: True for a progress bar and the cost printed first, or a callable ``f(done, total)``.

    Returns:
        A ``HeadImportanceResult``: ``logit_drop`` [layers, heads] (mean drop of the predicted class's logit),
            ``accuracy_drop`` [layers, heads] with labels (else None), and the unablated ``base_logit``.
    """
    if ablation not in ABLATIONS:
        raise InvalidParameterError(f"ablation must be one of {', '.join(ABLATIONS)}; got {ablation!r}.")
    if m.spec.num_classes <= 0:
        raise InvalidParameterError(f"{m.spec.name} has no classifier head, so no prediction to lose.")
    refuse_other_maps(m.spec, "head importance (heads per layer, set against attention distance)")
    points = family_sites(m)  # where each block's heads meet, as the family declares it (attn.hook_z)
    found = [getattr(points.get(f"blocks.{i}.attn.hook_z"), "module", None)
             for i in range(len(m.family.attention_modules(m.model)))]
    sites: list[torch.nn.Module] = [s for s in found if s is not None]
    if len(sites) != len(found):
        raise UnsupportedModelError(f"{m.spec.family} models expose no module where the heads' outputs meet, so "
                                    "vitlens cannot remove one head at a time.")
    x_all = torch.cat(list(iter_batches(images, m.data_config, batch_size))).to(m.device)
    n, layers, heads = int(x_all.shape[0]), m.spec.num_layers, m.spec.num_heads
    labels = None if labels is None else np.asarray(labels)
    if labels is not None and len(labels) != n:
        raise InvalidParameterError(f"labels must have one entry per image ({n}); got {len(labels)}.")
    total = cost(m, n)

    ablate = HeadAblation(sites, heads, ablation, m.model)
    with ablate, torch.no_grad(), Progress(progress, total, "head importance") as bar:
        if progress:
            bar.note(f"head importance: {layers * heads} heads x {n} images = {total} image forwards "
                     f"({ablation}-ablation)")
        base = torch.cat([m.forward(x_all[i: i + batch_size]).float() for i in range(0, n, batch_size)])
        bar.update(n)
        sums = [s for s in ablate.sums if s is not None]
        if len(sums) != len(ablate.sums):
            raise UnsupportedModelError(f"{m.spec.name}: a block's heads were not seen in the forward, so vitlens "
                                        "cannot remove one head at a time.")
        ablate.means = [s / n for s in sums]
        pred = base.argmax(-1)
        base_logit = base.gather(1, pred[:, None])[:, 0]
        drop = np.zeros((layers, heads))
        correct = np.zeros((layers, heads))
        pairs = [(l, h) for l in range(layers) for h in range(heads)]
        b = min(n, batch_size)
        k = max(1, batch_size // b)
        done = n
        for start in range(0, n, b):
            xb = x_all[start: start + b]
            for c in range(0, len(pairs), k):
                plan = pairs[c: c + k]
                ablate.plan, ablate.rows = plan, int(xb.shape[0])
                out = m.forward(xb.repeat(len(plan), 1, 1, 1)).float()
                ablate.plan = None
                p = pred[start: start + b].repeat(len(plan))
                ablated = out.gather(1, p[:, None])[:, 0].reshape(len(plan), -1)
                lost = (base_logit[start: start + b][None] - ablated).double().cpu().numpy()
                hits = out.argmax(-1).reshape(len(plan), -1).cpu().numpy()
                for j, (l, h) in enumerate(plan):
                    drop[l, h] += lost[j].sum()
                    if labels is not None:
                        correct[l, h] += (hits[j] == labels[start: start + b]).sum()
                done += len(plan) * int(xb.shape[0])
                bar.update(done)
    base_acc = float((pred.cpu().numpy() == labels).mean()) if labels is not None else None
    return HeadImportanceResult(
        logit_drop=drop / n, accuracy_drop=None if base_acc is None else base_acc - correct / n,
        base_logit=float(base_logit.mean()), base_accuracy=base_acc, ablation=ablation, n_images=n, forwards=total,
        model_name=m.spec.name)
