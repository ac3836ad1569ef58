"""View 1, paper Fig. 7 (left): principal components of the patch-embedding filters.

The embedding E is a conv with kernel = stride = P and weight [D, C, P, P]; its D filters are
the samples of a PCA over the C*P*P pixel values. For a hybrid, E acts on CNN channels, so the
pixel-space analogue is the CNN's first convolution (R50's 7x7x3 stem); the result's ``source``
says which weight was used.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel
from ..results import Result


@dataclass(eq=False, repr=False)
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

    def summary(self) -> str:
        k = len(self.components)
        return (f"{self.model_name or 'model'}: top {k} of {self.n_filters} filters' components, "
                f"{100 * float(np.sum(self.explained_variance_ratio)):.1f}% of variance; {self.module}")

    def to_rows(self) -> list[dict]:
        """One row per component (1-based): its share of the filters' variance."""
        return [{"component": i + 1, "explained_variance_ratio": float(v)}
                for i, v in enumerate(self.explained_variance_ratio)]


#: held around the process-wide BLAS thread limit of ``embedding_filter_pca`` (see there)
_BLAS_LIMIT_LOCK = threading.Lock()


def pixel_filters(m: LoadedModel) -> tuple[torch.Tensor, str, str]:
    """(weight [D, C, kh, kw] in float64, module name, description) of the pixel-space filters,
    as the model's family finds them (the patch embedding, or a hybrid's first convolution)."""
    return m.family.pixel_filters(m.model, m.spec)


def embedding_filter_pca(m: LoadedModel, n_components: int = 28) -> FilterPCAResult:
    """PCA of the embedding filters (paper Fig. 7 left: the top 28 components of ViT-L/32).

    Args:
        m: the model.
        n_components: components to keep; at most min(number of filters, C*kh*kw).

    Returns:
        A ``FilterPCAResult``: the components [n_components, C, P, P] (unit-norm directions in filter
            space), their explained variance ratios, and ``source``, the convolution read.

    Raises:
        ViewNotAvailableError: a model whose patch embedding is not a convolution.
        InvalidParameterError: ``n_components`` outside 1 .. min(filters, C*kh*kw).
    """
    w, module, source = pixel_filters(m)
    d, c, kh, kw = w.shape
    limit = min(d, c * kh * kw)
    if not 1 <= n_components <= limit:
        raise InvalidParameterError(
            f"n_components must be between 1 and {limit} for {m.spec.name} ({d} filters of {c * kh * kw} values); "
            f"got {n_components}.")
    components, ratios = principal_components(w.reshape(d, -1).numpy(), n_components)
    return FilterPCAResult(
        components=components.reshape(n_components, c, kh, kw),
        explained_variance_ratio=ratios,
        source=source,
        module=module,
        n_filters=d,
        model_name=m.spec.name,
    )


def principal_components(x: np.ndarray, n_components: int) -> tuple[np.ndarray, np.ndarray]:
    """The top principal axes of the rows of ``x`` [n, f] (centred PCA; View 1's and the tubelet filters' rule).

    Returns:
        (components [n_components, f], unit-norm, sign arbitrary; their explained variance ratios [n_components]).
    """
    from sklearn.decomposition import PCA

    # the eigenvectors of the filters' covariance: the principal axes, cheaper than a full SVD of the
    # filters and equal to it to about 1e-10 (tests compare with numpy's SVD)
    # one BLAS thread: right after a torch forward, torch's OpenMP workers still spin, and a
    # multi-threaded eigh beside them is many times slower. threadpool_limits is process-wide (it
    # sets the BLAS libraries' thread count for every thread while it is held and puts back what it
    # found), so entries are serialised: two overlapping ones would put back each other's limit and
    # could leave the process at one thread
    from threadpoolctl import threadpool_limits

    with _BLAS_LIMIT_LOCK, threadpool_limits(limits=1, user_api="blas"):
        pca = PCA(n_components=n_components, svd_solver="covariance_eigh").fit(x)
    return pca.components_, pca.explained_variance_ratio_.astype(np.float64)


def max_filter_components(m: LoadedModel) -> int:
    """The most components ``embedding_filter_pca`` accepts for this model."""
    w, _, _ = pixel_filters(m)
    return int(min(w.shape[0], w[0].numel()))
