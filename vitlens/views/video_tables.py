"""Where a Hugging Face video ViT keeps the weights the video weight views read (issue 50): its tubelet (or
per-frame) patch embedding and its position tables, on the (time step, cell) lattice of its tokens.

Read from transformers 5.24's modules: ViViT (``VivitEmbeddings``: one learned ``position_embeddings`` over the
class token and the tubelets, time step major), TimeSformer (``TimesformerEmbeddings``: learned spatial
``position_embeddings`` over the class token and the cells, and ``time_embeddings`` over the frames unless
``attention_type`` is "space_only"), VideoMAE (``VideoMAEEmbeddings``: a fixed sin-cos table over the flattened
tubelet index, a plain tensor attribute) and V-JEPA 2 (3-D rotary embeddings in attention: no table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError

#: the Hugging Face model types read here
VIDEO_MODEL_TYPES = ("vivit", "timesformer", "videomae", "vjepa2")


@dataclass(frozen=True)
class VideoWeights:
    """A video model's embedding weights on its token lattice.

    Attributes:
        model_type: the config's ``model_type``.
        name: the module's class name (what a message names).
        filters: the patch embedding's weight as [D, C, tt, P, P] (a per-frame Conv2d as tt = 1), float64.
        module: dotted name of that convolution.
        steps, grid: nt time steps and the (gh, gw) cells of the model's own input size.
        frames_per_step: tt.
        joint: [nt * gh * gw, D] float64, one table over the tubelet tokens (class row dropped), or None.
        space: [gh * gw, D] separate spatial table (class row dropped), or None.
        time: [nt, D] separate time table, or None.
        sinusoidal: the table is a fixed sin-cos code, not learned.
        no_table: why there is no table at all ("" when there is one).
    """

    model_type: str
    name: str
    filters: torch.Tensor
    module: str
    steps: int
    grid: tuple[int, int]
    frames_per_step: int
    joint: torch.Tensor | None
    space: torch.Tensor | None
    time: torch.Tensor | None
    sinusoidal: bool
    no_table: str


def _embeddings(model: nn.Module) -> tuple[str, nn.Module]:
    """The first module named ``...embeddings`` holding ``patch_embeddings`` (a predictor's or decoder's skipped)."""
    found = [(n, mod) for n, mod in model.named_modules() if n.split(".")[-1] == "embeddings"
             and hasattr(mod, "patch_embeddings") and "predictor" not in n and "decoder" not in n]
    if not found:
        raise UnsupportedModelError(f"{type(model).__name__} has no patch embedding vitlens finds.")
    return min(found, key=lambda item: len(item[0]))


def video_weights(model: Any) -> VideoWeights:
    """The embedding weights of a Hugging Face ViViT, TimeSformer, VideoMAE or V-JEPA 2 model (bare or with a head;
    a ``LoadedModel`` of one is read through its module).

    Raises:
        UnsupportedModelError: any other model.
    """
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model  # a LoadedModel's module
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, nn.Module) or model_type not in VIDEO_MODEL_TYPES:
        raise UnsupportedModelError(f"{type(model).__name__} is not a video model vitlens reads the weights of; "
                                    f"pass a Hugging Face {', '.join(VIDEO_MODEL_TYPES)} model.")
    config = model.config
    prefix, emb = _embeddings(model)
    convs = [(n, m) for n, m in emb.patch_embeddings.named_modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    if not convs:
        raise UnsupportedModelError(f"{type(model).__name__}'s patch embedding is not a convolution.")
    conv_name, conv = convs[0]
    w = conv.weight.detach().to(torch.float64).cpu()
    if w.ndim == 4:
        w = w.unsqueeze(2)  # a per-frame embedding: one time step
    tt, ph, pw = w.shape[2:]
    frames = int(getattr(config, "frames_per_clip", None) or config.num_frames)
    side = getattr(config, "crop_size", None) or config.image_size
    h, w_px = (side, side) if isinstance(side, int) else tuple(side)
    steps, grid = frames // tt, (h // ph, w_px // pw)
    joint = space = time = None
    sinusoidal, no_table = False, ""
    if model_type == "vivit":
        joint = emb.position_embeddings.detach()[0, 1:]
    elif model_type == "timesformer":
        space = emb.position_embeddings.detach()[0, 1:]
        time = emb.time_embeddings.detach()[0] if hasattr(emb, "time_embeddings") else None
    elif model_type == "videomae":
        joint, sinusoidal = emb.position_embeddings.detach()[0], True
    else:
        no_table = "its position code is a 3-D rotary embedding applied inside attention (RoPE), not a table"

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(torch.float64).cpu()

    return VideoWeights(model_type, type(model).__name__, w, f"{prefix}.patch_embeddings.{conv_name}".lstrip("."),
                        steps, grid, int(tt), f64(joint), f64(space), f64(time), sinusoidal, no_table)
