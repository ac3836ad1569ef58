"""Tokens that soak up attention: how much attention patch queries put on the class, distillation
and register tokens, per layer and head, and which tokens grow unusually large norms.

A head that parks most of its attention on a prefix token makes raw-weight attention distance
look local (the reason ``renormalize=True`` is the default, paper Fig. 7 right) and puts
mass in rollout that no patch earns (Fig. 6). Darcet et al. (2024, "Vision Transformers Need
Registers") found such sinks together with high-norm outlier tokens; the norms are measured on
each block's output tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..engine.sites import SiteSession, family_sites
from ..images import Images
from ..loading.model import LoadedModel
from ..core.spec import ModelSpec
from ..progress import ProgressArg
from ..results import Result
from ..engine.consumer import AttentionConsumer, query_rows
from ..engine.stream import model_name, stream_attention
from ..words import counted

#: a head "parks" its attention when patch queries put more than this share on one prefix token
PARKED = 0.5
#: a patch token is an outlier when its norm exceeds this multiple of its layer's median patch norm
OUTLIER_FACTOR = 4.0
#: the artifact-token rules (``high_norm_outliers``): a multiple of the image's median patch norm, or a fixed norm
OUTLIER_RULES = ("relative", "absolute")
#: the ``"absolute"`` rule's default threshold: Darcet et al.'s (ICLR 2024) for DINOv2 ViT-g
ABSOLUTE_THRESHOLD = 150.0


def prefix_labels(spec: ModelSpec) -> list[str]:
    """Names of the prefix tokens ("class", "distillation", "register 1", ...), as the family says."""
    if len(spec.prefix_labels) == spec.num_prefix_tokens:
        return list(spec.prefix_labels)
    return [f"prefix {i + 1}" for i in range(spec.num_prefix_tokens)]


def prefix_mass(attn: np.ndarray | torch.Tensor, num_prefix_tokens: int) -> np.ndarray | torch.Tensor:
    """Share of each patch query's attention on each prefix token, mean over the patch queries:
    [..., T, T] -> [..., P] in float64 (numpy in, numpy out; torch likewise)."""
    p = num_prefix_tokens
    return patch_queries_mass(attn[..., p:, :p])


def patch_queries_mass(rows: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """``prefix_mass`` of the patch queries' rows over the prefix keys [..., N, P] -> [..., P]."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.float64).mean(axis=-2)
    return rows.double().mean(dim=-2)


def parked_heads(mass: np.ndarray, labels: list[str], threshold: float = PARKED) -> list[dict]:
    """(layer, head, token, share) of every head whose patch queries put more than ``threshold``
    of their attention on one prefix token; ``mass`` is [L, H, P]; layer and head 1-based."""
    out: list[dict] = []
    if mass.size == 0:
        return out
    for l, h, t in zip(*np.nonzero(mass > threshold)):
        out.append({"layer": int(l) + 1, "head": int(h) + 1, "token": labels[t], "share": float(mass[l, h, t])})
    return out


