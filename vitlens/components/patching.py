"""Activation patching on a timm ViT or a CLIP / SigLIP / OpenCLIP vision tower (docs/definitions.md, "Activation
patching"): one component of a clean run put into the corrupted run, the target's logit (a tower: its embedding's
score against a prompt) recorded; many patches per forward (each row of a batch carries its own patch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError
from ..results import Result
from ..words import class_label, class_names_of
from .stream import module_of, pixels_for, refuse_unless_stream
from .prenorm import mha_qkv
from .tower_stream import Tower, is_tower, prompts

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
            ``nn.MultiheadAttention``: ``head_hook``).
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
        rows = []
        for l in range(self.attn.shape[0]):
            rows.append({"site": "attn", "layer": l + 1, "index": 0, "logit": float(self.attn[l])})
            rows.append({"site": "mlp", "layer": l + 1, "index": 0, "logit": float(self.mlp[l])})
            rows += [{"site": "head", "layer": l + 1, "index": h + 1, "logit": float(v)}
                     for h, v in enumerate(self.heads[l])]
            rows += [{"site": "resid", "layer": l + 1, "index": q, "logit": float(v)}
                     for q, v in enumerate(self.resid[l])]
        for row in rows:
            row["restored"] = float(self.restored(np.float64(row["logit"])))
        return rows


def sites_of(model: nn.Module) -> list[dict[str, Any]]:
    """Per block, the module at each site (``head``: the output projection, whose input is the heads concatenated;
    None where it is fused into the attention: then ``mha``, the ``nn.MultiheadAttention``) and the heads' width."""
    if is_tower(model):
        return [{"attn": s.attn, "mlp": s.mlp, "head": s.out_proj, "resid": s.block, "dh": s.head_dim, "mha": s.mha}
                for s in Tower(model).sites]
    return [{"attn": b.ls1, "mlp": b.ls2, "head": b.attn.proj, "resid": b, "dh": b.attn.head_dim}
            for b in model.blocks]


def _hooks(sites: list[dict[str, Any]], edit: Callable[[str, int, torch.Tensor], torch.Tensor]) -> list[Any]:
    """Hooks that pass each site's value (a head site: the output projection's input) through ``edit``; a tuple
    output keeps its other elements."""
    def out(site: str, l: int) -> Callable:
        def hook(m: nn.Module, a: tuple, o: Any) -> Any:
            if isinstance(o, tuple):
                return (edit(site, l, o[0]), *o[1:])
            return edit(site, l, o)
        return hook

    handles = []
    for l, mods in enumerate(sites):
        for site in ("attn", "mlp", "resid"):
            handles.append(mods[site].register_forward_hook(out(site, l)))
        handles.append(head_hook(mods, lambda t, l=l: edit("head", l, t)))
    return handles


