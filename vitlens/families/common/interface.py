"""Reading a transformers attention module that calls the attention function of ``config._attn_implementation``
through transformers' ``AttentionInterface`` (Hugging Face Swin's ``SwinAttention``, SegFormer's
``SegformerAttention``): side capture of the module run as it is (sdpa's one call, or eager's returned
probabilities), and inline capture through transformers' eager implementation for the session.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles
from .sdpa_calls import read_calls


def read_interface_beside(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles, what: str) -> None:
    """Side capture of an ``AttentionInterface`` module under its model's own implementation, the module run as it
    is: sdpa's one call read from its very arguments (the real output kept), or eager's returned probabilities (the
    tensor its output is made from). Another implementation (flex, a kernel) is refused at the forward in one line.

    Args:
        what: the attention, in words, for the refusal ("a Swin attention").
    """
    def after(seen: list[torch.Tensor], out: Any) -> None:
        weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if len(seen) == 1:
            probs = seen[0]
        elif not seen and isinstance(weights, torch.Tensor):  # eager: the probabilities its output is made from
            probs = weights.detach().float()
        else:
            implementation = attn.config._attn_implementation
            raise UnsupportedModelError(
                f"Side capture reads {what} under the eager or sdpa implementation; this one runs "
                f"{implementation!r}, which makes {len(seen)} scaled_dot_product_attention calls and returns no "
                "probabilities: capture with mode='inline' (transformers' eager attention, exact), or load the model "
                "with attn_implementation='sdpa' or 'eager'.")
        capture(layer, probs)

    read_calls(attn, handles, after)


def read_eager_returned(attns: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> None:
    """Inline capture of ``AttentionInterface`` modules: their configs switched to transformers' ``eager``
    implementation for the session, and each module's returned probabilities (the second item of its output, the
    very tensor its output is computed from) handed on as block ``layer`` (its place in ``attns``)."""
    for config in {id(a.config): a.config for a in attns}.values():
        if config._attn_implementation != "eager":
            handles.set_attr(config, "_attn_implementation", "eager")

    for layer, attn in enumerate(attns):
        def hook(_mod: nn.Module, _args: tuple, out: Any, layer: int = layer) -> None:
            weights = out[1]
            capture(layer, weights.detach().float() if capture.detach else weights)

        handles.hook(attn.register_forward_hook(hook))


__all__ = ["read_eager_returned", "read_interface_beside"]
