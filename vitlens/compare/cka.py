"""Representation similarity between the layers of two models: minibatch linear CKA (Kornblith et al.
2019; minibatch form of Nguyen et al. 2021), as Raghu et al. (2021) compared ViTs with CNNs.

For each minibatch of n images and every pair of layers (a of model A, b of model B), with
linear-kernel Gram matrices K = X Xᵀ and L = Y Yᵀ of the layers' features:

- unbiased HSIC (default): HSIC₁(K, L) = [tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1 / ((n-1)(n-2)) - 2/(n-2)·1ᵀK̃L̃1] / (n(n-3)),
  K̃, L̃ the Gram matrices with zeroed diagonals (needs n >= 4);
- biased HSIC (option): tr(K H L H) / (n-1)², H the centring matrix; inflated at small n (two
  independent random representations score well above 0).

The HSIC terms are accumulated over minibatches in float64 and divided at the end,
CKA(a, b) = Σ HSIC(K_a, L_b) / sqrt(Σ HSIC(K_a, K_a) · Σ HSIC(L_b, L_b)) — never an average of
per-batch CKA values. A final batch of fewer than 4 images is merged into the one before. The
interval of each cell is a percentile bootstrap over minibatches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError
from ..engine.sites import HookPoint, SiteSession
from ..images import Images, count_images, iter_batches
from ..kinds import find_kind
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result
from ..words import counted, value_range
from ..views.registry import VIEWS

ESTIMATORS = ("unbiased", "biased")
TOKEN_POLICIES = ("cls", "mean", "patches")
MIN_BATCH = 4


def gram(x: torch.Tensor) -> torch.Tensor:
    """Linear-kernel Gram matrix of features [n, p] in float64."""
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    return x @ x.T


def hsic(k: torch.Tensor, l: torch.Tensor, estimator: str = "unbiased") -> torch.Tensor:
    """HSIC of two [n, n] Gram matrices (float64), unbiased (n >= 4) or biased.

    Args:
        k: [n, n] Gram matrix of the first representation.
        l: [n, n] Gram matrix of the second.
        estimator: "unbiased" (Song et al. 2012; needs n >= 4) or "biased".

    Returns:
        A float64 scalar tensor.

    Raises:
        InvalidParameterError: an unknown estimator, or n < 4 for the unbiased one.
    """
    n = k.shape[0]
    if estimator == "biased":
        h = torch.eye(n, dtype=k.dtype, device=k.device) - 1.0 / n
        return torch.trace(k @ h @ l @ h) / (n - 1) ** 2
    if n < MIN_BATCH:
        raise InvalidParameterError(f"The unbiased HSIC needs at least {MIN_BATCH} images per batch; got {n}.")
    kt = k - torch.diag(torch.diagonal(k))
    lt = l - torch.diag(torch.diagonal(l))
    ones = torch.ones(n, dtype=k.dtype, device=k.device)
    term = (kt * lt).sum() + (kt.sum() * lt.sum()) / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * (ones @ kt @ (lt @ ones))
    return term / (n * (n - 3))


class MinibatchCKA:
    """Accumulates the HSIC terms of every layer pair over minibatches (float64)."""

    def __init__(self, n_a: int, n_b: int, estimator: str = "unbiased") -> None:
        if estimator not in ESTIMATORS:
            raise InvalidParameterError(f"estimator must be one of {', '.join(ESTIMATORS)}; got {estimator!r}.")
        self.estimator = estimator
        self.xy: list[np.ndarray] = []  # per minibatch [n_a, n_b]
        self.xx: list[np.ndarray] = []  # per minibatch [n_a]
        self.yy: list[np.ndarray] = []  # per minibatch [n_b]
        self.n_images = 0
        self.shape = (n_a, n_b)

    def update(self, feats_a: Sequence[torch.Tensor], feats_b: Sequence[torch.Tensor]) -> None:
        """One minibatch: each layer's features [n, ...] of the same n images, for both models."""
        ka = [gram(f) for f in feats_a]
        lb = [gram(f) for f in feats_b]
        self.xy.append(np.array([[float(hsic(k, l, self.estimator)) for l in lb] for k in ka]))
        self.xx.append(np.array([float(hsic(k, k, self.estimator)) for k in ka]))
        self.yy.append(np.array([float(hsic(l, l, self.estimator)) for l in lb]))
        self.n_images += int(feats_a[0].shape[0])

    def value(self, batches: np.ndarray | None = None) -> np.ndarray:
        """CKA of every pair [n_a, n_b] over all minibatches (or the given minibatch indices)."""
        idx = np.arange(len(self.xy)) if batches is None else batches
        xy = np.sum([self.xy[i] for i in idx], axis=0)
        xx = np.sum([self.xx[i] for i in idx], axis=0)
        yy = np.sum([self.yy[i] for i in idx], axis=0)
        denom = np.sqrt(np.clip(np.outer(xx, yy), 0, None))
        return np.divide(xy, denom, out=np.full(self.shape, np.nan), where=denom > 0)

    def bootstrap(self, n_resamples: int = 200, level: float = 0.9, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Percentile interval of every cell from resampling the minibatches with replacement."""
        b = len(self.xy)
        if b < 2:
            nan = np.full(self.shape, np.nan)
            return nan, nan.copy()
        rng = np.random.default_rng(seed)
        draws = np.stack([self.value(rng.integers(0, b, size=b)) for _ in range(n_resamples)])
        tail = (1 - level) / 2
        return np.nanquantile(draws, tail, axis=0), np.nanquantile(draws, 1 - tail, axis=0)


@dataclass(eq=False, repr=False)
class CKAResult(Result):
    """Linear CKA between every layer of model A and every layer of model B over one image set.

    Attributes:
        matrix: [La, Lb] CKA (1 = the same representation up to rotation and scale).
        ci_low, ci_high: [La, Lb] bootstrap interval over minibatches (nan with one minibatch).
        layers_a, layers_b: the module names compared.
        estimator: "unbiased" or "biased" HSIC.
        token_policy: "cls" (class token), "mean" (mean of patch tokens) or "patches" (every patch
            token, both models' maps resampled to ``grid``).
        grid: the matched token grid for "patches" (else None).
        n_images, batch_size, n_batches: how the minibatches were formed.
        model_a, model_b: the models' names.
    """

    kind = "cka"
    matrix: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    layers_a: list[str]
    layers_b: list[str]
    estimator: str
    token_policy: str
    n_images: int
    batch_size: int
    n_batches: int
    grid: tuple[int, int] | None = None
    model_a: str = ""
    model_b: str = ""

    def summary(self) -> str:
        diag = np.diagonal(self.matrix) if self.matrix.shape[0] == self.matrix.shape[1] else None
        extra = f", diagonal {value_range(diag.min(), diag.max())}" if diag is not None else ""
        return (f"{self.model_a} x {self.model_b}: {self.matrix.shape[0]}x{self.matrix.shape[1]} layers, "
                f"{self.estimator} CKA of {self.token_policy} tokens over {counted(self.n_images, 'image')}{extra}"
                + self.negative_note())

    def negative_note(self) -> str:
        """Why a CKA below 0 can appear: the unbiased HSIC estimator (the default) is unbiased, not
        non-negative, so with few images per minibatch unrelated layers scatter around 0, below it too.
        Empty when no cell is below 0 (or the estimator is the biased one, which cannot go below 0)."""
        if self.estimator != "unbiased" or not np.nanmin(self.matrix) < 0:
            return ""
        return (f". Values below 0 come from the unbiased HSIC estimator: it is unbiased, not non-negative, so "
                f"with {counted(self.batch_size, 'image')} per minibatch unrelated layers scatter around 0; "
                "more images (and larger batches) narrow that scatter")

    def to_rows(self) -> list[dict]:
        """One row per layer pair (1-based indices, with the module names)."""
        return [{"layer_a": i + 1, "layer_b": j + 1, "module_a": self.layers_a[i], "module_b": self.layers_b[j],
                 "cka": float(self.matrix[i, j]), "ci_low": float(self.ci_low[i, j]),
                 "ci_high": float(self.ci_high[i, j])}
                for i in range(self.matrix.shape[0]) for j in range(self.matrix.shape[1])]


@dataclass
class _Side:
    """One model of the comparison: its module, layers, preprocessing and token layout."""

    module: nn.Module
    name: str
    layers: list[str]
    data_config: dict[str, Any]
    device: torch.device
    prefix: int = 0
    grid: tuple[int, int] | None = None
    autocast: Any = None
    forward: Any = None
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


def default_layers(m: LoadedModel) -> list[str]:
    """The blocks of a loaded ViT, first to last (the modules holding each attention module)."""
    return m.block_names()


def refuse_unread_blocks(spec: Any) -> None:
    """Refuse, in one line, CKA by block for a model whose blocks this comparison does not read (its kind's
    ``Kind.blocks_refusal``): CKA compares representations, each block's output tokens image by image, and says why
    this model's cannot be compared here; the app's hint names its own pages that show the model's attention (the
    registry's attention views defined for the model's kind, by the page that shows each).

    Raises:
        UnsupportedModelError: ``spec.kind`` is a kind with a ``blocks_refusal``.
    """
    kind = find_kind(spec)
    why = kind.blocks_refusal if kind is not None else ""
    if not why:
        return
    pages = list(dict.fromkeys(v.shown_in or v.label for v in VIEWS.values()
                               if v.kind == "attention" and spec.kind in v.kinds))
    raise UnsupportedModelError(
        f"CKA compares two models' representations, each block's output tokens image by image; {spec.name} is not "
        f"compared here: {why}.",
        fixes={"python": "Its attention views are exact: vl.attention_distance and vl.attention_rollout.",
               "app": f"Its attention is shown by this app's {' and '.join(pages)} views, and beside the other model "
                      "on the Attention distance tab here."})


def _side(model: LoadedModel | nn.Module, layers: Sequence[str] | None) -> _Side:
    if isinstance(model, LoadedModel):
        return _Side(model.model, model.spec.name, list(layers or default_layers(model)), model.data_config,
                     model.device, model.spec.num_prefix_tokens, model.spec.grid, model.autocast, model.forward)
    if not layers:
        raise InvalidParameterError(f"Name the layers of {type(model).__name__} to compare (layers_a/layers_b): "
                                    "vitlens knows the blocks of the ViTs it loads, not of other modules.")
    from timm.data import resolve_data_config

    device = next(model.parameters()).device
    return _Side(model.eval(), type(model).__name__, list(layers), dict(resolve_data_config({}, model=model)), device,
                 forward=model)


def _tokens(x: Any, side: _Side, policy: str, grid: tuple[int, int] | None) -> torch.Tensor:
    """A layer's output -> [n, features] under the token policy."""
    if isinstance(x, (tuple, list)):
        x = x[0]
    x = x.detach().float()
    if x.ndim == 3:  # [n, T, D] tokens
        if policy == "cls":
            if side.prefix < 1:
                raise InvalidParameterError(f"{side.name} has no class token; use token_policy='mean' or 'patches'.")
            return x[:, 0]
        patches = x[:, side.prefix:]
        if policy == "mean":
            return patches.mean(1)
        gh, gw = side.grid or (int(round(patches.shape[1] ** 0.5)),) * 2
        x = patches.reshape(x.shape[0], gh, gw, -1).permute(0, 3, 1, 2)
    elif x.ndim == 4:  # [n, C, H, W] feature maps
        if policy == "cls":
            raise InvalidParameterError(f"A feature map of {side.name} has no class token; use 'mean' or 'patches'.")
        if policy == "mean":
            return x.mean(dim=(2, 3))
    else:
        raise InvalidParameterError(f"A layer of {side.name} gave a {x.ndim}-D output; CKA takes tokens [n, T, D] "
                                    "or feature maps [n, C, H, W].")
    if grid is None:
        raise InvalidParameterError("token_policy='patches' needs the grid both models' feature maps are pooled to.")
    if tuple(x.shape[-2:]) != grid:  # the "patches" policy: both models on one grid
        x = F.adaptive_avg_pool2d(x, grid) if x.shape[-2] >= grid[0] and x.shape[-1] >= grid[1] else \
            F.interpolate(x, size=grid, mode="bilinear", align_corners=False)
    return x.flatten(1)


class OutputHooks(SiteSession):
    """Keep each named module's output of the latest forward in ``outputs`` (a context manager: the modules' outputs
    read as named sites, ``vitlens.engine.sites``)."""

    def __init__(self, modules: Sequence[nn.Module], names: Sequence[str], outputs: dict[str, torch.Tensor],
                 model: nn.Module | None = None) -> None:
        self.modules, self.names, self.outputs = list(modules), list(names), outputs
        # the model the modules belong to, whose lock the session holds
        super().__init__(model, {n: HookPoint(mod, whole=True) for mod, n in zip(self.modules, self.names)},
                         self.outputs.__setitem__)


def _features(side: _Side, x: torch.Tensor, policy: str, grid: tuple[int, int] | None) -> list[torch.Tensor]:
    modules = dict(side.module.named_modules())
    missing = [n for n in side.layers if n not in modules]
    if missing:
        raise InvalidParameterError(f"{side.name} has no module named {missing[0]!r}; see model.named_modules().")
    with OutputHooks([modules[n] for n in side.layers], side.layers, side.outputs, side.module), torch.no_grad():
        if side.autocast is not None:
            side.forward(x)
        else:
            side.module(x)
    feats = [_tokens(side.outputs[n], side, policy, grid) for n in side.layers]
    side.outputs.clear()
    return feats


def cka(
    model_a: LoadedModel | nn.Module,
    model_b: LoadedModel | nn.Module,
    images: Images,
    layers_a: Sequence[str] | None = None,
    layers_b: Sequence[str] | None = None,
    token_policy: str = "mean",
    estimator: str = "unbiased",
    batch_size: int = 32,
    grid: tuple[int, int] | None = None,
    n_bootstrap: int = 200,
    progress: ProgressArg = None,
) -> CKAResult:
    """Layer-by-layer linear CKA between two models on the same images (Raghu et al. 2021, Fig. 1).

    Args:
        model_a: a loaded ViT (its blocks are the default layers), or any ``nn.Module`` (e.g. a
            timm/torchvision ResNet) with ``layers_a`` naming its modules.
        model_b: the other model, as ``model_a``.
        images: the images; each model preprocesses them with its own data config.
        layers_a: module names of ``model_a`` (``named_modules``) whose outputs are compared.
        layers_b: the same for ``model_b``.
        token_policy: "mean" (mean of patch tokens; spatial mean of CNN maps), "cls" (class
            token) or "patches" (every patch token on a matched grid: ``grid``, default the
            smaller of the two models' token grids).
        estimator: "unbiased" (default) or "biased" HSIC.
        batch_size: images per minibatch (>= 4; a last batch below 4 joins the one before).
        grid: with ``token_policy="patches"``, the (gh, gw) grid both models' tokens are resampled to.
        n_bootstrap: bootstrap resamples of the minibatches for each cell's 90% interval.
        progress: True for a progress bar, or a callable ``f(done, total)``.

    Returns:
        A ``CKAResult``: ``cka`` [La, Lb] in [0, 1] (up to estimator noise), with each cell's bootstrap interval.

    Raises:
        InvalidParameterError: an unknown token policy or estimator, a layer name that is not a module,
            fewer than 4 images.
        UnsupportedModelError: a loaded model whose blocks this comparison does not read (a hierarchical model,
            a CaiT: ``refuse_unread_blocks``).
    """
    if token_policy not in TOKEN_POLICIES:
        raise InvalidParameterError(f"token_policy must be one of {', '.join(TOKEN_POLICIES)}; got {token_policy!r}.")
    if batch_size < MIN_BATCH:
        raise InvalidParameterError(f"batch_size must be at least {MIN_BATCH} for minibatch CKA; got {batch_size}.")
    for side in (model_a, model_b):  # a windowed model's blocks hand on [B, H, W, C] grids of its stages
        if isinstance(side, LoadedModel):
            refuse_unread_blocks(side.spec)
    a, b = _side(model_a, layers_a), _side(model_b, layers_b)
    if token_policy == "patches" and grid is None:
        grids = [g for g in (a.grid, b.grid) if g is not None]
        grid = min(grids, key=lambda g: g[0] * g[1]) if grids else (7, 7)
    # read once, for both models' batches (a tensor is sliced as it is)
    images = images if isinstance(images, torch.Tensor) else list(cast(Iterable[Any], images))
    acc = MinibatchCKA(len(a.layers), len(b.layers), estimator)
    pending: tuple[list, list] | None = None
    with Progress(progress, count_images(images), "CKA") as bar:
        done = 0
        for xa, xb in zip(iter_batches(images, a.data_config, batch_size), iter_batches(images, b.data_config,
                                                                                         batch_size)):
            fa = _features(a, xa.to(a.device), token_policy, grid)
            fb = _features(b, xb.to(b.device), token_policy, grid)
            if pending is not None:
                if fa[0].shape[0] < MIN_BATCH:  # too small on its own: it joins the batch before
                    fa = [torch.cat([p, f]) for p, f in zip(pending[0], fa)]
                    fb = [torch.cat([p, f]) for p, f in zip(pending[1], fb)]
                else:
                    acc.update(*pending)
            pending = (fa, fb)
            done += int(xa.shape[0])
            bar.update(done)
    if pending is None or pending[0][0].shape[0] < MIN_BATCH and not acc.xy:
        raise InvalidParameterError(f"CKA needs at least {MIN_BATCH} images; got {done}.")
    acc.update(*pending)
    low, high = acc.bootstrap(n_bootstrap)
    return CKAResult(matrix=acc.value(), ci_low=low, ci_high=high, layers_a=a.layers, layers_b=b.layers,
                     estimator=estimator, token_policy=token_policy, n_images=acc.n_images, batch_size=batch_size,
                     n_batches=len(acc.xy), grid=grid if token_policy == "patches" else None, model_a=a.name,
                     model_b=b.name)