class PrefixAttentionAccumulator(AttentionConsumer):
    """Mean share of each patch query's attention on each prefix token, per layer and head."""

    def __init__(self, num_layers: int, num_heads: int, num_prefix_tokens: int) -> None:
        self.num_prefix_tokens = num_prefix_tokens
        self.sums = np.zeros((num_layers, num_heads, num_prefix_tokens))
        self.counts = np.zeros(num_layers, dtype=np.int64)
        self._queries: dict[int, list[torch.Tensor]] = {}  # layer -> prefix mass of the queries seen so far

    @classmethod
    def for_model(cls, spec: ModelSpec) -> "PrefixAttentionAccumulator":
        return cls(spec.num_layers, spec.num_heads, spec.num_prefix_tokens)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_queries": {}}  # a layer in flight does not travel

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        """Whole maps or blocks of query rows; a layer is folded in at its last block."""
        start, stop, last = query_rows(attn, rows)
        p = self.num_prefix_tokens
        if p and max(start, p) < stop:
            # [B, H, patch queries, prefix keys] of this block, kept until the layer is complete: a copy,
            # since a view would keep the whole row block (every block of the layer: a whole map) alive
            self._queries.setdefault(layer, []).append(attn[:, :, max(start, p) - start:, :p].clone())
        if last:
            if p:
                # per image: mean over every patch query; summed over images
                self.sums[layer] += patch_queries_mass(torch.cat(self._queries.pop(layer), dim=2)).sum(0).cpu().numpy()
            self.counts[layer] += attn.shape[0]

    def merge(self, other: "PrefixAttentionAccumulator") -> "PrefixAttentionAccumulator":
        if self.sums.shape != other.sums.shape:
            raise InvalidParameterError("Only prefix accumulators of the same model merge.")
        out = PrefixAttentionAccumulator(*self.sums.shape)
        out.sums, out.counts = self.sums + other.sums, self.counts + other.counts
        return out

    def mass(self) -> np.ndarray:
        """[L, H, P] mean share of attention on each prefix token."""
        return self.sums / np.maximum(self.counts, 1)[:, None, None]

    def result(self, spec: ModelSpec | str) -> "PrefixDiagnosticsResult":
        return PrefixDiagnosticsResult(mass=self.mass(), n_images=int(self.counts.min()) if self.counts.size else 0,
                                       labels=prefix_labels(spec) if isinstance(spec, ModelSpec) else
                                       [f"prefix {i + 1}" for i in range(self.num_prefix_tokens)],
                                       model_name=model_name(spec))


def check_outlier_rule(rule: str, factor: float, threshold: float) -> None:
    """Refuse an unknown artifact-token rule, or its bound (the factor of ``"relative"``, the threshold of
    ``"absolute"``) when it is not a finite number > 0, in one line naming it."""
    if rule not in OUTLIER_RULES:
        raise InvalidParameterError(f"rule must be one of {', '.join(map(repr, OUTLIER_RULES))}; got {rule!r}.")
    bound, what = (factor, "factor") if rule == "relative" else (threshold, "threshold")
    if isinstance(bound, bool) or not isinstance(bound, (int, float, np.floating, np.integer)) or \
            not np.isfinite(bound) or bound <= 0:
        raise InvalidParameterError(f"the {rule} outlier rule's {what} must be a finite number > 0; got {bound!r}.")


