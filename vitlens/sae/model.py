"""The sparse autoencoder of a residual-stream site (docs/definitions.md, "Sparse autoencoder"): TopK (Gao et al.
2024, "Scaling and evaluating sparse autoencoders") by default, ReLU with an L1 penalty (Bricken et al. 2023,
"Towards Monosemanticity") as the named alternative.

A token's activation ``x`` [d_in] is written as ``x ~ b_dec + sum_f z_f W_dec[f]``: ``z = encode(x)`` is sparse and
non-negative, each decoder row ``W_dec[f]`` a unit direction of the site's space (a feature). The encoder reads
``x - b_dec``, so ``b_dec`` is the centre the features are measured from.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from ..errors import InvalidParameterError

#: the SAE kinds, by their activation: TopK keeps a token's k largest pre-activations, ReLU all positive ones
SAE_KINDS = ("topk", "relu")
#: which tokens of a site an SAE reads: the patch tokens, the prefix tokens (class, registers) or all of them
TOKEN_SETS = ("patches", "prefix", "all")


@dataclass
class SAEConfig:
    """What an SAE is and what it was trained on.

    Attributes:
        d_in: the site's width (the residual stream's dimension).
        n_features: the dictionary's size F.
        kind: "topk" (k active features per token) or "relu" (ReLU, sparsity from the L1 penalty ``l1``).
        k: active features per token of a TopK SAE (None for ReLU).
        l1: the L1 coefficient of a ReLU SAE's loss (0 for TopK).
        site: the named site it reads (``blocks.5.hook_resid_post``); "" when unknown (a file from another tool).
        tokens: which tokens it reads: "patches", "prefix" or "all" (``TOKEN_SETS``).
        model_name: the model it was trained on ("" when unknown).
        seed: the seed of its initialisation and of the training's order.
    """

    d_in: int
    n_features: int
    kind: str = "topk"
    k: int | None = 32
    l1: float = 0.0
    site: str = ""
    tokens: str = "patches"
    model_name: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SAEConfig":
        """A config from ``to_dict``'s data; unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise InvalidParameterError(f"SAE config has unknown keys {', '.join(map(repr, extra))}; it takes "
                                        f"{', '.join(sorted(known))}.")
        return cls(**d)


def check_config(c: SAEConfig) -> None:
    """Refuse a config that names no SAE, in one line that says which value and what is accepted."""
    for name in ("d_in", "n_features"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameterError(f"{name} must be a positive integer; got {value!r}.")
    if c.kind not in SAE_KINDS:
        raise InvalidParameterError(f"kind must be one of {', '.join(SAE_KINDS)}; got {c.kind!r}.")
    if c.kind == "topk":
        if isinstance(c.k, bool) or not isinstance(c.k, int) or not 1 <= c.k <= c.n_features:
            raise InvalidParameterError(f"k (active features per token of a TopK SAE) must be an integer from 1 to "
                                        f"n_features ({c.n_features}); got {c.k!r}.")
    if not isinstance(c.l1, (int, float)) or isinstance(c.l1, bool) or not c.l1 >= 0:
        raise InvalidParameterError(f"l1 must be a number >= 0; got {c.l1!r}.")
    if c.tokens not in TOKEN_SETS:
        raise InvalidParameterError(f"tokens must be one of {', '.join(TOKEN_SETS)}; got {c.tokens!r}.")


class SparseAutoencoder(nn.Module):
    """``x -> z = encode(x) -> decode(z) ~ x`` with a sparse non-negative code.

    Parameters: ``W_enc`` [d_in, F], ``b_enc`` [F], ``W_dec`` [F, d_in] (rows at unit norm: ``normalize_decoder``),
    ``b_dec`` [d_in].

    Args:
        config: the ``SAEConfig``.
    """

    def __init__(self, config: SAEConfig) -> None:
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(int(config.seed))
        d, f = config.d_in, config.n_features
        w = torch.randn(f, d, generator=g)
        w = w / w.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w)
        # the encoder starts as the decoder's transpose (Gao et al. 2024, sec. 2.4): each feature first reads the
        # direction it writes
        self.W_enc = nn.Parameter(w.t().clone())
        self.b_enc = nn.Parameter(torch.zeros(f))
        self.b_dec = nn.Parameter(torch.zeros(d))

    @property
    def n_features(self) -> int:
        return self.config.n_features

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """[N, F] the encoder's affine read of ``x`` [N, d_in] (before the activation)."""
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """[N, F] the code of pre-activations ``pre``: TopK keeps each row's k largest (after a ReLU, so never a
        negative one), ReLU keeps every positive one."""
        if self.config.kind == "relu":
            return torch.relu(pre)
        k = int(self.config.k or 1)
        values, idx = pre.topk(k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, idx, torch.relu(values))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, F] the sparse code of ``x`` [N, d_in]."""
        return self.activate(self.pre_acts(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """[N, d_in] the reconstruction from a code ``z`` [N, F]."""
        return z @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(recon, z)`` of ``x`` [N, d_in]."""
        z = self.encode(x)
        return self.decode(z), z

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Put every decoder row back at unit norm (Gao et al.'s and Bricken et al.'s constraint: a feature's size
        lives in its activation, so the L1 penalty and the activation statistics mean the same for every
        feature)."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))

    def extra_repr(self) -> str:
        c = self.config
        sparsity = f"k={c.k}" if c.kind == "topk" else f"l1={c.l1:g}"
        return f"{c.kind}, d_in={c.d_in}, n_features={c.n_features}, {sparsity}, site={c.site or '?'}"


__all__ = ["SAEConfig", "SAE_KINDS", "SparseAutoencoder", "TOKEN_SETS", "check_config"]
