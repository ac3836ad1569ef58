"""Where a named site is read (``HookPoint``) and the standard sites' names, in TransformerLens's words: what a
family declares (``Family.hook_points``) and the hook layer's sessions capture (``vitlens.engine.sites``)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class HookPoint:
    """Where a named site is read.

    Attributes:
        module: the module whose input or output the site is.
        at: "output" (the module's output; its first element where it returns a tuple) or "input" (its first
            positional input, read before the module runs).
        whole: hand over the module's whole output, a tuple included, as it returned it (read only).
    """

    module: nn.Module
    at: str = "output"
    whole: bool = False


#: the sites a map's blocks declare, per block ``i`` (``blocks.{i}.<name>``), in TransformerLens's names
BLOCK_SITES = {
    "hook_resid_pre": "the residual stream entering the block",
    "hook_resid_post": "the residual stream leaving the block",
    "hook_attn_out": "the attention branch as written to the stream (after its layer scale)",
    "hook_mlp_out": "the MLP branch as written to the stream (after its layer scale)",
    "attn.hook_z": "each head's output side by side before the output projection [B, N, H * dh]",
}
#: the sites of the whole model
MODEL_SITES = {
    "hook_embed": "the patch embedding's output",
    "ln_final.hook_in": "the residual stream after the last block, entering the final norm",
}
