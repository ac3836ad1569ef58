"""Token norms and high-norm artifact tokens (Darcet et al., ICLR 2024; docs/definitions.md, "Token norms").

The residual's norm per token at every depth (``blocks.{i}.hook_resid_post``, the site the prefix view reads), the
outlier rule of ``prefix_diagnostics`` (``high_norm_outliers``: a patch token whose norm exceeds ``OUTLIER_FACTOR``
times its image's median patch-token norm at that depth), the depth at which each
outlier first appears, and the attention (mean over heads) the class token, the patch tokens and the registers'
budget go to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..results import Result
from ..views.prefix import ABSOLUTE_THRESHOLD, OUTLIER_FACTOR, high_norm_outliers
from .layout import Layout, residual_stream
from .stream import module_of, pixels_for


@dataclass(eq=False, repr=False)
class TokenNormsResult(Result):
    """Token norms by depth and the high-norm outliers.

    Attributes:
        norms: [B, L + 1, N] the residual's L2 norm per token; depth 0 the embeddings, depth d block d's output.
        outliers: [B, L + 1, N] bool: a patch token whose norm exceeds ``factor`` x its image's median patch norm
            (``rule="relative"``), or ``threshold`` (``rule="absolute"``).
        first_depth: [B, N] the first depth at which a token is an outlier (-1: never).
        class_attention: [B, L] the attention (mean over heads) the class token pays, in block l, to the tokens
            that are outliers in that block's input (NaN without a class token).
        patch_attention: [B, L] the same, paid by the patch tokens (mean over patch queries).
        register_attention: [B, L] the class token's (else the patch tokens') attention to the registers (NaN
            without registers): where the mass goes instead.
        factor: the relative rule's multiple of the median.
        num_prefix_tokens: prefix tokens before the patches (class token first, then registers).
        num_registers: register tokens.
        model_name: the model's name.
        rule: the outlier rule, "relative" or "absolute" (``high_norm_outliers``).
        threshold: the absolute rule's norm (kept whichever rule ran).
    """

    kind = "token_norms"
    norms: np.ndarray
    outliers: np.ndarray
    first_depth: np.ndarray
    class_attention: np.ndarray
    patch_attention: np.ndarray
    register_attention: np.ndarray
    factor: float
    num_prefix_tokens: int
    num_registers: int
    model_name: str = ""
    rule: str = "relative"
    threshold: float = ABSOLUTE_THRESHOLD

    def rule_words(self) -> str:
        """The outlier rule in words ("norm > 4 x median patch norm", "norm > 150")."""
        return (f"norm > {self.factor:g} x median patch norm" if self.rule == "relative" else
                f"norm > {self.threshold:g}")

    def summary(self) -> str:
        count = self.outliers[:, -1].sum(-1).mean()
        seen = self.first_depth[self.first_depth >= 0]
        return (f"{self.model_name or 'model'}: {count:.1f} outlier tokens per image at the last depth "
                f"({self.rule_words()}); "
                f"{f'the first appear at depth {int(seen.min())}' if seen.size else 'none at any depth'}")

    def to_rows(self) -> list[dict]:
        """One row per (image, depth): median patch norm, max norm, outliers, attention paid to them."""
        rows = []
        p = self.num_prefix_tokens
        for b in range(self.norms.shape[0]):
            for d in range(self.norms.shape[1]):
                att = {name: float("nan") if d == 0 else float(getattr(self, name)[b, d - 1])  # no block reads depth 0
                       for name in ("class_attention", "patch_attention", "register_attention")}
                rows.append({"image": b, "depth": d, "median_patch_norm": float(np.median(self.norms[b, d, p:])),
                             "max_norm": float(self.norms[b, d].max()), "outliers": int(self.outliers[b, d].sum()),
                             **att})
        return rows


def token_norms(model: object, pixels: object, factor: float = OUTLIER_FACTOR, rule: str = "relative",
                threshold: float = ABSOLUTE_THRESHOLD) -> TokenNormsResult:
    """Residual norms per token and depth, the outliers and the attention they draw (docs/definitions.md,
    "Token norms").

    Args:
        model: a ``LoadedModel`` or a module that ``vl.decompose`` reads (``layout.READ``).
        pixels: [B, 3, H, W] preprocessed images (with a LoadedModel, anything ``vl.preprocess`` reads).
        factor: the relative rule's multiple of the median patch norm.
        rule: the artifact-token rule (docs/definitions.md, "Token norms"): ``"relative"`` (a token over ``factor`` x
            its image's median patch norm at that depth: vitlens's default, which carries across models whose norms
            differ in scale) or ``"absolute"`` (a token over ``threshold``: Darcet et al.'s rule).
        threshold: the absolute rule's norm (Darcet et al.'s 150 for DINOv2 ViT-g).

    Returns:
        A ``TokenNormsResult``.
    """
    module, name = module_of(model, "token_norms")
    high_norm_outliers(np.ones((1, 2)), 0, factor, rule, threshold)  # the rule's arguments refused before the forward
    layout = Layout(module, name)
    stream, _, probs = residual_stream(layout, pixels_for(model, module, pixels), with_probs=True)
    return _norms(stream, probs, layout.num_prefix, layout.has_class_token, layout.num_registers, factor, name, rule,
                  threshold)


def _norms(stream: list[torch.Tensor], probs: list[torch.Tensor], p: int, has_cls: bool, n_reg: int, factor: float,
           name: str, rule: str = "relative", threshold: float = ABSOLUTE_THRESHOLD) -> TokenNormsResult:
    """The norms, outliers and attention drawn from the residual at each depth and each block's probabilities."""
    norms = torch.stack([s.double().norm(dim=-1) for s in stream], 1)  # [B, L + 1, N]
    outliers = torch.from_numpy(high_norm_outliers(norms.cpu().numpy(), p, factor, rule, threshold)[1]).to(norms.device)
    hit = outliers.any(1)
    first = torch.where(hit, outliers.double().argmax(1), torch.full_like(hit, -1, dtype=torch.long))
    cls_att, patch_att, reg_att = [], [], []
    for l, full in enumerate(probs):
        att = full.mean(1)  # [B, N, N], mean over heads
        mask = outliers[:, l].double()  # outliers in the block's input
        to_out = (att * mask[:, None, :]).sum(-1)  # [B, N] per query
        nan = torch.full_like(to_out[:, 0], float("nan"))
        cls_att.append(to_out[:, 0] if has_cls else nan)
        patch_att.append(to_out[:, p:].mean(-1))
        start = 1 if has_cls else 0
        to_reg = att[..., start:start + n_reg].sum(-1)
        reg_att.append(nan if not n_reg else to_reg[:, 0] if has_cls else to_reg[:, p:].mean(-1))

    def arr(t: list[torch.Tensor]) -> np.ndarray:
        return torch.stack(t, 1).cpu().numpy()
    return TokenNormsResult(
        norms=norms.cpu().numpy(), outliers=outliers.cpu().numpy(), first_depth=first.cpu().numpy(),
        class_attention=arr(cls_att), patch_attention=arr(patch_att), register_attention=arr(reg_att),
        factor=float(factor), num_prefix_tokens=p, num_registers=n_reg, model_name=name, rule=rule,
        threshold=float(threshold))
