"""Mean-ablation (docs/definitions.md, "Mean-ablation"): chosen components (heads, MLPs, whole blocks) replaced by
their mean over a set of images, the effect on the target (a class logit and accuracy; a tower's zero-shot score and
accuracy) recorded. The components are named sites of the model's layout (``edits.ComponentSites``, as patching's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result
from .edits import ComponentSites, set_head
from .layout import Layout, prompts
from .arguments import index, per_image
from .stream import module_of, pixels_for

KINDS = ("head", "mlp", "layer")


@dataclass(eq=False, repr=False)
class MeanAblationResult(Result):
    """The target's score with the chosen components replaced by their mean over the reference images.

    Attributes:
        components: the components ablated together, as "head L.H", "mlp L", "layer L" (1-based).
        target: [B] the class (a tower: the prompt) followed: the label where given, else the unablated prediction.
        before: [B] the target's score unablated (a logit; a tower: cosine of image and prompt embeddings).
        after: [B] the same with the components mean-ablated.
        predicted_before: [B] the top class (prompt) unablated.
        predicted_after: [B] the top class (prompt) ablated.
        labels: [B] the true classes (-1 where none were given).
        score: "logit" or "cosine".
        reference_images: images the means were taken over.
        model_name: the model's name.
    """

    kind = "mean_ablation"
    components: list
    target: np.ndarray
    before: np.ndarray
    after: np.ndarray
    predicted_before: np.ndarray
    predicted_after: np.ndarray
    labels: np.ndarray
    score: str
    reference_images: int
    model_name: str = ""

    def accuracy(self) -> tuple[float, float]:
        """(before, after): the share of images whose top class is their label (NaN without labels)."""
        if (self.labels < 0).all():
            return float("nan"), float("nan")
        keep = self.labels >= 0
        return (float((self.predicted_before[keep] == self.labels[keep]).mean()),
                float((self.predicted_after[keep] == self.labels[keep]).mean()))

    def summary(self) -> str:
        acc = self.accuracy()
        tail = "" if np.isnan(acc[0]) else f"; accuracy {acc[0]:.0%} -> {acc[1]:.0%}"
        return (f"{self.model_name or 'model'}: mean-ablating {', '.join(self.components)} changes the target "
                f"{self.score} by {float(np.mean(self.after - self.before)):+.4g} on average over "
                f"{len(self.before)} images; top prediction kept on "
                f"{float(np.mean(self.predicted_before == self.predicted_after)):.0%}{tail}")

    def to_rows(self) -> list[dict]:
        """One row per image: target, score before and after, top predictions, label."""
        return [{"image": b, "target": int(self.target[b]), "before": float(self.before[b]),
                 "after": float(self.after[b]), "change": float(self.after[b] - self.before[b]),
                 "predicted_before": int(self.predicted_before[b]), "predicted_after": int(self.predicted_after[b]),
                 "label": int(self.labels[b])} for b in range(len(self.before))]


def _parse(components: Sequence[Sequence[Any]], n_layers: int, n_heads: int) -> list[tuple[str, int, int]]:
    out = []
    if isinstance(components, (str, bytes)) or not isinstance(components, Sequence):
        raise InvalidParameterError(f"components must be a list of ('head', layer, head), ('mlp', layer) or "
                                    f"('layer', layer); got {components!r}.")
    for c in components:
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
            raise InvalidParameterError(f"component {c!r}: give ('head', layer, head), ('mlp', layer) or "
                                        "('layer', layer), 0-based.")
        kind = str(c[0]) if len(c) else ""
        want = 3 if kind == "head" else 2
        if kind not in KINDS or len(c) != want:
            raise InvalidParameterError(f"component {tuple(c)!r}: give ('head', layer, head), ('mlp', layer) or "
                                        f"('layer', layer), 0-based.")
        l = index(c[1], f"component {tuple(c)!r}'s layer", n_layers)
        h = index(c[2], f"component {tuple(c)!r}'s head", n_heads) if kind == "head" else 0
        out.append((kind, l, h))
    return out


def _sites(layout: Layout, chosen: list[tuple[str, int, int]], means: dict | None, seen: dict) -> ComponentSites:
    """With ``means`` None: record each chosen component's value (a head: its slice of the heads; a layer: the
    block's change to the residual); else replace it by its mean."""
    def edit_for(h: int) -> Callable[[str, int, torch.Tensor], torch.Tensor]:
        def edit(kind: str, l: int, t: torch.Tensor) -> torch.Tensor:
            key = (kind, l, h)
            if means is None:
                dh = layout.sites[l].head_dim
                seen[key] = t[..., h * dh:(h + 1) * dh] if kind == "head" else t
                return t
            if kind == "head":
                dh = layout.sites[l].head_dim
                t = t.clone()
                set_head(t, h, dh, means[key].to(t.dtype))
                return t
            return means[key].expand_as(t).clone() if kind == "mlp" else means[key]
        return edit
    return ComponentSites(layout, [(k, l) for k, l, _ in chosen], [edit_for(h) for _, _, h in chosen])