def high_norm_outliers(norms: np.ndarray, num_prefix_tokens: int, factor: float = OUTLIER_FACTOR,
                       rule: str = "relative", threshold: float = ABSOLUTE_THRESHOLD
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The outlier rule of token norms (Darcet et al. 2024), the one reading ``prefix_diagnostics`` and
    ``vl.token_norms`` share (docs/definitions.md, "Token norms"): with ``rule="relative"`` a patch token is an
    outlier when its norm exceeds ``factor`` times its image's median patch-token norm (``np.median``: the two middle
    norms averaged when the count is even); with ``rule="absolute"`` when its norm exceeds ``threshold`` (Darcet et
    al.'s rule: 150 on DINOv2 ViT-g, a scale that belongs to one model's width and training). Prefix tokens never
    are.

    Args:
        norms: [..., T] each token's norm (prefix tokens first).
        num_prefix_tokens: prefix tokens before the patches.
        factor: the multiple of the median (``"relative"``).
        rule: ``"relative"`` or ``"absolute"`` (``OUTLIER_RULES``).
        threshold: the norm above which a token is an outlier (``"absolute"``).

    Returns:
        ``(median [..., 1], outliers [..., T] bool)``.
    """
    check_outlier_rule(rule, factor, threshold)
    patch = norms[..., num_prefix_tokens:]
    median = np.median(patch, axis=-1, keepdims=True)
    outliers = np.zeros(norms.shape, dtype=bool)
    outliers[..., num_prefix_tokens:] = patch > (factor * median if rule == "relative" else threshold)
    return median, outliers


class TokenNormAccumulator:
    """Per layer: mean norm of each prefix token, median patch-token norm, share of outlier patches."""

    def __init__(self, num_layers: int, num_prefix_tokens: int, outlier_factor: float = OUTLIER_FACTOR,
                 outlier_rule: str = "relative", outlier_threshold: float = ABSOLUTE_THRESHOLD) -> None:
        check_outlier_rule(outlier_rule, outlier_factor, outlier_threshold)
        self.p = num_prefix_tokens
        self.factor = outlier_factor
        self.rule, self.threshold = outlier_rule, outlier_threshold
        self.prefix_sum = np.zeros((num_layers, num_prefix_tokens))
        self.median_sum = np.zeros(num_layers)
        self.max_ratio = np.zeros(num_layers)
        self.outliers = np.zeros(num_layers)
        self.patches = np.zeros(num_layers)
        self.images = np.zeros(num_layers, dtype=np.int64)

    def add(self, layer: int, tokens: torch.Tensor) -> None:
        norms = tokens.detach().double().norm(dim=-1).cpu().numpy()  # [B, T]
        patch = norms[:, self.p:]
        median, outliers = high_norm_outliers(norms, self.p, self.factor, self.rule, self.threshold)
        self.prefix_sum[layer] += norms[:, :self.p].sum(0)
        self.median_sum[layer] += median.sum()
        self.max_ratio[layer] = max(self.max_ratio[layer], float((patch / median).max()))
        self.outliers[layer] += float(outliers.sum())
        self.patches[layer] += patch.size
        self.images[layer] += norms.shape[0]


@dataclass(eq=False, repr=False)
class PrefixDiagnosticsResult(Result):
    """Attention parked on prefix tokens and token norms, per layer.

    Attributes:
        mass: [L, H, P] mean over images and patch queries of the attention on each prefix token.
        labels: [P] names of the prefix tokens.
        n_images: images measured.
        prefix_norm: [L, P] mean norm of each prefix token at each block's output.
        patch_norm_median: [L] mean over images of the median patch-token norm.
        outlier_share: [L] share of patch tokens that are outliers by ``outlier_rule``: a norm over
            ``outlier_factor`` x their image's median ("relative"), or over ``outlier_threshold`` ("absolute").
        max_norm_ratio: [L] largest patch-token norm / median seen.
        outlier_factor: the relative rule's factor.
        outlier_rule: "relative" or "absolute" (``high_norm_outliers``).
        outlier_threshold: the absolute rule's threshold.
        model_name: the model's name.
    """

    kind = "prefix_diagnostics"
    mass: np.ndarray
    labels: list[str]
    n_images: int
    prefix_norm: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    patch_norm_median: np.ndarray = field(default_factory=lambda: np.zeros(0))
    outlier_share: np.ndarray = field(default_factory=lambda: np.zeros(0))
    max_norm_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0))
    outlier_factor: float = OUTLIER_FACTOR
    outlier_rule: str = "relative"
    outlier_threshold: float = ABSOLUTE_THRESHOLD
    model_name: str = ""

    def parked(self, threshold: float = PARKED) -> list[dict]:
        """Heads that put more than ``threshold`` of their patch queries' attention on one prefix token."""
        return parked_heads(self.mass, self.labels, threshold)

    def summary(self) -> str:
        total = self.mass.sum(-1) if self.mass.size else np.zeros((0, 0))
        most = f"{total.max():.2f}" if total.size else "0"
        return (f"{self.model_name or 'model'}: {counted(len(self.labels), 'prefix token')}, up to {most} of a "
                f"head's attention on them, {counted(len(self.parked()), 'parked head')} over "
                f"{counted(self.n_images, 'image')}")

    def to_rows(self) -> list[dict]:
        """One row per (layer, head, prefix token), 1-based layer and head."""
        return [{"layer": l + 1, "head": h + 1, "token": self.labels[t], "attention_share": float(self.mass[l, h, t])}
                for l in range(self.mass.shape[0]) for h in range(self.mass.shape[1])
                for t in range(self.mass.shape[2])]


