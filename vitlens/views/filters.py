"""View 1, paper Fig. 7 (left): principal components of the patch-embedding filters.

The embedding E is a conv with kernel = stride = P and weight [D, C, P, P]; its D filters are
the samples of a PCA over the C*P*P pixel values. For a hybrid, E acts on CNN channels, so the
pixel-space analogue is the CNN's first convolution (R50's 7x7x3 stem); the result's ``source``
says which weight was used.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..model import LoadedModel
from ..results import Result


@dataclass(eq=False)
class FilterPCAResult(Result):
    """Top principal components of the pixel-space embedding filters.

    Attributes:
        components: [k, C, kh, kw] unit-norm principal axes (sign arbitrary).
        explained_variance_ratio: [k] share of the filters' variance each component explains.
        source: which weight was analysed, in words (module path, shape, why).
        module: dotted module name of that weight.
        n_filters: number of filters (PCA samples).
        model_name: the model's name.
    """

    kind = "embedding_filter_pca"
    components: np.ndarray
    explained_variance_ratio: np.ndarray
    source: str
    module: str
    n_filters: int
    model_name: str = ""


def _effective_weight(conv: nn.Conv2d) -> torch.Tensor:
    """The weight a conv actually applies: weight-standardised for timm's StdConv2d(Same)."""
    w = conv.weight.detach().to(torch.float64).cpu()
    if type(conv).__name__ in ("StdConv2d", "StdConv2dSame"):
        flat = w.reshape(w.shape[0], -1)
        mean = flat.mean(dim=1, keepdim=True)
        var = flat.var(dim=1, unbiased=False, keepdim=True)
        w = ((flat - mean) / torch.sqrt(var + conv.eps)).reshape_as(w)
    return w


def pixel_filters(m: LoadedModel) -> tuple[torch.Tensor, str, str]:
    """(weight [D, C, kh, kw] in float64, module name, description) of the pixel-space filters."""
    pe = m.model.patch_embed
    if m.spec.kind == "vit":
        conv = pe.proj
        name = "patch_embed.proj"
        why = "the patch embedding E"
    else:
        found = next(((n, mod) for n, mod in pe.backbone.named_modules() if isinstance(mod, nn.Conv2d)), None)
        if found is None:
            raise ViewNotAvailableError(f"{m.spec.name}: the hybrid's CNN has no convolution to show.")
        name, conv = f"patch_embed.backbone.{found[0]}", found[1]
        why = ("the CNN's first convolution; the hybrid's own patch embedding acts on CNN channels, "
               "not pixels")
    if not isinstance(conv, nn.Conv2d):
        raise ViewNotAvailableError(f"{m.spec.name}: {name} is a {type(conv).__name__}, not a convolution.")
    w = _effective_weight(conv)
    d, c, kh, kw = w.shape
    std = " (weight-standardised, as the layer applies it)" if type(conv).__name__.startswith("StdConv") else ""
    return w, name, f"{name}: {d} filters of {kh}x{kw}x{c}, {why}{std}"


def embedding_filter_pca(m: LoadedModel, n_components: int = 28) -> FilterPCAResult:
    """PCA of the embedding filters (paper Fig. 7 left: the top 28 components of ViT-L/32).

    Args:
        m: the model.
        n_components: components to keep; at most min(number of filters, C*kh*kw).
    """
    from sklearn.decomposition import PCA

    w, module, source = pixel_filters(m)
    d, c, kh, kw = w.shape
    limit = min(d, c * kh * kw)
    if not 1 <= n_components <= limit:
        raise InvalidParameterError(
            f"n_components must be between 1 and {limit} for {m.spec.name} ({d} filters of {c * kh * kw} values); "
            f"got {n_components}.")
    x = w.reshape(d, -1).numpy()
    pca = PCA(n_components=n_components, svd_solver="full").fit(x)
    return FilterPCAResult(
        components=pca.components_.reshape(n_components, c, kh, kw),
        explained_variance_ratio=pca.explained_variance_ratio_.astype(np.float64),
        source=source,
        module=module,
        n_filters=d,
        model_name=m.spec.name,
    )


def max_filter_components(m: LoadedModel) -> int:
    """The most components ``embedding_filter_pca`` accepts for this model."""
    w, _, _ = pixel_filters(m)
    return int(min(w.shape[0], w[0].numel()))
