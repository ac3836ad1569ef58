"""What cuts an image into patch tokens, whatever module does it (issue 48): a 2-D convolution, a linear layer
over unfolded patches (Llama 4's ``Unfold`` + ``Linear``, Gemma 4's ``input_proj``), or a 3-D convolution over a
temporal patch that an image fills with the same frame repeated (Qwen3-VL's ``patch_embed.proj``).

Serves the token geometry of every view that reads positions (distance, Fig. 7 right; rollout and maps on the
grid, Fig. 6) and the embedding filters (Fig. 7 left). The rule: a patch embedding of kernel ``k``, stride ``s``
and padding ``p`` makes ``(H + 2p - k) // s + 1`` rows of tokens of an ``H``-pixel image (PyTorch's convolution
arithmetic; a linear layer over non-overlapping unfolded patches is the convolution of kernel = stride = patch, no
padding), and its tokens in one forward are the spatial positions of its output (``[B, D, h, w]``) or the
sequence length of a ``[B, N, D]`` output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
from torch import nn
from ...core.attention import effective_weight


@dataclass(frozen=True)
class PatchEmbedding:
    """A patch embedding read as a convolution of the pixels.

    Attributes:
        module: the module whose output holds the patch tokens (hooked to count them in a forward).
        weight_module: the module that holds the weights (the convolution or the linear layer).
        in_channels: image channels.
        out_channels: token width.
        kernel: (kh, kw) pixels per patch.
        stride: (sh, sw) pixels between patches: the token stride.
        padding: (ph, pw) zero padding.
        kind: "conv2d", "linear" (over unfolded patches) or "conv3d" (over flattened temporal patches, one row each).
        channels_last: a linear layer's patches flattened (row, column, channel) rather than channel-major
            (transformers' Gemma 4, whose processor flattens them so).
    """

    module: nn.Module
    weight_module: nn.Module
    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    kind: str
    channels_last: bool = False

    def grid(self, size: Sequence[int]) -> tuple[int, int]:
        """The token grid of an image of ``size`` = (H, W) pixels (the module docstring's rule)."""
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple((int(size[i]) + 2 * self.padding[i] - self.kernel[i]) // self.stride[i] + 1  # type: ignore[return-value]
                     for i in range(2))

    @property
    def one_pixel_per_token(self) -> bool:
        """Whether each pixel reaches exactly one token (kernel = stride, no padding): a lit cell lights one token."""
        return self.kernel == self.stride and self.padding == (0, 0)

    def tokens(self, out: Any) -> int | None:
        """The patch tokens of one forward from ``module``'s output (None when its shape says nothing)."""
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            out = out[0]  # timm's Gemma 4 patch embedding returns (tokens, positions, padding)
        if not isinstance(out, torch.Tensor):
            return None
        if self.kind == "conv2d" and out.dim() == 4:
            return int(out.shape[-2]) * int(out.shape[-1])
        if self.kind == "linear" and out.dim() == 3:
            return int(out.shape[-2])
        return None

    def filters(self) -> torch.Tensor:
        """The weights as [D, C, kh, kw] filters of the pixels, as applied (a linear layer's rows unflattened in its
        channel-major order; a temporal patch's frames summed, since an image fills it with one frame repeated)."""
        if self.kind == "conv2d":
            return effective_weight(cast(nn.Conv2d, self.weight_module))  # kind "conv2d": the module is a Conv2d
        w = self.weight_module.weight.detach().to(torch.float64).cpu()
        if self.kind == "conv3d":
            return w.sum(dim=2)
        if self.channels_last:
            return w.reshape(self.out_channels, *self.kernel, self.in_channels).permute(0, 3, 1, 2).contiguous()
        return w.reshape(self.out_channels, self.in_channels, *self.kernel)


def flat_temporal_patches(x: torch.Tensor, patch: int, temporal: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch [B, C, H, W] as Qwen-VL's image processor hands it to the vision model: each image's patches
    flattened (channel, temporal frame, row, column), the image repeated over the temporal patch, in ``merge`` x
    ``merge`` block order (blocks row-major, each block row-major), images in order; and ``grid_thw``, one (1,
    rows, columns) per image. The sides must be multiples of ``patch * merge`` (the caller refuses others)."""
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    blocks = x.reshape(b, c, gh // merge, merge, patch, gw // merge, merge, patch).permute(0, 2, 5, 3, 6, 1, 4, 7)
    flat = blocks.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal, -1, -1).reshape(
        b * gh * gw, c * temporal * patch * patch)
    return flat, torch.tensor([[1, gh, gw]] * b, device=x.device)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def patch_embedding(module: nn.Module) -> PatchEmbedding | None:
    """The ``PatchEmbedding`` of ``module``: an ``nn.Conv2d``; a module with an ``nn.Unfold`` and an ``nn.Linear``
    over its output (Llama 4's ``Llama4UnfoldConvolution``); a module with a ``patch_size`` and a linear
    ``input_proj`` over flattened channel-major patches (Gemma 4's); a module with a ``temporal_patch_size`` and an
    ``nn.Conv3d`` ``proj`` (Qwen3-VL's, fed flattened patches); None for anything else."""
    if isinstance(module, nn.Conv2d):
        pad = module.padding if isinstance(module.padding, tuple) else (0, 0)
        return PatchEmbedding(module, module, int(module.in_channels), int(module.out_channels),
                              _pair(module.kernel_size), _pair(module.stride), _pair(pad), "conv2d")
    unfold, linear = getattr(module, "unfold", None), getattr(module, "linear", None)
    if isinstance(unfold, nn.Unfold) and isinstance(linear, nn.Linear):
        kernel, stride = _pair(unfold.kernel_size), _pair(unfold.stride)
        if _pair(unfold.padding) != (0, 0) or _pair(unfold.dilation) != (1, 1):
            return None
        channels = int(linear.in_features) // (kernel[0] * kernel[1])
        return PatchEmbedding(module, linear, channels, int(linear.out_features), kernel, stride, (0, 0), "linear")
    conv3d = getattr(module, "proj", None)
    if isinstance(conv3d, nn.Conv3d) and getattr(module, "temporal_patch_size", None):
        kernel, stride = _pair(conv3d.kernel_size[1:]), _pair(conv3d.stride[1:])
        return PatchEmbedding(module, conv3d, int(conv3d.in_channels), int(conv3d.out_channels), kernel, stride,
                              (0, 0), "conv3d")
    proj, size = getattr(module, "input_proj", None), getattr(module, "patch_size", None)
    if isinstance(proj, nn.Linear) and size is not None:
        kernel = _pair(size)
        channels = int(proj.in_features) // (kernel[0] * kernel[1])
        if channels * kernel[0] * kernel[1] != int(proj.in_features):
            return None
        last = type(module).__module__.startswith("transformers")  # (its processor flattens (row, column, channel))
        return PatchEmbedding(module, proj, channels, int(proj.out_features), kernel, kernel, (0, 0), "linear", last)
    return None