class TokenNorms(SiteSession):
    """Every block's output (the named site ``blocks.{i}.hook_resid_post``) fed to a ``TokenNormAccumulator`` (a
    context manager)."""

    def __init__(self, m: LoadedModel, outlier_factor: float = OUTLIER_FACTOR, outlier_rule: str = "relative",
                 outlier_threshold: float = ABSOLUTE_THRESHOLD) -> None:
        self.acc = TokenNormAccumulator(m.spec.num_layers, m.spec.num_prefix_tokens, outlier_factor, outlier_rule,
                                        outlier_threshold)
        self.blocks = m.blocks()
        sites = family_sites(m)  # the blocks' outputs, as the family declares them; m.model: whose lock it holds
        super().__init__(m.model, {f"blocks.{i}.hook_resid_post": sites[f"blocks.{i}.hook_resid_post"]
                                   for i in range(len(self.blocks))}, self._on)

    def _on(self, name: str, tokens: object) -> None:
        if isinstance(tokens, torch.Tensor) and tokens.ndim == 3:
            self.acc.add(int(name.split(".")[1]), tokens)

    def fill(self, r: "PrefixDiagnosticsResult") -> "PrefixDiagnosticsResult":
        """Put the measured norms into ``r``."""
        acc = self.acc
        imgs = np.maximum(acc.images, 1)
        r.prefix_norm = acc.prefix_sum / imgs[:, None]
        r.patch_norm_median = acc.median_sum / imgs
        r.outlier_share = acc.outliers / np.maximum(acc.patches, 1)
        r.max_norm_ratio = acc.max_ratio.copy()
        r.outlier_factor, r.outlier_rule, r.outlier_threshold = acc.factor, acc.rule, acc.threshold
        return r


class PrefixDiagnostics(AttentionConsumer):
    """The prefix view as one consumer: attention parked on prefix tokens (``PrefixAttentionAccumulator``)
    and, through its ``hooks()``, the norms of every block's output tokens (``TokenNorms``)."""

    def __init__(self, m: LoadedModel, outlier_factor: float = OUTLIER_FACTOR, outlier_rule: str = "relative",
                 outlier_threshold: float = ABSOLUTE_THRESHOLD) -> None:
        self.norms = TokenNorms(m, outlier_factor, outlier_rule, outlier_threshold)
        self.attention = PrefixAttentionAccumulator.for_model(m.spec)

    def hooks(self) -> TokenNorms:
        return self.norms

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.attention.on_attention(layer, attn, rows)

    def result(self, spec: ModelSpec | str) -> "PrefixDiagnosticsResult":
        return self.norms.fill(self.attention.result(spec))


def prefix_diagnostics(m: LoadedModel, images: Images, batch_size: int = 32, progress: ProgressArg = None,
                       outlier_factor: float = OUTLIER_FACTOR, outlier_rule: str = "relative",
                       outlier_threshold: float = ABSOLUTE_THRESHOLD) -> PrefixDiagnosticsResult:
    """Attention mass on prefix tokens per layer and head, and token norms per layer (one pass).

    Darcet et al. 2024 ("Vision Transformers need registers"): how much attention patch queries park on the
    class, distillation and register tokens, and which tokens have outlier norms.

    Args:
        m: the model.
        images: tensor [B, 3, H, W], sequence of PIL images / paths / arrays, or iterable of tensors.
        batch_size: images per forward.
        progress: True for a progress bar, or a callable ``f(done, total)``.
        outlier_factor: with ``outlier_rule="relative"`` (the default), a patch token is a high-norm outlier above
            this multiple of its image's median patch norm at that layer.
        outlier_rule: ``"relative"`` or ``"absolute"`` (Darcet et al.'s fixed norm; docs/definitions.md, "Token
            norms").
        outlier_threshold: with ``outlier_rule="absolute"``, a patch token is an outlier above this norm.

    Returns:
        A ``PrefixDiagnosticsResult``: attention mass on each prefix token per layer and head (fractions
            in [0, 1]) and token norms per layer.
    """
    consumer = PrefixDiagnostics(m, outlier_factor, outlier_rule, outlier_threshold)
    stream_attention(m, images, [consumer], batch_size, progress, desc="prefix tokens", capture_mode=None)
    return consumer.result(m.spec)


__all__ = ["PrefixAttentionAccumulator", "PrefixDiagnostics", "PrefixDiagnosticsResult", "TokenNorms",
           "check_outlier_rule", "parked_heads", "prefix_diagnostics", "prefix_labels"]
