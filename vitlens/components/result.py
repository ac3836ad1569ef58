"""``DecompositionResult``: the output as a sum of parts, with its ledger (docs/definitions.md, "Direct
contributions")."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..results import Result

#: the ledger's bound: |output - sum of parts| / scale, in float64 (docs/definitions.md, "The ledger")
LEDGER_RTOL = 1e-5


@dataclass(eq=False, repr=False)
class DecompositionResult(Result):
    """The read output of each image as an exact sum of parts (float64), and the ledger that closes it.

    Attributes:
        output: [B] the output read (a class logit, or a direction . pre-logits features), from the forward.
        target: [B] the class read, or -1 where a direction was read.
        heads: [B, L, H, N] each head's part per source token j: sum_q g_q . a_h(q, j) W_O^h V^h x_j.
        attn_bias: [B, L] each block's attention output-projection bias, read.
        mlp: [B, L, N] each block's MLP output at each token, read.
        embed_patch: [B, N] the patch embedding at each token (zero at prefix tokens).
        embed_position: [B, N] the position embedding at each token.
        embed_prefix: [B, N] the class and register tokens' learned values.
        pre_norm_bias: [B] a pre-blocks norm's beta, read (0 without one).
        readout_bias: [B] the final norms' betas read through, plus the head's bias for a class (and a MAP head's
            projection and value biases and position embedding).
        pool_mlp: [B] a MAP head's MLP output, read (0 without one).
        num_prefix_tokens: prefix tokens before the patches.
        grid: (rows, cols) of patch tokens.
        model_name: the model's name.
        direction: "class" or "direction".
        norm_convention: how the final norm is shared among the parts (``decompose``'s ``norm_convention``:
            "per_part", or "clip_text_span", where ``output`` is ``u . f / |f|``).
    """

    kind = "decomposition"
    output: np.ndarray
    target: np.ndarray
    heads: np.ndarray
    attn_bias: np.ndarray
    mlp: np.ndarray
    embed_patch: np.ndarray
    embed_position: np.ndarray
    embed_prefix: np.ndarray
    pre_norm_bias: np.ndarray
    readout_bias: np.ndarray
    pool_mlp: np.ndarray
    num_prefix_tokens: int
    grid: tuple
    model_name: str = ""
    direction: str = "class"
    norm_convention: str = "per_part"

    def parts(self) -> dict[str, np.ndarray]:
        """Each part summed over tokens, [B] or [B, L] or [B, L, H]: the ledger's entries."""
        return {"heads": self.heads.sum(-1), "attn_bias": self.attn_bias, "mlp": self.mlp.sum(-1),
                "embed_patch": self.embed_patch.sum(-1), "embed_position": self.embed_position.sum(-1),
                "embed_prefix": self.embed_prefix.sum(-1), "pre_norm_bias": self.pre_norm_bias,
                "readout_bias": self.readout_bias, "pool_mlp": self.pool_mlp}

    def total(self) -> np.ndarray:
        """[B] the sum of every part."""
        return sum(p.reshape(p.shape[0], -1).sum(-1) for p in self.parts().values())

    def ledger(self) -> np.ndarray:
        """[B] |output - sum of parts| / max(|output|, largest |entry|) (docs/definitions.md, "The ledger")."""
        entries = np.concatenate([p.reshape(p.shape[0], -1) for p in self.parts().values()], axis=1)
        scale = np.maximum(np.abs(self.output), np.abs(entries).max(axis=1))
        return np.abs(self.output - self.total()) / np.maximum(scale, np.finfo(np.float64).tiny)

    def closes(self, rtol: float = LEDGER_RTOL) -> bool:
        """Whether the ledger closes within ``rtol`` on every image."""
        return bool((self.ledger() <= rtol).all())

    def head_table(self, image: int | None = 0) -> np.ndarray:
        """[L, H] each head's part (summed over source tokens) for one image, or the mean over the images (None):
        the layer x head table."""
        table = self.heads.sum(-1)
        return table.mean(0) if image is None else table[image]

    def head_map(self, layer: int, head: int, image: int = 0) -> np.ndarray:
        """[rows, cols] one head's part per source patch token (0-based layer and head): its map over the image."""
        return self.heads[image, layer, head, self.num_prefix_tokens:].reshape(self.grid)

    def top_heads(self, k: int = 5, image: int | None = 0) -> list[tuple[int, int, float]]:
        """The k heads with the largest part (of one image, or the mean over the images: None), as (layer, head,
        part), 0-based: the indices of ``head_table`` and ``heads`` (``summary`` and the app count from 1, so
        (1, 3, part) is "layer 2 head 4" there)."""
        table = self.head_table(image)
        order = np.argsort(-table, axis=None)[:k]
        return [(int(i // table.shape[1]), int(i % table.shape[1]), float(table.flat[i])) for i in order]

    def summary(self) -> str:
        l, h, v = self.top_heads(1)[0]
        return (f"{self.model_name or 'model'}: output {self.output[0]:.4g} = sum of "
                f"{self.heads.shape[1]}x{self.heads.shape[2]} heads, {self.mlp.shape[1]} MLPs, embeddings, biases; "
                f"top head layer {l + 1} head {h + 1} ({v:.3g}); {self.norm_convention} norm convention; "
                f"ledger {self.ledger().max():.1e} "
                f"({'closes' if self.closes() else 'OPEN'})")

    def to_rows(self) -> list[dict]:
        """One row per (image, part, layer, head), 1-based layer and head (0 where none), with the ledger."""
        rows = []
        ledger = self.ledger()
        for b in range(self.output.shape[0]):
            def row(part: str, value: float, layer: int = 0, head: int = 0, b: int = b) -> dict:
                return {"image": b, "part": part, "layer": layer, "head": head, "value": float(value),
                        "ledger": float(ledger[b])}
            for l in range(self.heads.shape[1]):
                rows += [row("head", self.heads[b, l, h].sum(), l + 1, h + 1) for h in range(self.heads.shape[2])]
                rows += [row("attn_bias", self.attn_bias[b, l], l + 1), row("mlp", self.mlp[b, l].sum(), l + 1)]
            for name in ("embed_patch", "embed_position", "embed_prefix"):
                rows.append(row(name, getattr(self, name)[b].sum()))
            rows += [row("pre_norm_bias", self.pre_norm_bias[b]), row("readout_bias", self.readout_bias[b]),
                     row("pool_mlp", self.pool_mlp[b])]
        return rows
