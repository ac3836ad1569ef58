"""TextSpan's evaluation as the paper runs it (Gandelsman, Efros, Steinhardt, ICLR 2024, Sec. 4.2, Table 3; their
``compute_complete_text_set.py``; docs/definitions.md, "TextSpan"): per head the share of its variance the chosen
texts explain, and the zero-shot accuracy once the heads read are replaced, in the decomposition's sum, by their
projection onto the chosen texts (the mean image's output plus the centred outputs' projection on the texts' span),
the heads of the other layers mean-ablated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError
from ..results import Result
from . import hf_clip, openclip, towers
from .head_vectors import head_vectors, resolve_layers
from .textspan import VARIANTS, arguments


def span_basis(variant: str, outputs: np.ndarray, texts: np.ndarray, chosen: np.ndarray, rank: int) -> np.ndarray:
    """[F, k] an orthonormal basis of the directions a TextSpan variant projected out for the picks ``chosen``: the
    picked texts' span (``"authors"``: of the texts first restricted to the outputs' top-``rank`` right singular
    vectors, as that variant reads them)."""
    picked = chosen[chosen >= 0]
    if picked.size == 0:
        return np.zeros((texts.shape[1], 0))
    t = texts[picked].astype(np.float64)
    if variant == "authors":
        basis = np.linalg.svd(outputs, full_matrices=False)[2][:rank]
        t = t @ basis.T @ basis
    q, r = np.linalg.qr(t.T)
    keep = np.abs(np.diag(r)) > 1e-9 * max(float(np.abs(r).max()), np.finfo(np.float64).tiny)
    return q[:, keep]


def _features(module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """[B, F] the tower's image embedding, float64, from its own forward (the readers' capture)."""
    if hf_clip.is_clip_tower(module):
        return hf_clip.capture(module, pixels).features.double()
    if openclip.is_openclip_tower(module):
        return openclip.capture(module, pixels).features.double()
    return towers.read(module, pixels)[1].features.double()


@dataclass(eq=False, repr=False)
class TextSpanEvaluation(Result):
    """TextSpan's evaluation: how much of each head the chosen texts explain, and what the model still classifies
    with the heads replaced by them.

    Attributes:
        layers: [L'] the blocks whose heads were replaced (0-based).
        chosen: [L', H, m] the texts picked per head (-1: none left).
        explained: [L', H] the share of each head's centred variance the span of its texts explains.
        accuracy_model: the unmodified model's zero-shot accuracy.
        accuracy_ablated: with every head outside ``layers`` replaced by its mean over the images.
        accuracy_replaced: that, and every head in ``layers`` replaced by its mean plus its centred outputs'
            projection on its texts' span.
        labels_given: whether accuracies are against given labels (else against the model's own zero-shot
            predictions, so ``accuracy_model`` is 1).
        texts: the texts.
        variant: the TextSpan rule ("normalised" or "authors"); rank: the authors' variant's singular vectors.
        images: images read; classes: classes scored.
        model_name: the model's name.
    """

    kind = "text_span_evaluation"
    layers: np.ndarray
    chosen: np.ndarray
    explained: np.ndarray
    accuracy_model: float
    accuracy_ablated: float
    accuracy_replaced: float
    labels_given: bool
    texts: list
    variant: str
    rank: int
    images: int
    classes: int
    model_name: str = ""

    def summary(self) -> str:
        against = "labels" if self.labels_given else "the model's own predictions"
        return (f"{self.model_name or 'model'}: TextSpan ({self.variant}) with {self.chosen.shape[-1]} texts per head "
                f"explains {self.explained.mean():.0%} of a head's variance on average (layers "
                f"{[int(l) + 1 for l in self.layers]}); zero-shot accuracy against {against} over {self.images} "
                f"images: {self.accuracy_model:.1%} as is, {self.accuracy_ablated:.1%} with the other layers' heads "
                f"mean-ablated, {self.accuracy_replaced:.1%} with these heads replaced by their texts")

    def to_rows(self) -> list[dict]:
        """One row per (layer, head), 1-based: the variance its texts explain and the texts, with the accuracies."""
        return [{"layer": int(l) + 1, "head": h + 1, "explained": float(self.explained[i, h]),
                 "texts": " / ".join(str(self.texts[k]) for k in self.chosen[i, h] if k >= 0),
                 "accuracy_model": self.accuracy_model, "accuracy_ablated": self.accuracy_ablated,
                 "accuracy_replaced": self.accuracy_replaced}
                for i, l in enumerate(self.layers) for h in range(self.chosen.shape[1])]


def _matrix(value: object, what: str, rows: int | None, dim: int) -> np.ndarray:
    m = np.asarray(value.detach().cpu() if torch.is_tensor(value) else value, dtype=np.float64)
    if m.ndim != 2 or m.shape[1] != dim or (rows is not None and m.shape[0] != rows) or not np.isfinite(m).all():
        want = f"({rows}, {dim})" if rows is not None else f"(classes, {dim})"
        raise InvalidParameterError(f"{what} has shape {m.shape}; give finite rows in the image embedding's {dim} "
                                    f"dimensions: {want}.")
    return m


def evaluate_text_span(model: object, pixels: object, texts: Sequence[str] | str | os.PathLike,
                       text_embeddings: np.ndarray | torch.Tensor | Callable[[list[str]], object],
                       class_embeddings: np.ndarray | torch.Tensor, labels: Sequence[int] | None = None,
                       layers: Sequence[int] | None = None, steps: int = 5, variant: str = "normalised",
                       rank: int = 80) -> TextSpanEvaluation:
    """TextSpan's evaluation (docs/definitions.md, "TextSpan"): per head the variance its texts explain, and the
    zero-shot accuracy with the heads replaced by their projection onto their texts.

    Args:
        model: a ``LoadedModel`` or a CLIP, SigLIP or OpenCLIP vision tower.
        pixels: [B, 3, H, W] preprocessed images (B >= 2).
        texts: the texts (or a text file, one a line), as ``text_span`` takes them.
        text_embeddings: [K, F] their embeddings, or a function that embeds a list of texts.
        class_embeddings: [C, F] the classes' text embeddings (zero-shot classifier: the class of the largest
            ``f . e_c``).
        labels: [B] each image's class; default the unmodified model's zero-shot prediction (then the accuracies
            say how often the replaced model agrees with it).
        layers: blocks whose heads are replaced (default the last four); the others' heads are mean-ablated.
        steps: texts per head.
        variant: ``"normalised"`` or ``"authors"`` (``text_span``'s).
        rank: the authors' variant's singular vectors.

    Returns:
        A ``TextSpanEvaluation``.
    """
    module, name, x, texts = arguments(model, pixels, texts, steps, variant, rank, "evaluate_text_span")
    vectors, every = head_vectors(module, x, "all")  # [B, L, H, F]
    read = resolve_layers(len(every), layers)
    v = vectors.cpu().numpy()
    b, _, n_heads, dim = v.shape
    emb = _matrix(text_embeddings(texts) if callable(text_embeddings) else text_embeddings, "text_embeddings",
                  len(texts), dim)
    classes = _matrix(class_embeddings, "class_embeddings", None, dim)
    features = _features(module, x).cpu().numpy()
    rest = features - v.sum((1, 2))  # everything but the heads: MLPs, embeddings, biases
    truth = (features @ classes.T).argmax(-1) if labels is None else np.asarray(labels).reshape(-1)
    if truth.shape != (b,) or (labels is not None and (not np.issubdtype(truth.dtype, np.integer) or
                                                       truth.min() < 0 or truth.max() >= len(classes))):
        raise InvalidParameterError(f"labels must be {b} class indices in [0, {len(classes)}); got {labels!r}.")
    mean = v.mean(0, keepdims=True)
    ablated = np.where(np.isin(np.arange(len(every)), read)[None, :, None, None], v, mean)
    replaced = ablated.copy()
    chosen = np.full((len(read), n_heads, steps), -1)
    explained = np.zeros((len(read), n_heads))
    for i, l in enumerate(read):
        for h in range(n_heads):
            out = v[:, l, h]
            chosen[i, h], shares = VARIANTS[variant](out, emb, steps, rank)
            explained[i, h] = shares.sum()
            q = span_basis(variant, out, emb, chosen[i, h], rank)
            c = out - out.mean(0, keepdims=True)
            replaced[:, l, h] = out.mean(0, keepdims=True) + (c @ q) @ q.T

    def accuracy(heads: np.ndarray) -> float:
        return float((((rest + heads.sum((1, 2))) @ classes.T).argmax(-1) == truth).mean())
    return TextSpanEvaluation(layers=np.asarray(read), chosen=chosen, explained=explained,
                              accuracy_model=float(((features @ classes.T).argmax(-1) == truth).mean()),
                              accuracy_ablated=accuracy(ablated), accuracy_replaced=accuracy(replaced),
                              labels_given=labels is not None, texts=texts, variant=variant,
                              rank=rank if variant == "authors" else 0, images=int(b), classes=int(len(classes)),
                              model_name=name)


__all__ = ["TextSpanEvaluation", "evaluate_text_span", "span_basis"]
