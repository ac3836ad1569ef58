"""The built-in attribution methods' maps on the one contract (``Method.fn``: model, images, targets, grid, parameters,
scorer -> maps [B, gh, gw] and the targets explained), beside rollout (paper Fig. 6): rollout itself, gradient-weighted
rollout (Chefer et al., 2021), and captum's integrated gradients, saliency, input x gradient and occlusion, their pixel
attributions summed over channels and each token's pixel block. ``vitlens.attribution.methods`` registers them.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..core.resample import pixels_to_grid
from ..engine.capture import capture_attention
from ..errors import InvalidParameterError, UnsupportedModelError
from ..loading.model import LoadedModel
from ..views.analyze import attention_rollout
from ..views.rollout import RolloutResult
from ..views.rollout_math import rollout_map

Scorer = Callable[[torch.Tensor], torch.Tensor]


def rollout_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor | None, grid: tuple[int, int],
             params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    r = attention_rollout(m, x, batch_size=x.shape[0], **params)
    if not isinstance(r, RolloutResult):  # attribute's kinds take images: a video model is refused before it
        raise UnsupportedModelError(f"{m.spec.name} reads clips; rollout as an attribution reads images.")
    return r.maps, (r.predictions if t is None else t.cpu().numpy())


def grad_rollout_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
                  params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad(), capture_attention(m, mode="inline", detach=False) as cap:
        logits = score(x)
        # one gradient per block, in block order
        grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), cap.maps)
    tokens = cap.maps[0].shape[-1]
    r = torch.eye(tokens, dtype=torch.float64, device=x.device).expand(x.shape[0], tokens, tokens).clone()
    for attn, grad in zip(cap.maps, grads):
        cam = (grad.detach().to(torch.float64) * attn.detach().to(torch.float64)).clamp(min=0).mean(dim=1)
        r = r + cam @ r
    return rollout_map(r, m.spec.num_prefix_tokens, m.spec.has_class_token, grid), t.cpu().numpy()


def class_scorer(m: LoadedModel) -> Scorer:
    """The class scorer: x -> [B, classes] logits in float32."""
    return lambda inp: m.forward(inp).float()


def integrated_gradients_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
                          params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    import captum.attr as ca

    x = x.detach().clone().requires_grad_(True)
    baseline = torch.zeros_like(x)  # the normalised mean colour
    with torch.enable_grad():
        attr = ca.IntegratedGradients(score).attribute(
            x, baselines=baseline, target=t, n_steps=int(params["n_steps"]), internal_batch_size=x.shape[0])
    return pixels_to_grid(attr, grid), t.cpu().numpy()


def saliency_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
              params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    import captum.attr as ca

    with torch.enable_grad():
        attr = ca.Saliency(score).attribute(x.detach().clone().requires_grad_(True), target=t, abs=True)
    return pixels_to_grid(attr, grid), t.cpu().numpy()


def input_x_gradient_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
                      params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    import captum.attr as ca

    with torch.enable_grad():
        attr = ca.InputXGradient(score).attribute(x.detach().clone().requires_grad_(True), target=t)
    return pixels_to_grid(attr, grid), t.cpu().numpy()


def occlusion_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
               params: dict[str, Any], score: Scorer) -> tuple[np.ndarray, np.ndarray]:
    import captum.attr as ca

    sy, sx = m.spec.stride_px
    win, step = int(params["window_tokens"]), int(params["stride_tokens"])
    if win < 1 or not 1 <= step <= win:
        raise InvalidParameterError(f"occlusion needs window_tokens >= stride_tokens >= 1; got {win}, {step}.")
    with torch.no_grad():
        attr = ca.Occlusion(score).attribute(
            x.detach(), sliding_window_shapes=(x.shape[1], win * sy, win * sx),
            strides=(x.shape[1], step * sy, step * sx), baselines=0.0, target=t,
            perturbations_per_eval=int(params["perturbations_per_eval"]))
    # captum gives each pixel the mean score drop of the windows covering it (the same value on
    # every channel); with the default one-token window the block mean is that token's drop
    return pixels_to_grid(attr, grid, reduce="mean") / x.shape[1], t.cpu().numpy()


__all__ = ["Scorer", "class_scorer", "grad_rollout_maps", "input_x_gradient_maps", "integrated_gradients_maps",
           "occlusion_maps", "rollout_maps", "saliency_maps"]
