"""Where AttnLRP's relevance goes: a conservation ledger that closes to the target score.

AttnLRP (Achtibat et al., ICML 2024) conserves relevance layer by layer except where an additive constant or a
softmax takes its share (``lrp``'s module docstring). The ledger measures every such share separately, in
gradient x input form under the rules (``attnlrp_mode``), one image at a time:

- ``input``: sum over pixels of x * dR/dx, the relevance the map shows;
- ``position``: the position table's p * dR/dp (``pos_embed``, open_clip's ``positional_embedding``, ...);
- ``prefix``: the class / register / distillation tokens' p * dR/dp;
- ``biases``: every other bias parameter's b * dR/db (linear, convolution and norm biases), plus each
  eval-mode BatchNorm's shift (bias - running_mean * weight / sqrt(running_var + eps)) times its output's
  gradient (a hybrid's CNN stem);
- ``softmax``: each attention's sum(A * dR/dA) - sum(s * dR/ds), what the softmax rule's bias term absorbs
  (Prop. 3.1 at the scores s).

The five add up to the target score (``closure``): in float64 to rounding, which the tests check on a timm ViT,
a hybrid and an open_clip tower. The ledger is drawn up for AttnLRP's variants too (``method="attnlrp_gamma"`` or
``"cp_lrp"``): under the γ-rule a bias keeps its amplified share (its gradient says so), and under CP-LRP no
relevance reaches the scores, so the softmax entry is zero by construction. A share the ledger does not know (an
additive attention bias such as BEiT's relative-position table, a mask) shows as a closure gap rather than being
hidden in a remainder.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..engine.sites import HookPoint, SiteSession
from ..images import Images, iter_batches
from ..loading.model import LoadedModel
from ..results import Result, significant
from ..errors import InvalidParameterError
from .lrp import AttnLRPMaps, LRPRules, attnlrp_mode
from .lrp_rules import SOFTMAX_RECORD
from .methods import METHOD_TABLE

POSITION = ("pos_embed", "positional_embedding", "position_embedding", "position_embeddings", "pos_embedding")
PREFIX = ("cls_token", "class_token", "class_embedding", "reg_token", "register_tokens", "dist_token")
ENTRIES = ("input", "position", "prefix", "biases", "softmax")


def _entry_of(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in POSITION or name in POSITION:
        return "position"
    if leaf in PREFIX or name in PREFIX:
        return "prefix"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "biases"
    return None


@dataclass(eq=False, repr=False)
class ConservationLedger(Result):
    """AttnLRP's relevance of each image's target score, split by where it ends.

    Attributes:
        score: [B] the explained score (the target's logit, or feature of a feature model).
        input, position, prefix, biases, softmax: [B] each share (see the module docstring); they add up to score.
        targets: [B] the explained indices.
        dtype: the precision the ledger was computed in ("float64" by default).
        model_name: the model's name.
        method: the AttnLRP method whose relevance it splits ("attnlrp", "attnlrp_gamma", "cp_lrp").
        params: that method's parameters (``gamma``, ``conv_gamma``).
    """

    kind = "lrp_ledger"
    score: np.ndarray
    input: np.ndarray
    position: np.ndarray
    prefix: np.ndarray
    biases: np.ndarray
    softmax: np.ndarray
    targets: np.ndarray
    dtype: str = "float64"
    model_name: str = ""
    method: str = "attnlrp"
    params: dict = dataclasses.field(default_factory=dict)

    def total(self) -> np.ndarray:
        """[B] the five shares' sum."""
        return sum(getattr(self, e) for e in ENTRIES)

    def closure(self) -> np.ndarray:
        """[B] |total - score| / |score|: how far the ledger is from closing."""
        return np.abs(self.total() - self.score) / np.maximum(np.abs(self.score), np.finfo(np.float64).tiny)

    def pooled_shares(self) -> dict[str, float]:
        """Each entry's share of the summed score over all images (the issue's 'pixels hold 0.68 of the logit')."""
        total = float(self.score.sum())
        return {e: float(getattr(self, e).sum()) / total for e in ENTRIES}

    def summary(self) -> str:
        shares = ", ".join(f"{e} {significant(v)}" for e, v in self.pooled_shares().items())
        return (f"{self.model_name or 'model'}: {self.method} ledger over {len(self.score)} images, share of the "
                f"score: {shares}; closes to {significant(float(self.closure().max()))} relative ({self.dtype})")

    def entry_rows(self) -> list[dict]:
        """The small table the app and the report show: one row per entry (summed over images), its share of the
        summed score, then the score and the largest closure gap."""
        words = {"input": "input pixels", "position": "position table", "prefix": "prefix tokens",
                 "biases": "biases", "softmax": "softmax (absorbed)"}
        total = float(self.score.sum())
        rows = [{"entry": words[e], "relevance": float(getattr(self, e).sum()),
                 "share": float(getattr(self, e).sum()) / total} for e in ENTRIES]
        rows.append({"entry": "target score", "relevance": total, "share": 1.0})
        rows.append({"entry": f"closure (max relative gap, {self.dtype})", "relevance": float(self.closure().max()),
                     "share": float("nan")})
        return rows

    def shown_rows(self) -> list[dict]:
        """``entry_rows`` as the app and the report show them: every number as text with 3 significant digits,
        so a closure gap of 1e-16 reads "1e-16" (scientific notation), not "0.0000000000000001"; the closure's
        share (NaN) is blank."""
        return [{k: (("" if v != v else significant(v)) if isinstance(v, float) else v) for k, v in row.items()}
                for row in self.entry_rows()]

    def to_rows(self) -> list[dict]:
        """One row per image: the score, each entry, and the closure."""
        return [{"image": i, "target": int(self.targets[i]), "score": float(self.score[i]),
                 **{e: float(getattr(self, e)[i]) for e in ENTRIES}, "closure": float(self.closure()[i])}
                for i in range(len(self.score))]


def lrp_methods() -> tuple[str, ...]:
    """The ``METHOD_TABLE`` methods a ledger can be drawn up for: AttnLRP and its variants (their function is an
    ``AttnLRPMaps``), read from the table at call time.

    Returns:
        Their names, in table order.
    """
    return tuple(name for name, mt in METHOD_TABLE.items() if isinstance(mt.fn, AttnLRPMaps))


def attnlrp_ledger(m: LoadedModel, images: Images, target: int | Sequence[int] | None = None,
                   float64: bool = True, batch_size: int = 16, method: str = "attnlrp",
                   **params: Any) -> ConservationLedger:
    """The conservation ledger of AttnLRP's relevance for each image's target (see the module docstring).

    Args:
        m: the model (never modified: the ledger runs on a deep copy, in float64 unless ``float64=False``).
        images: the images (preprocessed with the model's data config).
        target: one class (or feature) for all, one per image, or None for each image's prediction.
        float64: compute in float64, where the ledger closes to rounding; False keeps the model's dtype.
        batch_size: images read per step (each image is explained on its own).
        method: an AttnLRP method of ``METHOD_TABLE``: "attnlrp", or one of its variants ("attnlrp_gamma",
            "cp_lrp").
        **params: that method's parameters (``gamma``, ``conv_gamma``; its table defaults otherwise).

    Returns:
        A ``ConservationLedger``: per image, the logit and each entry of the ledger (input pixels, position
            table, prefix tokens, biases, softmax absorption), whose sum closes to the logit.

    Raises:
        InvalidParameterError: for a method that is not an AttnLRP method, or a parameter it does not take.
    """
    if method not in lrp_methods():
        raise InvalidParameterError(f"the conservation ledger splits an LRP relevance: method must be one of "
                                    f"{', '.join(lrp_methods())}; got {method!r}.")
    entry = METHOD_TABLE[method]
    unknown = set(params) - set(entry.defaults)
    if unknown:
        raise InvalidParameterError(f"{method} takes {', '.join(entry.defaults) or 'no parameters'}; "
                                    f"got {', '.join(sorted(unknown))}.")
    method_params = {**entry.defaults, **params}
    fn = entry.fn
    if not isinstance(fn, AttnLRPMaps):  # lrp_methods lists the entries whose function is one
        raise InvalidParameterError(f"{method}'s function is not an AttnLRP one; the ledger splits only those.")
    rules = fn.rules(method_params)
    model = copy.deepcopy(m.model)
    if float64:
        model = model.double()
    cm = dataclasses.replace(m, model=model.eval())
    weights = dict(model.named_parameters())
    for p in weights.values():
        p.requires_grad_(True)
    norms = [mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm) and not mod.training]
    bn_params = {id(p) for mod in norms for p in (mod.weight, mod.bias) if p is not None}
    rows: dict[str, list[float]] = {k: [] for k in ("score", *ENTRIES, "target")}
    dtype = next(iter(weights.values())).dtype
    k = 0
    for x in iter_batches(images, m.data_config, batch_size):
        for xi in x.to(m.device, dtype):
            t = target if target is None or isinstance(target, (int, np.integer)) else target[k]
            k += 1
            rows_one = _one(cm, xi[None], t, weights, norms, bn_params, rules)
            for key, v in rows_one.items():
                rows[key].append(v)
    return ConservationLedger(**{key: np.asarray(v, dtype=np.int64 if key == "target" else np.float64)
                                 for key, v in rows.items() if key != "target"},
                              targets=np.asarray(rows["target"], dtype=np.int64),
                              dtype=str(dtype).replace("torch.", ""), model_name=m.spec.name, method=method,
                              params=method_params)