def _mha_heads(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """[B, N, H * dh] float64: the heads of a self-attention ``nn.MultiheadAttention`` on ``x``, concatenated (what its
    fused call feeds its output projection), from its packed in-projection."""
    q, k, v = (t.reshape(*t.shape[:2], mha.num_heads, mha.head_dim).transpose(1, 2) for t in mha_qkv(mha, x))
    probs = ((q * mha.head_dim ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
    return (probs @ v).transpose(1, 2).flatten(2)


def head_hook(mods: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A hook passing the heads concatenated (the output projection's input) through ``fn``. Where the attention is
    an ``nn.MultiheadAttention`` (its projection inside one fused call), the heads are recomputed in float64 from its
    input and a change ``delta`` made by ``fn`` is added to its output as ``delta W_O^T`` (the projection is linear;
    rows ``fn`` leaves alone get exactly 0)."""
    if mods["head"] is not None:
        return mods["head"].register_forward_pre_hook(lambda m, a: (fn(a[0]), *a[1:]))
    mha = mods["mha"]

    def hook(m: nn.Module, a: tuple, o: Any) -> Any:
        heads = _mha_heads(mha, a[0])
        new = fn(heads)
        if new is heads:
            return None
        delta = (new - heads) @ mha.out_proj.weight.detach().double().T
        return (o[0] + delta.to(o[0].dtype), *o[1:])
    return mha.register_forward_hook(hook)


def _record(sites: list[dict[str, Any]], run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
            ) -> tuple[dict[tuple[str, int], torch.Tensor], torch.Tensor]:
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(site: str, l: int, t: torch.Tensor) -> torch.Tensor:
        seen[(site, l)] = t
        return t

    handles = _hooks(sites, keep)
    try:
        with torch.no_grad():
            scores = run(x)
    finally:
        for h in handles:
            h.remove()
    return seen, scores


def _patched(sites: list[dict[str, Any]], run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
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
                dh = sites[l]["dh"]
                t[i, :, idx * dh:(idx + 1) * dh] = src[:, idx * dh:(idx + 1) * dh]
        return t

    handles = _hooks(sites, put)
    try:
        with torch.no_grad():
            return run(batch)
    finally:
        for h in handles:
            h.remove()


def patch_activations(model: object, clean: object, corrupted: object, target: int | None = None,
                      batch_size: int = 64, direction: object = None) -> PatchingResult:
    """Patch each component of the clean run into the corrupted run, one at a time (docs/definitions.md,
    "Activation patching").

    Args:
        model: a ``LoadedModel``, a timm ``VisionTransformer`` or a CLIP / SigLIP / OpenCLIP vision tower.
        clean: one image [1, 3, H, W] (with a LoadedModel, anything ``vl.preprocess`` reads).
        corrupted: its corruption, the same shape.
        target: the class followed; default the clean run's prediction.
        batch_size: patches per forward.
        direction: for a CLIP, SigLIP or OpenCLIP vision tower: a [F] text embedding or chosen direction, or a
            [K, F] matrix of prompt embeddings (then ``target`` indexes the prompts); the score is ``u . embedding``.

    Returns:
        A ``PatchingResult``: the target's logit under every patch.
    """
    module, name = module_of(model, "patch_activations")
    if not is_tower(module):
        refuse_unless_stream(module, "patch_activations")
    xc, xk = pixels_for(model, module, clean), pixels_for(model, module, corrupted)
    if xc.shape[0] != 1 or xk.shape != xc.shape:
        raise InvalidParameterError(f"clean and corrupted must be one image each of the same shape; got "
                                    f"{tuple(xc.shape)} and {tuple(xk.shape)}.")
    if batch_size < 1:
        raise InvalidParameterError("batch_size must be at least 1.")
    run = _scorer(module, direction)
    sites = sites_of(module)
    seen, clean_logits = _record(sites, run, xc)
    with torch.no_grad():
        corrupted_logits = run(xk)
    k = int(clean_logits.argmax(-1)[0]) if target is None else int(target)
    if not 0 <= k < clean_logits.shape[-1]:
        raise InvalidParameterError(f"target must be a {'prompt' if direction is not None else 'class'} index in "
                                    f"[0, {clean_logits.shape[-1]}).")
    n_layers = len(sites)
    n_heads = Tower(module).sites[0].heads if is_tower(module) else module.blocks[0].attn.num_heads
    n_tokens = seen[("resid", 0)].shape[1]
    patches = [(s, l, i) for l in range(n_layers) for s, count in (("attn", 1), ("mlp", 1), ("head", n_heads),
                                                                    ("resid", n_tokens)) for i in range(count)]
    values: list[float] = []
    for start in range(0, len(patches), batch_size):
        values += _patched(sites, run, xk, patches[start:start + batch_size], seen)[:, k].double().tolist()
    got = dict(zip(patches, values))
    return PatchingResult(
        attn=np.array([got[("attn", l, 0)] for l in range(n_layers)]),
        mlp=np.array([got[("mlp", l, 0)] for l in range(n_layers)]),
        heads=np.array([[got[("head", l, h)] for h in range(n_heads)] for l in range(n_layers)]),
        resid=np.array([[got[("resid", l, q)] for q in range(n_tokens)] for l in range(n_layers)]),
        clean=float(clean_logits[0, k]), corrupted=float(corrupted_logits[0, k]), target=k,
        forwards=2 + -(-len(patches) // batch_size), model_name=name, label_names=class_names_of(model))


def _scorer(module: nn.Module, direction: object) -> Callable[[torch.Tensor], torch.Tensor]:
    """The scores a forward yields: a timm ViT's logits, or a tower's embedding against the prompt embeddings."""
    if not is_tower(module):
        if direction is not None:
            raise InvalidParameterError("direction= is for CLIP, SigLIP and OpenCLIP towers; a classifier follows a "
                                        "class (target=).")
        return module
    tower = Tower(module)
    held: dict[str, torch.Tensor] = {}

    def run(x: torch.Tensor) -> torch.Tensor:
        out = tower.run(x).double()
        if "t" not in held:
            held["t"] = prompts(direction, out.shape[-1], out)
        return out @ held["t"].T
    return run
