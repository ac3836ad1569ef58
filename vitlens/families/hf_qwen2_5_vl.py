"""Hugging Face transformers Qwen2.5-VL's vision tower (``Qwen2_5_VisionTransformerPretrainedModel``), read block by
block: window attention in most blocks, full attention over each image in the blocks of ``fullatt_block_indexes``.

Inputs. The tower takes what Qwen's image processor hands it: each image's patches flattened (channel, temporal
frame, row, column), the frame repeated over the temporal patch, in 2x2 merge-block order (``spatial_merge_size``
blocks row-major, each block row-major), with ``grid_thw`` (``common.patches.flat_temporal_patches`` builds them from
a batch [B, C, H, W] whose sides are multiples of patch x merge). Its Conv3d is read as a 2-D convolution of the
image (the temporal frames' filters summed).

Token order. Before the blocks, the tower reorders the merge blocks into windows (``window_index``): windows of
``window_size`` pixels a side (``window_size // merge // patch`` merge blocks), row-major over the image, each
window's merge blocks row-major, each merge block's four tokens row-major; partial windows at the right and bottom
borders hold fewer tokens. Every block, window or full, runs on tokens in that order; the merger's output is put back
in merge-block order. Which image cell each position holds is read through the model's own code
(``get_vision_position_ids`` and ``get_vision_window_index``, the functions its forward calls) on the token numbers
of one image (``windows``); the views read it from there, so every view is in image order (the window index undone).

Capture. ``Qwen2_5_VLVisionAttention`` under sdpa makes one ``scaled_dot_product_attention`` call per window (a
window block: the chunks of ``cu_window_seqlens``) or per image (a full block: ``cu_seqlens``), with 2-D RoPE
applied to its queries and keys. Side capture runs the module as it is and reads each call's probabilities from its
very arguments (the real output kept, so the outputs are bit for bit those of a run without capture); inline capture
returns each call's output computed from the probabilities handed on. A block's maps are its calls' maps in the
model's order, each padded with zeros to the block's largest window: [B * windows, heads, N, N] for a window block
(a "window" geometry, -1 at the padded positions), [B, heads, T, T] for a full block (one "global" window holding
the whole image in the window order).

Distance and rollout (docs/definitions.md, "Windowed and hierarchical ViTs"): one stage, the patch grid, tokens at
(r + 0.5) x the patch; distance in image pixels per block beside the window-uniform distance (a full block's is the
whole image's); rollout A' = (A + I) / rowsum(A + I) through window and full blocks alike on the image's cells,
every block's map placed on the cells its positions hold (no transport between blocks: the grid never changes), the
source the mean over the tokens (the merger then maps each 2x2 merge block to one output token; its MLP mixes no
blocks). Not followed: the merger.

Size. It reads any size whose sides are multiples of patch x merge; it is read at the data config's input size, else
at four windows a side (448 px for Qwen2.5-VL's 14 px patches and 112 px windows); its windows are those of that
size, so the windowed views refuse images of another size in one line (``vl.analyze_each`` of images of different
sizes too: load the tower at each size).

A whole ``Qwen2_5_VLModel`` or ``Qwen2_5_VLForConditionalGeneration`` is read through its ``visual`` tower (as whole
VLMs are; ``read_module`` names it). Refused, in one line: another attention implementation than sdpa, a block or
attention class other than transformers' own, a window smaller than one merge block.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import attention_probs
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError, ViewNotAvailableError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, register
from .common.blocks import StagedFamily, check_blocks
from .common.hf import CLIP_MEAN, CLIP_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults, is_hf_model, tower_type
from .common.patches import flat_temporal_patches, patch_embedding
from .common.sdpa_calls import CallMode, probabilities_of_calls, sdpa_arguments
from .common.windows import token_centres

MODEL_TYPE = "qwen2_5_vl_vision"
#: the tower's type, its image processor's defaults (OpenAI CLIP's mean and std, bicubic), loaded with sdpa
HF_TYPES = HfTypes(processors={MODEL_TYPE: ProcessorDefaults("squash", 1.0, CLIP_MEAN, CLIP_STD, "bicubic")},
                   towers={"qwen2_5_vl": MODEL_TYPE})
MODEL_CLASSES = {MODEL_TYPE: ("Qwen2_5_VisionTransformerPretrainedModel",)}
#: windows a side of the size read when the data config names none
WINDOWS_A_SIDE = 4


class HuggingFaceQwen25Vision(HuggingFaceFamily, StagedFamily):
    """transformers ``Qwen2_5_VisionTransformerPretrainedModel``: window and full blocks on the window-ordered tokens,
    read in image order (module docstring)."""

    name = "hf-qwen2.5-vl"
    summary = "Hugging Face Qwen2.5-VL vision tower"
    reads = ("Hugging Face transformers Qwen2.5-VL's vision tower (Qwen2_5_VisionTransformerPretrainedModel): window "
             "attention and full attention blocks on tokens reordered into windows (the window index undone by the "
             "views), 2-D RoPE, 2x2 merge-block order; distance in image pixels beside the window-uniform distance, "
             "rollout through window and full blocks; needs transformers")
    names = ("hf:FOLDER of a Qwen2.5-VL checkpoint (the whole VLM, read through its visual tower), e.g. "
             "hf:Qwen/Qwen2.5-VL-3B-Instruct, or the tower module (vl.LoadedModel.from_module)",)
    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("norm1",)
    hf_types = HF_TYPES
    model_classes = MODEL_CLASSES

    def matches(self, model: nn.Module) -> bool:
        return (is_hf_model(model) and tower_type(model) == MODEL_TYPE
                and type(model).__name__ in MODEL_CLASSES[MODEL_TYPE])  # a whole model: through its ``visual``

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        modeling = sys.modules[type(model).__module__]
        check_blocks(name, ((f"block {i}", b) for i, b in enumerate(model.blocks)), modeling.Qwen2_5_VLVisionBlock,
                     (modeling.Qwen2_5_VLVisionAttention,), "transformers")
        impl = model.config._attn_implementation
        if impl != "sdpa":
            raise UnsupportedModelError(f"{name!r} runs attn_implementation={impl!r}; vitlens reads Qwen2.5-VL's "
                                        "vision tower at its scaled_dot_product_attention calls: load it with "
                                        "attn_implementation='sdpa'.")
        pe = patch_embedding(model.patch_embed)
        if pe is None or pe.kind != "conv3d" or not pe.one_pixel_per_token:
            raise UnsupportedModelError(f"{name!r}: its patch embedding is not the Conv3d over flattened patches "
                                        "vitlens reads.")
        if model.window_size // model.spatial_merge_size // model.patch_size < 1:
            raise UnsupportedModelError(f"{name!r}: its window ({model.window_size} px) is smaller than one merge "
                                        f"block ({model.spatial_merge_size * model.patch_size} px), which its own "
                                        "code cannot partition.")

    # --- structure ----------------------------------------------------------------------------------------------

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """Every block, all on the one stage (the patch grid)."""
        return [(0, block) for block in model.blocks]

    def unit(self, model: nn.Module) -> int:
        """Pixels per merge block a side: the sides of an image it reads are multiples of it."""
        return int(model.patch_size) * int(model.spatial_merge_size)

    def read_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        """The size given, else four windows a side; refused where a side is not a multiple of patch x merge."""
        size = (int(input_size[0]), int(input_size[1])) if input_size is not None else \
            (WINDOWS_A_SIDE * int(model.window_size),) * 2
        unit = self.unit(model)
        if size[0] % unit or size[1] % unit:
            raise UnsupportedModelError(f"{name!r} takes images whose sides are multiples of {unit} px (patch "
                                        f"{model.patch_size} x merge {model.spatial_merge_size}); got "
                                        f"{size[0]}x{size[1]}: preprocess to such a size (data_config input_size).")
        return size

    def cell_order(self, model: nn.Module, grid: tuple[int, int]) -> tuple[np.ndarray, list[int]]:
        """(the image cell, ``r * W + c``, at each position of one image's window-ordered tokens; the window bounds),
        read through the model's own ``get_vision_position_ids`` and ``get_vision_window_index``."""
        modeling = sys.modules[type(model).__module__]
        merge = int(model.spatial_merge_size)
        thw = torch.tensor([[1, grid[0], grid[1]]])
        pos = modeling.get_vision_position_ids(thw, merge)  # [T, 2] (row, column) in merge-block order
        window_index, bounds = modeling.get_vision_window_index(thw, spatial_merge_size=merge,
                                                                window_size=int(model.window_size),
                                                                patch_size=int(model.patch_size))
        cells = (pos[:, 0] * grid[1] + pos[:, 1]).reshape(-1, merge * merge)[window_index].reshape(-1)
        return cells.numpy().astype(np.int64), [int(b) for b in bounds.tolist()]

    # --- geometry -----------------------------------------------------------------------------------------------

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        """Every block's geometry on the patch grid: a full block one "global" window of the image's tokens in the
        window order, a window block its windows (``cell_order``), -1 padding a partial window to the largest."""
        p = int(model.patch_size)
        grid = (int(input_hw[0]) // p, int(input_hw[1]) // p)
        cells, bounds = self.cell_order(model, grid)
        n = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        index = np.full((len(bounds) - 1, n), -1, dtype=np.int64)
        for w, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            index[w, : b - a] = cells[a:b]
        full = cells[None]
        centres = token_centres(grid, (p, p))
        out = []
        for i in range(len(model.blocks)):
            idx = full if i in model.fullatt_block_indexes else index
            valid = idx >= 0  # every query may attend every real key of its window
            kind = "global" if idx.shape[0] == 1 and valid.all() else "window"
            allowed = np.broadcast_to(valid[:, None, :], (*idx.shape, idx.shape[1])).copy()
            out.append(WindowGeometry(stage=0, grid=grid, stride_px=(p, p), index=idx, allowed=allowed, kind=kind,
                                      query_centres=centres))
        return out

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.read_size(model, name, input_size)
        p = int(model.patch_size)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=(size[0] // p, size[1] // p), stride_px=(p, p),
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(model.config.hidden_size), has_class_token=False, has_pos_embed=False, num_classes=0,
            num_params=sum(q.numel() for q in model.parameters()), family=self.name)

    def _install(self, model: nn.Module, capture: CaptureRequest, handles: Handles, inline: bool) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            handles.set_attr(attn, "forward", _reading_forward(attn.forward, layer, capture, inline))

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self._install(model, capture, handles, inline=False)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self._install(model, capture, handles, inline=True)

    def cam_layer(self, model: nn.Module) -> str | None:
        """None: its blocks hand on tokens in the window order, [T, C] for the whole batch, which the CAMs' reshape
        does not read (a default target layer is refused in one line)."""
        return None

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        pe = patch_embedding(model.patch_embed)
        if pe is None:
            raise ViewNotAvailableError(f"{spec.name}: its patch embedding is not a Conv3d vitlens reads.")
        return pe.filters(), "patch_embed.proj", ("the patch embedding's Conv3d, its temporal frames summed (an "
                                                  "image fills them with one frame repeated)")

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("Qwen2.5-VL's vision tower learns no absolute position table: it rotates its queries and keys by their "
                "row and column (2-D RoPE)")

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "it adds no learned bias to its scores: its queries and keys are rotated by row and column (2-D RoPE)"

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> None:
        return None

    def inputs(self, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tower's inputs of a batch [B, C, H, W] (module docstring)."""
        unit = self.unit(model)
        if x.shape[-2] % unit or x.shape[-1] % unit:
            raise UnsupportedModelError(f"Qwen2.5-VL's vision tower takes images whose sides are multiples of {unit} "
                                        f"px; got {x.shape[-2]}x{x.shape[-1]}.")
        flat, thw = flat_temporal_patches(x, int(model.patch_size), int(model.patch_embed.temporal_patch_size),
                                          int(model.spatial_merge_size))
        return {"hidden_states": flat.to(model.patch_embed.proj.weight.dtype), "grid_thw": thw}

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Each image's mean merged token (the merger's output, per image)."""
        out = model(**self.inputs(model, x)).pooler_output
        return out.reshape(x.shape[0], -1, out.shape[-1]).mean(1)


def _reading_forward(original: Callable[..., Any], layer: int, capture: CaptureRequest,
                     inline: bool) -> Callable[..., Any]:
    """The attention module's forward with each SDPA call read: side, the call made as it is and its probabilities
    computed from its arguments; inline, the call's output computed from the probabilities handed on. The calls' maps
    of one forward are padded with zeros to the largest and handed on as the block's [calls, heads, N, N]."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        seen: list[torch.Tensor] = []

        def inline_call(a: tuple, kw: dict) -> torch.Tensor:
            call = sdpa_arguments(a, kw)
            q, k, v = call["query"], call["key"], call["value"]
            scale = call["scale"] if call["scale"] is not None else q.shape[-1] ** -0.5
            with torch.autocast(device_type=q.device.type, enabled=False):
                probs = attention_probs(q, k, scale, call["attn_mask"], bool(call["is_causal"]))
            seen.append(probs.detach() if capture.detach else probs)
            return probs.to(v.dtype) @ v

        with CallMode(inline_call if inline else probabilities_of_calls(seen.append)):
            out = original(*args, **kwargs)
        if not seen:
            raise UnsupportedModelError("A Qwen2.5-VL vision attention made no scaled_dot_product_attention call; "
                                        "vitlens reads its sdpa implementation.")
        n = max(int(s.shape[-1]) for s in seen)
        capture(layer, torch.cat([F.pad(s, (0, n - s.shape[-1], 0, n - s.shape[-2])) for s in seen]))
        return out

    return forward


register(HuggingFaceQwen25Vision())
