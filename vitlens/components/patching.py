"""Activation patching on every model the component analyses read (``layout``; docs/definitions.md, "Activation
patching"): one component of a clean run put into the corrupted run, the target's logit (a tower without classes: its
embedding's score against a prompt) recorded; many patches per forward (each row of a batch carries its own patch).
The components are named sites (``edits.ComponentSites``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..results import Result
from .edits import ComponentSites
from .layout import Layout
from .arguments import index
from .stream import module_of, pixels_for
from ..words import class_label, class_names_of

#: what can be patched: a block's attention branch, its MLP branch, one head (at the output projection's input),
#: one token of the residual leaving a block
SITES = ("attn", "mlp", "head", "resid")


@dataclass(eq=False, repr=False)
class PatchingResult(Result):
    """The target's logit with each component patched from the clean run into the corrupted one.

    Attributes:
        attn: [L] with block l's attention branch patched.
        mlp: [L] with block l's MLP branch patched.
        heads: [L, H] with one head's output (before the output projection) patched (OpenCLIP's
            ``nn.MultiheadAttention``: ``edits``).
        resid: [L, N] with one token of block l's output patched.
        clean: the clean run's logit.
        corrupted: the corrupted run's logit.
        target: the class followed.
        forwards: batched forwards spent (the two plain runs included).
        model_name: the model's name.
        label_names: the model's class names ([] where unknown): what the summary and figures call the class.
    """

    kind = "activation_patching"
    attn: np.ndarray
    mlp: np.ndarray
    heads: np.ndarray
    resid: np.ndarray
    clean: float
    corrupted: float
    target: int
    forwards: int
    model_name: str = ""
    label_names: list = field(default_factory=list)

    def target_name(self) -> str:
        """The class followed in words ("ring", or "class 4" without names)."""
        return class_label(self.label_names, int(self.target))

    def restored(self, values: np.ndarray) -> np.ndarray:
        """(patched - corrupted) / (clean - corrupted): the share of the clean logit a patch restores."""
        gap = self.clean - self.corrupted
        return (values - self.corrupted) / (gap if gap != 0 else np.nan)

    def summary(self) -> str:
        share = np.nan_to_num(self.restored(self.heads), nan=-np.inf)
        l, h = np.unravel_index(int(np.argmax(share)), share.shape)
        return (f"{self.model_name or 'model'}: {self.target_name()} logit clean {self.clean:.4g}, corrupted "
                f"{self.corrupted:.4g}; best head layer {l + 1} head {h + 1} (restores "
                f"{self.restored(self.heads[l, h]):.2f}) in {self.forwards} forwards")

    def to_rows(self) -> list[dict]:
        """One row per patch: site, layer, head or token (1-based layer and head), logit, share restored."""
        rows: list[dict[str, Any]] = []
        for l in range(self.attn.shape[0]):
            rows.append({"site": "attn", "layer": l + 1, "index": 0, "logit": float(self.attn[l])})
            rows.append({"site": "mlp", "layer": l + 1, "index": 0, "logit": float(self.mlp[l])})
            rows += [{"site": "head", "layer": l + 1, "index": h + 1, "logit": float(v)}
                     for h, v in enumerate(self.heads[l])]
            rows += [{"site": "resid", "layer": l + 1, "index": q, "logit": float(v)}
                     for q, v in enumerate(self.resid[l])]
        for row in rows:
            row["restored"] = float(self.restored(np.asarray(row["logit"], dtype=np.float64)))
        return rows


def _record(layout: Layout, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
            ) -> tuple[dict[tuple[str, int], torch.Tensor], torch.Tensor]:
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(site: str, l: int, t: torch.Tensor) -> torch.Tensor:
        seen[(site, l)] = t
        return t

    with ComponentSites(layout, _chosen(layout), keep), torch.no_grad():
        scores = run(x)
    return seen, scores


def _chosen(layout: Layout) -> list[tuple[str, int]]:
    return [(site, l) for l in range(len(layout.sites)) for site in ("attn", "mlp", "resid", "head")]


def _patched(layout: Layout, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             patches: list[tuple[str, int, int]], clean: dict[tuple[str, int], torch.Tensor]) -> torch.Tensor:
    """One forward of len(patches) copies of the corrupted image, row i with patches[i] put from ``clean``."""
    batch = x.expand(len(patches), *x.shape[1:])
    rows: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for i, (site, l, idx) in enumerate(patches):
        rows.setdefault((site, l), []).append((i, idx))

    def put(site: str, l: int, t: torch.Tensor) -> torch.Tensor:
        if (site, l) not in rows:
            return t
        t = t.clone()
        src = clean[(site, l)][0]
        for i, idx in rows[(site, l)]:
            if site in ("attn", "mlp"):
                t[i] = src
            elif site == "resid":
                t[i, idx] = src[idx]
            else:
                dh = layout.sites[l].head_dim
                t[i, :, idx * dh:(idx + 1) * dh] = src[:, idx * dh:(idx + 1) * dh]
        return t

    with ComponentSites(layout, _chosen(layout), put), torch.no_grad():
        return run(batch)


def patch_activations(model: object, clean: object, corrupted: object, target: int | None = None,
                      batch_size: int = 64, direction: object = None) -> PatchingResult:
    """Patch each component of the clean run into the corrupted run, one at a time (docs/definitions.md,
    "Activation patching").

    Args:
        model: a ``LoadedModel`` or a module that ``vl.decompose`` reads (``layout.READ``).
        clean: one image [1, 3, H, W] (with a LoadedModel, anything ``vl.preprocess`` reads).
        corrupted: its corruption, the same shape.
        target: the class followed; default the clean run's prediction.
        batch_size: patches per forward.
        direction: for a model without classes (a CLIP, SigLIP or OpenCLIP vision tower, ``ViTModel``,
            ``Dinov2Model``): a [F] text embedding or chosen direction, or a [K, F] matrix of prompt embeddings (then
            ``target`` indexes the prompts); the score is ``u . embedding``.

    Returns:
        A ``PatchingResult``: the target's logit under every patch.
    """
    module, name = module_of(model, "patch_activations")
    layout = Layout(module, name)
    xc, xk = pixels_for(model, module, clean, "clean"), pixels_for(model, module, corrupted, "corrupted")
    if xc.shape[0] != 1 or xk.shape != xc.shape:
        raise InvalidParameterError(f"clean and corrupted must be one image each of the same shape; got "
                                    f"{tuple(xc.shape)} and {tuple(xk.shape)}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidParameterError(f"batch_size must be a whole number >= 1; got {batch_size!r}.")
    run = layout.scorer(direction)
    seen, clean_logits = _record(layout, run, xc)
    with torch.no_grad():
        corrupted_logits = run(xk)
    k = int(clean_logits.argmax(-1)[0]) if target is None else \
        index(target, f"target (a {'prompt' if direction is not None else 'class'})", clean_logits.shape[-1])
    n_layers = len(layout.sites)
    n_heads = layout.sites[0].heads
    n_tokens = seen[("resid", 0)].shape[1]
    patches = [(s, l, i) for l in range(n_layers) for s, count in (("attn", 1), ("mlp", 1), ("head", n_heads),
                                                                    ("resid", n_tokens)) for i in range(count)]
    values: list[float] = []
    for start in range(0, len(patches), batch_size):
        values += _patched(layout, run, xk, patches[start:start + batch_size], seen)[:, k].double().tolist()
    got = dict(zip(patches, values))
    return PatchingResult(
        attn=np.array([got[("attn", l, 0)] for l in range(n_layers)]),
        mlp=np.array([got[("mlp", l, 0)] for l in range(n_layers)]),
        heads=np.array([[got[("head", l, h)] for h in range(n_heads)] for l in range(n_layers)]),
        resid=np.array([[got[("resid", l, q)] for q in range(n_tokens)] for l in range(n_layers)]),
        clean=float(clean_logits[0, k]), corrupted=float(corrupted_logits[0, k]), target=k,
        forwards=2 + -(-len(patches) // batch_size), model_name=name, label_names=class_names_of(model))
