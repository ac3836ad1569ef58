"""Reading the probabilities an attention module computes itself, on its own (non-fused) path: as they enter its
dropout (``read_at_dropout``), as its one softmax call returns them (``read_softmax``), or as it returns them
when asked (``read_returned``). Each hands the capture the model's own tensor (detached unless the capture asks
for the graph); the module's output is untouched.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles
from .sdpa_calls import read_sdpa_call


def read_at_dropout(dropout: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A non-fused path's own probabilities [B * windows, heads, N, N], as they enter its attention dropout."""
    def pre_hook(_mod: nn.Module, args: tuple) -> None:
        probs = args[0]
        capture(layer, probs.detach().float() if capture.detach else probs)

    handles.hook(dropout.register_forward_pre_hook(pre_hook))


class SoftmaxCall(TorchFunctionMode):
    """While active on this thread, hands the result of every softmax call (``Tensor.softmax``, ``torch.softmax``,
    ``F.softmax``) to ``on_result`` and returns it unchanged; every other function runs as it is."""

    FUNCS = (torch.Tensor.softmax, torch.softmax, F.softmax)

    def __init__(self, on_result: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.on_result = on_result

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.FUNCS:
            self.on_result(out)
        return out


class SoftmaxApplied(TorchFunctionMode):
    """While active on this thread, keeps the result of every softmax call (``results``) and, for each, whether a
    matrix product took it as its left operand as it is (the same storage and shape: dropout in eval mode hands
    it on unchanged), i.e. whether those probabilities are the ones applied to the values (``applied``). A
    softmax whose result is changed before the product (talking heads, a differential pair) is not applied."""

    FUNCS = SoftmaxCall.FUNCS
    PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)

    def __init__(self) -> None:
        super().__init__()
        self.results: list[torch.Tensor] = []
        self.applied: list[bool] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.FUNCS:
            self.results.append(out)
            self.applied.append(False)
        elif func in self.PRODUCTS and args and isinstance(args[0], torch.Tensor):
            left = args[0]
            for i, probs in enumerate(self.results):
                if left.shape == probs.shape and left.data_ptr() == probs.data_ptr():
                    self.applied[i] = True
        return out


def read_softmax(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles, detach: bool,
                 refusal: Callable[[int], str]) -> None:
    """The attention's own probabilities as its one softmax call returns them (its forward run as it is, inside
    ``SoftmaxCall``): the very tensor its output is computed from, detached in float32 unless ``detach`` is False.

    Args:
        refusal: the one-line message for a forward that made ``n`` softmax calls, not one (``refusal(n)``).

    Raises:
        UnsupportedModelError: (at the forward) the forward made no softmax call or more than one.
    """
    original = attn.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen: list[torch.Tensor] = []
        with SoftmaxCall(seen.append):
            result = original(*args, **kwargs)
        if len(seen) != 1:
            raise UnsupportedModelError(refusal(len(seen)))
        capture(layer, seen[0].detach().float() if detach else seen[0])
        return result

    handles.set_attr(attn, "forward", forward)


def read_returned(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles,
                  answer: Callable[[Any, bool], Any]) -> None:
    """An eager attention that returns its probabilities when called with ``output_attentions=True`` (its output
    computed as without): called so, its probabilities (the second item it returns) handed on, and the caller
    handed what it asked for, ``answer(returned, output_attentions)``."""
    original = attn.forward

    def forward(hidden_states: torch.Tensor, output_attentions: bool = False) -> Any:
        out = original(hidden_states, output_attentions=True)
        weights = out[1]
        capture(layer, weights.detach().float() if capture.detach else weights)
        return answer(out, output_attentions)

    handles.set_attr(attn, "forward", forward)


def read_fused_or_own(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles, inline: bool,
                      own: Callable[[nn.Module, int, CaptureRequest, Handles], None] | None = None) -> None:
    """A timm attention module with a ``fused_attn`` switch (Swin's windows, SAM's, Hiera's mask units, CaiT's class
    attention): side capture reads a fused module's one SDPA call (``read_sdpa_call``, the real output kept) and a
    non-fused one's own probabilities; inline capture turns the non-fused path on for the session and reads its
    own probabilities. ``own(attn, layer, capture, handles)`` reads them (default: as they enter ``attn_drop``)."""
    if getattr(attn, "fused_attn", False):
        if not inline:
            read_sdpa_call(attn, layer, capture, handles)
            return
        handles.set_attr(attn, "fused_attn", False)
    if own is None:
        read_at_dropout(attn.attn_drop, layer, capture, handles)
    else:
        own(attn, layer, capture, handles)


__all__ = ["SoftmaxApplied", "SoftmaxCall", "read_at_dropout", "read_fused_or_own", "read_returned", "read_softmax"]
