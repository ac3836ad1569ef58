"""TextSpan (Gandelsman, Efros, Steinhardt, ICLR 2024) on a CLIP / SigLIP / OpenCLIP vision tower (docs/definitions.md,
"TextSpan"): each head's contribution vectors over a set of images described by the user's texts that best span
them, by greedy projection (``variant``: vitlens's normalised rule, or the authors' as their code runs it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result
from .head_vectors import head_vectors
from .stream import module_of, pixels_for
from .textbank import read_texts

#: a text whose remaining (projected) embedding is shorter than this share of its original length is spent
SPENT = 1e-9


def greedy_span(outputs: np.ndarray, texts: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """TextSpan's greedy projection (docs/definitions.md, "TextSpan").

    Args:
        outputs: [n, F] a head's contribution vectors over n images (centred here: the mean image is removed).
        texts: [K, F] the texts' embeddings.
        steps: texts to pick.

    Returns:
        ``(chosen [steps], explained [steps])``: the text picked at each step (-1 once every text is spent) and the
            share of the centred outputs' total variance its projected direction explains.
    """
    c = outputs - outputs.mean(0, keepdims=True)
    t = texts.astype(np.float64).copy()
    original = np.linalg.norm(t, axis=1)
    total = float((c ** 2).sum())
    chosen, explained = np.full(steps, -1), np.zeros(steps)
    for step in range(steps):
        length = np.linalg.norm(t, axis=1)
        alive = length > SPENT * np.maximum(original, np.finfo(np.float64).tiny)
        alive[chosen[chosen >= 0]] = False
        if not alive.any():
            break
        unit = np.where(alive[:, None], t / np.where(alive, length, 1.0)[:, None], 0.0)
        score = ((c @ unit.T) ** 2).sum(0)
        score[~alive] = -np.inf
        k = int(np.argmax(score))
        d = unit[k]
        chosen[step], explained[step] = k, score[k] / total if total > 0 else 0.0
        c = c - np.outer(c @ d, d)
        t = t - np.outer(t @ d, d)
    return chosen, explained


def authors_span(outputs: np.ndarray, texts: np.ndarray, steps: int, rank: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """TextSpan as the authors' code runs it (``compute_complete_text_set.py``, ``replace_with_iterative_removal``;
    docs/definitions.md, "TextSpan").

    The texts are first projected onto the span of the top-``rank`` right singular vectors of the head's uncentred
    outputs; each step then picks the text whose remaining (projected, not re-normalised) embedding ``t`` gives the
    largest spread of the centred outputs along it, ``std(C t)``, so a text's remaining length weighs in its score,
    and projects its direction out of the outputs and of every text.

    Args:
        outputs: [n, F] a head's contribution vectors over n images.
        texts: [K, F] the texts' embeddings.
        steps: texts to pick.
        rank: singular vectors kept (at most ``min(n, F)``).

    Returns:
        ``(chosen [steps], explained [steps])`` as ``greedy_span``'s: the share of the centred outputs' variance
            each pick's direction explains.
    """
    _, _, vh = np.linalg.svd(outputs.astype(np.float64), full_matrices=False)
    basis = vh[:rank]
    t = texts.astype(np.float64) @ basis.T @ basis
    c = outputs - outputs.mean(0, keepdims=True)
    original = np.linalg.norm(t, axis=1)
    total = float((c ** 2).sum())
    chosen, explained = np.full(steps, -1), np.zeros(steps)
    for step in range(steps):
        length = np.linalg.norm(t, axis=1)
        alive = (length > SPENT * np.maximum(original, np.finfo(np.float64).tiny)) & (original > 0)
        alive[chosen[chosen >= 0]] = False
        if not alive.any():
            break
        score = (c @ t.T).std(0)
        score[~alive] = -np.inf
        k = int(np.argmax(score))
        d = t[k] / length[k]
        chosen[step], explained[step] = k, float(((c @ d) ** 2).sum()) / total if total > 0 else 0.0
        c = c - np.outer(c @ d, d)
        t = t - np.outer(t @ d, d)
    return chosen, explained


#: TextSpan's variants (``text_span``'s ``variant``), with their rule
VARIANTS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "normalised": lambda outputs, texts, steps, rank: greedy_span(outputs, texts, steps),
    "authors": authors_span,
}


@dataclass(eq=False, repr=False)
class TextSpanResult(Result):
    """Each head's output directions described by texts.

    Attributes:
        layers: [L'] the blocks read (0-based).
        texts: the texts, in the order given.
        chosen: [L', H, m] the text picked at each step (-1: none left).
        explained: [L', H, m] the share of the head's centred variance each pick explains.
        variance: [L', H] the head's total variance over the images (sum over the embedding's dimensions).
        mean_norm: [L', H] the norm of the head's mean contribution (what centring removed).
        images: images read.
        model_name: the model's name.
        variant: the greedy rule (``text_span``'s ``variant``): "normalised" or "authors".
        rank: the authors' variant's singular vectors kept (0 for "normalised", which keeps every direction).
    """

    kind = "text_span"
    layers: np.ndarray
    texts: list
    chosen: np.ndarray
    explained: np.ndarray
    variance: np.ndarray
    mean_norm: np.ndarray
    images: int
    model_name: str = ""
    variant: str = "normalised"
    rank: int = 0

    def described(self, layer: int, head: int) -> list[tuple[str, float]]:
        """The texts picked for one head (layer as given in ``layers``, 0-based head) with the variance each
        explains."""
        i = int(np.flatnonzero(self.layers == layer)[0]) if (self.layers == layer).any() else -1
        if i < 0:
            raise InvalidParameterError(f"layer {layer} was not read; read were {self.layers.tolist()}.")
        return [(str(self.texts[k]), float(e)) for k, e in zip(self.chosen[i, head], self.explained[i, head]) if k >= 0]

    def summary(self) -> str:
        total = self.explained.sum(-1)
        i, h = np.unravel_index(int(np.argmax(total)), total.shape)
        words = ", ".join(t for t, _ in self.described(int(self.layers[i]), int(h))[:3])
        rule = f"{self.variant} rule" + (f", rank {self.rank}" if self.variant == "authors" else "")
        return (f"{self.model_name or 'model'}: TextSpan ({rule}) over {self.images} images, {len(self.texts)} texts, "
                f"layers "
                f"{[int(l) + 1 for l in self.layers]}; best spanned head layer {int(self.layers[i]) + 1} head {h + 1} "
                f"({total[i, h]:.0%} of its variance): {words}")

    def to_rows(self) -> list[dict]:
        """One row per (layer, head, step), 1-based layer, head and step."""
        rows = []
        for i, l in enumerate(self.layers):
            for h in range(self.chosen.shape[1]):
                cum = 0.0
                for s, (k, e) in enumerate(zip(self.chosen[i, h], self.explained[i, h])):
                    if k < 0:
                        break
                    cum += float(e)
                    rows.append({"layer": int(l) + 1, "head": h + 1, "step": s + 1, "text": str(self.texts[k]),
                                 "explained": float(e), "cumulative": cum})
        return rows


def arguments(model: object, pixels: object, texts: Sequence[str] | str | os.PathLike, steps: int, variant: str,
              rank: int, who: str) -> tuple[torch.nn.Module, str, torch.Tensor, list[str]]:
    """TextSpan's arguments checked at the boundary (``text_span``, ``evaluate_text_span``): ``(module, its name,
    the images [B, 3, H, W], the texts)``, or a refusal naming the argument."""
    module, name = module_of(model, who)
    if variant not in VARIANTS:
        raise InvalidParameterError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidParameterError(f"rank must be a whole number >= 1 (singular vectors kept); got {rank!r}.")
    x = pixels_for(model, module, pixels)
    if x.shape[0] < 2 or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidParameterError(f"{who} needs at least 2 images (outputs are centred over them) and a whole number "
                                    "of steps >= 1.")
    texts = read_texts(texts) if isinstance(texts, (str, os.PathLike)) else [str(t) for t in texts]
    return module, name, x, texts


def text_span(model: object, pixels: object, texts: Sequence[str] | str | os.PathLike,
              text_embeddings: np.ndarray | torch.Tensor | Callable[[list[str]], object],
              layers: Sequence[int] | None = None, steps: int = 5, variant: str = "normalised",
              rank: int = 80) -> TextSpanResult:
    """Describe each head's output directions by the texts that best span them (docs/definitions.md, "TextSpan").

    Args:
        model: a ``LoadedModel`` or the vision tower (Hugging Face CLIP with or without its projection, SigLIP,
            OpenCLIP).
        pixels: [B, 3, H, W] preprocessed images (B >= 2: the heads' outputs are centred over them).
        texts: the user's texts (class names, descriptions), or the path of a UTF-8 text file with one a line
            (``textbank.read_texts``: bounded in size, lines and length); ``textbank.text_bank()`` is the bank
            shipped with vitlens.
        text_embeddings: [K, F] their embeddings by the model's own text tower, in the image embedding's space, or a
            function that embeds a list of texts.
        layers: blocks read (0-based; negative counts from the end); default the last four.
        steps: texts picked per head.
        variant: the greedy rule (``VARIANTS``; docs/definitions.md, "TextSpan"): ``"normalised"`` (each pick the
            text whose unit direction explains the most remaining variance: the share it reports) or ``"authors"``
            (the authors' ``replace_with_iterative_removal``: texts first projected onto the top-``rank`` right
            singular vectors of the head's uncentred outputs, each pick by ``std(C t)`` with ``t`` not re-normalised).
        rank: the singular vectors the ``"authors"`` variant keeps (their default, 80).

    Returns:
        A ``TextSpanResult``.
    """
    module, name, x, texts = arguments(model, pixels, texts, steps, variant, rank, "text_span")
    emb = text_embeddings(texts) if callable(text_embeddings) else text_embeddings
    t = torch.as_tensor(np.asarray(emb.detach().cpu() if torch.is_tensor(emb) else emb), dtype=torch.float64)
    vectors, chosen_layers = head_vectors(module, x, layers)
    if t.dim() != 2 or t.shape != (len(texts), vectors.shape[-1]):
        raise InvalidParameterError(f"text_embeddings has shape {tuple(t.shape)}; give one row per text, in the "
                                    f"image embedding's {vectors.shape[-1]} dimensions: ({len(texts)}, "
                                    f"{vectors.shape[-1]}).")
    v = vectors.cpu().numpy()
    n_l, n_h = v.shape[1], v.shape[2]
    chosen = np.full((n_l, n_h, steps), -1)
    explained = np.zeros((n_l, n_h, steps))
    for i in range(n_l):
        for h in range(n_h):
            chosen[i, h], explained[i, h] = VARIANTS[variant](v[:, i, h], t.numpy(), steps, rank)
    centred = v - v.mean(0, keepdims=True)
    return TextSpanResult(layers=np.asarray(chosen_layers), texts=texts, chosen=chosen, explained=explained,
                          variance=(centred ** 2).sum((0, -1)), mean_norm=np.linalg.norm(v.mean(0), axis=-1),
                          images=int(x.shape[0]), model_name=name, variant=variant,
                          rank=rank if variant == "authors" else 0)
