"""The embedded reference pair: a small plain ViT and its hybrid, trained on ``vitlens.reference.shapes``.

Both use timm's own ``VisionTransformer`` (so every view applies unchanged) with the same
transformer (width 128, depth 6, 8 heads) and the same 8x8 token grid on 64x64 images:

- ``ref-vit``: 8x8-pixel patches embedded by a linear projection (paper Eq. 1);
- ``ref-hybrid``: a small residual CNN of total stride 8 whose feature map gives 1x1 tokens,
  as in the paper's R50+ViT hybrid (section 3.1, "Hybrid Architecture").

Weights are trained alike by ``analyses/locality_sweep.py --recipes pair-alike`` (MODEL_CARD.md) and
shipped as safetensors.
"""
from __future__ import annotations

from functools import partial
from typing import Any
from pathlib import Path

import torch
from torch import nn

from .shapes import CLASSES, IMAGE_SIZE

#: the folder of the embedded pair's safetensors files
WEIGHTS_DIR = Path(__file__).parent / "weights"
#: the names ``load_model`` knows the embedded pair by
REFERENCE_NAMES: tuple[str, ...] = ("ref-vit", "ref-hybrid")
#: the pair's width, depth, heads per block and patch size (the hybrid's CNN has stride PATCH too)
EMBED_DIM: int = 128
DEPTH: int = 6
NUM_HEADS: int = 8
PATCH: int = 8


class _BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) with a strided projection shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act(y + self.shortcut(x))


class SmallResNet(nn.Module):
    """Residual CNN of total stride 8 (or 4): a 5x5 stride-2 stem, then two basic blocks, both
    strided for stride 8, only the first for stride 4.

    The stem convolution (48 filters of 5x5x3) is the hybrid's pixel-space filter bank, the
    analogue of R50's 7x7 stem that the filter-PCA view shows for hybrids.
    """

    def __init__(self, width: int = 48, out_channels: int = 128, stride: int = 8) -> None:
        super().__init__()
        if stride not in (4, 8):
            raise ValueError(f"SmallResNet has a total stride of 4 or 8, not {stride}")
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 5, 2, 2, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.stage1 = _BasicBlock(width, 64, 2)
        self.stage2 = _BasicBlock(64, out_channels, 2 if stride == 8 else 1)
        self.num_features = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage2(self.stage1(self.stem(x)))


def _pretrained_cfg(name: str, image_size: int = IMAGE_SIZE) -> dict:
    return {
        "architecture": name,
        "input_size": (3, image_size, image_size),
        "mean": (0.5, 0.5, 0.5),
        "std": (0.5, 0.5, 0.5),
        "crop_pct": 1.0,
        "crop_mode": "center",
        "interpolation": "bilinear",
        "num_classes": len(CLASSES),
        "label_names": list(CLASSES),
    }


def build_reference(name: str, patch: int = PATCH, image_size: int = IMAGE_SIZE) -> nn.Module:
    """Build ``ref-vit`` or ``ref-hybrid`` with random weights (timm ``VisionTransformer``).

    Args:
        name: "ref-vit" or "ref-hybrid".
        patch: the token stride in pixels: the ViT's patch size, or the hybrid CNN's total stride
            (8 or 4; the embedded pair uses 8). Experiments (``analyses/locality_sweep.py``) vary it.
        image_size: input side in pixels.

    Returns:
        The timm ``VisionTransformer`` (random weights; ``load_model(name)`` loads the embedded ones).

    Raises:
        ValueError: a name other than the two.
    """
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer import VisionTransformer

    if name not in REFERENCE_NAMES:
        raise ValueError(f"unknown reference model {name!r}; expected one of {REFERENCE_NAMES}")
    common: dict[str, Any] = dict(
        img_size=image_size,
        embed_dim=EMBED_DIM,
        depth=DEPTH,
        num_heads=NUM_HEADS,
        mlp_ratio=4.0,
        num_classes=len(CLASSES),
        global_pool="token",
        class_token=True,
    )
    if name == "ref-vit":
        model = VisionTransformer(patch_size=patch, **common)
    else:
        embed = partial(HybridEmbed, backbone=SmallResNet(stride=patch))
        model = VisionTransformer(patch_size=1, embed_layer=embed, **common)
    # torch types a Module's __setattr__ for tensors and modules; timm keeps its config a plain dict attribute
    model.pretrained_cfg = _pretrained_cfg(name, image_size)  # type: ignore[assignment]
    model.default_cfg = model.pretrained_cfg
    return model


def weights_path(name: str) -> Path:
    """Where the committed safetensors file of reference model ``name`` lives.

    Args:
        name: "ref-vit" or "ref-hybrid".

    Returns:
        The path of its ``.safetensors`` file inside the package.
    """
    return WEIGHTS_DIR / f"{name}.safetensors"