def _one(cm: LoadedModel, x: torch.Tensor, target: int | None, params: dict[str, nn.Parameter], norms: list,
         bn_params: set, rules: LRPRules) -> dict[str, float]:
    for p in params.values():
        p.grad = None
    outputs: list[tuple[nn.Module, torch.Tensor]] = []

    def keep(mod: nn.Module, _inp: tuple, out: torch.Tensor) -> torch.Tensor:
        out.retain_grad()
        outputs.append((mod, out))
        return out.clone()  # what follows (an in-place ReLU) works on the copy: out keeps its own gradient

    by_name = {f"norm.{i}.hook_out": mod for i, mod in enumerate(norms)}  # the frozen BatchNorms' outputs, as sites
    kept = SiteSession(cm.model, {name: HookPoint(mod) for name, mod in by_name.items()},
                       lambda name, out: keep(by_name[name], (), out))
    SOFTMAX_RECORD.pairs = []
    try:
        xi = x.detach().clone().requires_grad_(True)
        with kept, torch.enable_grad(), attnlrp_mode(cm, rules):
            out = cm.forward(xi)
            t = int(out.argmax(-1)[0]) if target is None else int(target)
            score = out[0, t]
            score.backward()
        pairs = SOFTMAX_RECORD.pairs
    finally:
        SOFTMAX_RECORD.pairs = None
    entries = {e: 0.0 for e in ENTRIES}
    if xi.grad is None:
        raise InvalidParameterError("the logit did not reach the input pixels, so the ledger has no input entry; "
                                    "pass a model whose output is differentiable in its input.")
    entries["input"] = float((xi.detach() * xi.grad).sum())
    for name, p in params.items():
        entry = _entry_of(name)
        if entry is not None and p.grad is not None and id(p) not in bn_params:
            entries[entry] += float((p.detach() * p.grad).sum())
    for mod, y in outputs:
        if y.grad is None:
            continue
        shift = (mod.bias if mod.bias is not None else 0.0) - mod.running_mean * (
            mod.weight if mod.weight is not None else 1.0) / torch.sqrt(mod.running_var + mod.eps)
        entries["biases"] += float((shift.detach().reshape(1, -1, *([1] * (y.dim() - 2))) * y.grad).sum())
    for s, a in pairs:
        if s.grad is None or a.grad is None:
            continue
        sv = s.detach()
        rs = torch.where(torch.isfinite(sv), sv * s.grad, torch.zeros_like(sv))
        entries["softmax"] += float((a.detach() * a.grad).sum() - rs.sum())
    return {"score": float(score.detach()), **entries, "target": t}