def mean_ablate(model: object, pixels: object, components: Sequence[Sequence[Any]], labels: Sequence[int] | None = None,
                reference: object = None, direction: object = None) -> MeanAblationResult:
    """Replace the chosen components by their mean over the reference images and record the effect
    (docs/definitions.md, "Mean-ablation").

    Args:
        model: a ``LoadedModel`` or a module that ``vl.decompose`` reads (``layout.READ``).
        pixels: [B, 3, H, W] preprocessed images the effect is measured on (with a LoadedModel, anything
            ``vl.preprocess`` reads).
        components: ablated together: ``("head", layer, head)``, ``("mlp", layer)``, ``("layer", layer)``, 0-based.
        labels: the true classes (prompt indices for a tower), for accuracy; the target followed is the label, else
            the unablated prediction.
        reference: the images the means are taken over (default ``pixels``).
        direction: for a tower, [K, F] the prompts' text embeddings (zero-shot classes).

    Returns:
        A ``MeanAblationResult``.
    """
    module, name = module_of(model, "mean_ablate")
    layout = Layout(module, name)
    x = pixels_for(model, module, pixels)
    ref = x if reference is None else pixels_for(model, module, reference, "reference")
    chosen = _parse(components, len(layout.sites), layout.sites[0].heads)
    if not chosen:
        raise InvalidParameterError("components is empty: name at least one head, MLP or layer to ablate.")

    def scores(batch: torch.Tensor) -> torch.Tensor:
        if layout.classes:
            return layout.run(batch).double()
        emb = layout.run(batch).double()
        t = prompts(direction, emb.shape[-1], emb)
        return (emb / emb.norm(dim=-1, keepdim=True)) @ (t / t.norm(dim=-1, keepdim=True)).T

    seen: dict = {}
    with _sites(layout, chosen, None, seen), torch.no_grad():
        layout.run(ref)
    means = {key: v.mean(0, keepdim=True) for key, v in seen.items()}
    with torch.no_grad():
        before = scores(x)
        with _sites(layout, chosen, means, {}):
            after = scores(x)
    b = x.shape[0]
    if labels is not None and (isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence)
                               or len(labels) != b):
        raise InvalidParameterError(f"labels must be one class per image ({b}, in [0, {before.shape[-1]})).")
    lab = (torch.full((b,), -1, dtype=torch.long) if labels is None else
           per_image(list(labels), "labels", before.shape[-1], b))
    target = torch.where(lab >= 0, lab, before.argmax(-1).cpu()).to(before.device)
    pick = lambda s: s.gather(1, target[:, None])[:, 0].cpu().numpy()  # noqa: E731
    return MeanAblationResult(
        components=[f"{k} {l + 1}.{h + 1}" if k == "head" else f"{k} {l + 1}" for k, l, h in chosen],
        target=target.cpu().numpy(), before=pick(before), after=pick(after),
        predicted_before=before.argmax(-1).cpu().numpy(), predicted_after=after.argmax(-1).cpu().numpy(),
        labels=lab.numpy(), score="logit" if layout.classes else "cosine", reference_images=int(ref.shape[0]),
        model_name=name)
