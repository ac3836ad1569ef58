"""Exact capture of every block's post-softmax attention, streamed to consumers as it is made.

Serves every attention view of the paper (Fig. 6/14 rollout, Fig. 7 right and Fig. 11
attention distance). Two modes, both exact:

- ``mode="side"`` (default): the model's own forward is left untouched, fused attention
  included, so its outputs are bit-for-bit those of a run without capture. Beside it, hooks on
  each block's ``q_norm`` and ``k_norm`` receive the (normalised) queries and keys the block
  itself uses and compute ``softmax(q * scale @ k^T + mask)`` as timm's non-fused path does, in
  float32 even when the model runs under bf16 autocast. Costs one extra q k^T per block.
- ``mode="inline"``: each block runs timm's own non-fused path and the probabilities are taken
  as they enter ``attn_drop``: no extra work beyond un-fusing, and the captured maps are the
  ones the output depends on (what gradient methods need). Outputs then equal a non-fused run
  exactly and the fused run to float rounding.

Models whose attention differs from that formula (relative-position bias, RoPE, ...) are
refused by ``vitlens.model.check_supported``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from .errors import InvalidParameterError
from .model import LoadedModel, check_supported, iter_blocks

AttentionConsumer = Callable[[int, torch.Tensor], None]
CAPTURE_MODES = ("side", "inline")


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q * scale @ k^T + bias) in float32, with timm's mask semantics.

    Args:
        q, k: [B, heads, T, head_dim] after q_norm / k_norm.
        scale: the module's ``scale`` (head_dim ** -0.5).
        attn_mask: bool (True = attend) or additive float mask broadcastable to [B, heads, T, T].
        is_causal: mask future keys (takes precedence over ``attn_mask``, as in timm).
    """
    q = q.float() * scale
    scores = q @ k.float().transpose(-2, -1)
    n = scores.shape[-1]
    if is_causal:
        scores = scores + scores.new_full((n, n), float("-inf")).triu_(1)
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill_(~attn_mask, float("-inf"))
        else:
            bias = attn_mask.float()
        scores = scores + bias
    return scores.softmax(dim=-1)


class AttentionCapture:
    """Context manager that captures the attention probabilities of every block.

    Use ``vl.capture_attention(m)``; after a forward, ``maps[l]`` is block l's [B, heads, T, T]
    attention (float32, detached), T = prefix tokens + patch tokens. Consumers are called as
    ``consumer(layer_index, attn)`` the moment each block's attention exists, so a statistic can
    be accumulated without keeping any map (``store=False``).
    """

    def __init__(self, m: LoadedModel | nn.Module, store: bool = True,
                 consumers: Iterable[AttentionConsumer] = (), mode: str = "side", detach: bool = True) -> None:
        if mode not in CAPTURE_MODES:
            raise InvalidParameterError(f"mode must be one of {', '.join(CAPTURE_MODES)}; got {mode!r}.")
        if not detach and mode != "inline":
            raise InvalidParameterError("detach=False needs mode='inline': only then does the output depend on "
                                        "the captured maps.")
        self.model = m.model if isinstance(m, LoadedModel) else m
        check_supported(self.model, type(self.model).__name__)
        self.mode = mode
        self.detach = detach
        self._fused: list[tuple[nn.Module, bool]] = []
        self.store = store
        self.consumers: list[AttentionConsumer] = list(consumers)
        self._maps: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._pending: dict[int, dict[str, Any]] = {}

    @property
    def maps(self) -> list[torch.Tensor]:
        """Attention of each block from the latest forward, first block first."""
        return [self._maps[i] for i in sorted(self._maps)]

    def add_consumer(self, consumer: AttentionConsumer) -> None:
        self.consumers.append(consumer)

    def _hooks_for(self, layer: int, attn: nn.Module) -> None:
        state: dict[str, Any] = {}
        self._pending[layer] = state

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            state.clear()
            state["attn_mask"] = kwargs.get("attn_mask", args[1] if len(args) > 1 else None)
            state["is_causal"] = bool(kwargs.get("is_causal", args[2] if len(args) > 2 else False))

        def q_hook(_mod: nn.Module, _inp: tuple, q: torch.Tensor) -> None:
            state["q"] = q

        def k_hook(_mod: nn.Module, _inp: tuple, k: torch.Tensor) -> None:
            q = state.pop("q")
            with torch.no_grad(), torch.autocast(device_type=k.device.type, enabled=False):
                probs = attention_probs(q, k, attn.scale, state.get("attn_mask"), state.get("is_causal", False))
            if self.store:
                self._maps[layer] = probs
            for consumer in self.consumers:
                consumer(layer, probs)

        self._handles.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self._handles.append(attn.q_norm.register_forward_hook(q_hook))
        self._handles.append(attn.k_norm.register_forward_hook(k_hook))

    def _inline_hook_for(self, layer: int, attn: nn.Module) -> None:
        def drop_pre_hook(_mod: nn.Module, args: tuple) -> None:
            probs = args[0] if not self.detach else args[0].detach()
            if self.store:
                self._maps[layer] = probs
            for consumer in self.consumers:
                consumer(layer, probs)

        self._fused.append((attn, attn.fused_attn))
        attn.fused_attn = False
        self._handles.append(attn.attn_drop.register_forward_pre_hook(drop_pre_hook))

    def __enter__(self) -> "AttentionCapture":
        if self._handles:
            raise RuntimeError("This AttentionCapture is already active; nest a new one instead.")
        if any(a.q_norm is a.k_norm for _, a in iter_blocks(self.model)):
            raise RuntimeError("q_norm and k_norm are one module; vitlens cannot tell queries from keys.")
        try:
            for layer, attn in iter_blocks(self.model):
                if self.mode == "inline":
                    self._inline_hook_for(layer, attn)
                else:
                    self._hooks_for(layer, attn)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        for attn, fused in self._fused:
            attn.fused_attn = fused
        self._fused.clear()
        self._handles.clear()
        self._pending.clear()


def capture_attention(m: LoadedModel | nn.Module, store: bool = True,
                      consumers: Iterable[AttentionConsumer] = (), mode: str = "side",
                      detach: bool = True) -> AttentionCapture:
    """Capture every block's attention probabilities during forwards inside the ``with`` block.

    Args:
        m: a LoadedModel (or a supported timm VisionTransformer).
        store: keep the maps of the latest forward in ``.maps`` (False: consumers only, no memory).
        consumers: callables ``f(layer_index, attn[B, heads, T, T])`` called as each block finishes.
        mode: "side" (outputs bit-for-bit unchanged; attention recomputed beside the fused
            forward) or "inline" (timm's non-fused path; maps are the ones the output uses).
        detach: with mode="inline", False keeps the maps in the autograd graph (for gradients).
    """
    return AttentionCapture(m, store=store, consumers=consumers, mode=mode, detach=detach)
