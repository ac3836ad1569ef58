"""The survey's ``components`` statistic (issue 51; docs/definitions.md, "Direct contributions", "The ledger"):
each head's part of each image's predicted-class logit (``vl.decompose``), and the ledger's residual (output -
sum of parts), summed over the images in float64, so that shards merge by adding their sums.

The merge is exact up to float64 rounding: a merged mean differs from the mean over all images in one process only
by the order of the additions, at most ``n * eps * sum |x_i|`` per entry (n images, eps float64's). The largest
ledger (relative) merges by max, exactly.

It is not a consumer of the streaming engine: ``decompose`` runs its own forward in float64 with hooks on the
model's modules, which the attention capture of the same pass must not see, so the survey runs it as its own pass
over the shard's images (``SurveyView.compute``). A model the components refuse (a hierarchical model, a tower
without classes) keeps no such statistic.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..components import decompose
from ..errors import InvalidParameterError, UnsupportedModelError
from ..images import iter_batches
from ..loading.model import LoadedModel


class HeadContributions:
    """Sums over images of each head's part of the predicted-class logit, of its square, of each MLP's part, of
    the output and of the ledger's residual; the count; the largest relative ledger."""

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.n = np.zeros((), dtype=np.int64)
        self.heads = np.zeros((n_layers, n_heads))
        self.heads_sq = np.zeros((n_layers, n_heads))
        self.mlp = np.zeros(n_layers)
        self.output = np.zeros(())
        self.residual = np.zeros(())
        self.ledger_max = np.zeros(())

    def add(self, d: Any) -> "HeadContributions":
        """Add the images of one ``DecompositionResult``."""
        table = d.heads.sum(-1)  # [B, L, H]
        self.n = self.n + len(d.output)
        self.heads = self.heads + table.sum(0)
        self.heads_sq = self.heads_sq + (table ** 2).sum(0)
        self.mlp = self.mlp + d.mlp.sum(-1).sum(0)
        self.output = self.output + d.output.sum()
        self.residual = self.residual + (d.output - d.total()).sum()
        self.ledger_max = np.maximum(self.ledger_max, d.ledger().max())
        return self

    def mean(self) -> np.ndarray:
        """[L, H] each head's mean part over the images."""
        return self.heads / max(int(self.n), 1)

    def state(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k)) for k in ("n", "heads", "heads_sq", "mlp", "output", "residual",
                                                          "ledger_max")}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "HeadContributions":
        heads = np.asarray(state["heads"], dtype=np.float64)
        out = cls(*heads.shape)
        for k in ("n", "heads", "heads_sq", "mlp", "output", "residual", "ledger_max"):
            setattr(out, k, np.asarray(state[k], dtype=np.int64 if k == "n" else np.float64))
        return out

    def merge(self, other: "HeadContributions") -> "HeadContributions":
        if self.heads.shape != other.heads.shape:
            raise InvalidParameterError(f"Head contributions of {self.heads.shape} and {other.heads.shape} heads "
                                        "do not merge: the shards come from different models.")
        out = HeadContributions(*self.heads.shape)
        for k in ("n", "heads", "heads_sq", "mlp", "output", "residual"):
            setattr(out, k, getattr(self, k) + getattr(other, k))
        out.ledger_max = np.maximum(self.ledger_max, other.ledger_max)
        return out

    def table_rows(self, spec: dict[str, Any], classes: list[str], renormalize: bool = True) -> list[dict[str, Any]]:
        """Per head its mean part and the standard deviation over images; per layer its MLP's mean part; the mean
        output, the mean ledger residual and the largest relative ledger."""
        n = int(self.n)
        if not n:
            return []
        mean = self.mean()
        var = np.maximum(self.heads_sq / n - mean ** 2, 0.0)
        rows = [dict(metric=metric, value=float(v[l, h]), n=n, layer=l + 1, head=h + 1)
                for metric, v in (("head_contribution", mean), ("head_contribution_std", np.sqrt(var)))
                for l in range(mean.shape[0]) for h in range(mean.shape[1])]
        rows += [dict(metric="mlp_contribution", value=float(self.mlp[l] / n), n=n, layer=l + 1)
                 for l in range(len(self.mlp))]
        return rows + [dict(metric="contributions_output", value=float(self.output / n), n=n),
                       dict(metric="ledger_residual", value=float(self.residual / n), n=n),
                       dict(metric="ledger_max", value=float(self.ledger_max), n=n)]


def head_contributions(m: LoadedModel, images: list, batch_size: int,
                       renormalize: bool = True) -> HeadContributions | None:
    """The statistic over ``images`` (each image's predicted class), a batch at a time; None where the components
    refuse the model. ``renormalize`` (the survey's setting, ``SurveyView.compute``) does not apply: the parts of
    the logit read no attention weights.

    Args:
        m: the model.
        images: the shard's images (anything ``vl.preprocess`` reads).
        batch_size: images per forward.
        renormalize: unused (see above).

    Returns:
        The summed state, or None.
    """
    if m.spec.num_classes <= 0:  # no class to read (a feature model, a CLIP tower): nothing kept
        return None
    kept: HeadContributions | None = None
    for x in iter_batches(images, m.data_config, batch_size):
        try:
            d = decompose(m, x)
        except UnsupportedModelError:
            return None
        kept = (kept or HeadContributions(*d.heads.shape[1:3])).add(d)
    return kept
