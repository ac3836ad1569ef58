"""Reading a ``F.scaled_dot_product_attention`` call (every attention view of the paper, for attention that no
family writes out): a thread-local ``TorchFunctionMode`` that hands each call made inside it to a handler, the
call's arguments by name, and the side capture of an attention pool that is one such call. Below the families
that read calls (the generic call-level capture and its layouts, the fused windows of Swin, Hiera, SAM, CaiT's
class attention), which import it: ``read_sdpa_call`` reads a module's one call as it is made, ``read_calls`` hands
the calls of one forward to the family to judge.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...core.attention import attention_probs
from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles

#: the parameters of ``F.scaled_dot_product_attention`` in order, with their defaults
_SDPA_PARAMS = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
                ("is_causal", False), ("scale", None), ("enable_gqa", False))

def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of one ``F.scaled_dot_product_attention`` call by name, defaults filled in.

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments.

    Returns:
        A dict with query, key, value, attn_mask, dropout_p, is_causal, scale and enable_gqa.
    """
    out = {}
    for i, (name, default) in enumerate(_SDPA_PARAMS):
        out[name] = args[i] if i < len(args) else kwargs.get(name, default)
    return out


class CallMode(TorchFunctionMode):
    """While active (on this thread), hands every ``F.scaled_dot_product_attention`` call to ``on_call``;
    every other function runs as it is. Inside the handler the mode is off, so ``on_call``'s own calls
    (the real kernel, the probabilities) are not intercepted again."""

    def __init__(self, on_call: Callable[[tuple, dict], torch.Tensor]) -> None:
        super().__init__()
        self.on_call = on_call

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.on_call(args, kwargs)
        return func(*args, **kwargs)


def probabilities_of_calls(sink: Callable[[torch.Tensor], None]) -> Callable[[tuple, dict], torch.Tensor]:
    """A ``CallMode`` handler for side capture: each ``F.scaled_dot_product_attention`` call is made as it is (its
    output returned untouched) and ``sink`` gets the call's probabilities, softmax(q k^T * scale + mask), computed
    from its very arguments (grouped keys repeated to the query heads), without autocast and without gradients.

    Args:
        sink: called with each call's probabilities [..., heads, queries, keys].

    Returns:
        The handler (``CallMode(handler)``).
    """
    def on_call(a: tuple, kw: dict) -> torch.Tensor:
        call = sdpa_arguments(a, kw)
        q, k = call["query"], call["key"]
        out = F.scaled_dot_product_attention(*a, **kw)
        if call["enable_gqa"] and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        scale = call["scale"] if call["scale"] is not None else q.shape[-1] ** -0.5
        with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
            sink(attention_probs(q, k, scale, call["attn_mask"], bool(call["is_causal"])))
        return out

    return on_call


def read_sdpa_call(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """Side capture of a fused attention module (timm's Swin ``WindowAttention``, Hiera's ``MaskUnitAttention``,
    SAM's ``Attention``, CaiT's ``ClassAttn``): each SDPA call's probabilities as it is made, the real output kept."""
    original = attn.forward
    on_call = probabilities_of_calls(lambda probs: capture(layer, probs))

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        with CallMode(on_call):
            return original(*args, **kwargs)

    handles.set_attr(attn, "forward", forward)


def read_calls(attn: nn.Module, handles: Handles, after: Callable[[list[torch.Tensor], Any], None]) -> None:
    """Side capture of a module run as it is under its model's implementation: every SDPA call of one forward read
    (``probabilities_of_calls``), then ``after(the calls' probabilities, the forward's output)`` hands them on or
    refuses (Hugging Face Swin's and SAM's attention: one call under sdpa, none under eager); the output untouched."""
    original = attn.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen: list[torch.Tensor] = []
        with CallMode(probabilities_of_calls(seen.append)):
            out = original(*args, **kwargs)
        after(seen, out)
        return out

    handles.set_attr(attn, "forward", forward)


def install_pool_call_capture(module: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
    """Side capture of an attention pool that is one ``F.scaled_dot_product_attention`` call of its queries over
    the tokens (AIMv2's pooling head): ``capture(0, probs[B, heads, queries, T])`` from that call's arguments, the
    call and the output untouched.

    Raises:
        UnsupportedModelError: (at the forward) the pool makes no SDPA call, or more than one.
    """
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls: list[torch.Tensor] = []

        def one(probs: torch.Tensor) -> None:
            if calls:
                raise UnsupportedModelError(f"{name!r}: its attention pool ({type(module).__name__}) calls "
                                            "scaled_dot_product_attention more than once; vitlens reads one call.")
            calls.append(probs)
            capture(0, probs)

        with CallMode(probabilities_of_calls(one)):
            result = original(*args, **kwargs)
        if not calls:
            raise UnsupportedModelError(f"{name!r}: its attention pool ({type(module).__name__}) made no "
                                        "scaled_dot_product_attention call for vitlens to read.")
        return result

    handles.set_attr(module, "forward", forward)


__all__ = ["CallMode", "install_pool_call_capture", "probabilities_of_calls", "read_calls", "read_sdpa_call",
           "sdpa_arguments"]
