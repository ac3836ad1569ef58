"""The family interface (``Family``: what a model family tells vitlens) and ``Adapter`` (a family read through
the family of a module inside the model); ``vitlens.families.base`` re-exports them and says the capture guarantee."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..core.spec import ModelSpec
from .capture_request import CaptureAbilities, CaptureRequest
from .hook_session import Handles
from .sites import HookPoint
from .common.relative_bias import read_relative_bias
from ..errors import ViewNotAvailableError

if TYPE_CHECKING:
    from ..core.windows import WindowGeometry
    from .common.relative_bias import RelativeBias


class Family:
    """Base class of the model families; subclasses fill in every method.

    Optional abilities. A family whose models are not one global attention over one token grid declares, as its own
    methods, what the views and methods read of them; every other family keeps the default here, None (read as "the
    family has no such ability": callers test ``family.windows is None``, never ``getattr``):

    - ``windows(model, input_hw) -> list[WindowGeometry]``: every block's windows (Swin, SAM / ViTDet, Hiera, MViT v2,
      PVT: ``spec.kind == "hierarchical"``);
    - ``stage_layout(model) -> [(token grid, pixel stride)]`` of every stage at the built size (the CAMs' stage grids;
      None: the spec's one grid);
    - ``block_heads(model) -> list[int]``: every block's heads, where its attention modules do not say ``num_heads``;
    - ``block_layout(model) -> list[dict]``: each block's kind and tokens, for blocks of more than one kind (CaiT);
    - ``packed_forward(model, images)``: images of different sizes in one packed forward (Pixtral);
    - ``cam_layer(model)`` (a method returning None by default) and ``hf_types`` (the transformers model types a
      family reads, ``vitlens.families.common.hf.HfTypes``).
    """

    #: short name, stored in ``ModelSpec.family``
    name = "family"
    #: the family in a few words, for the lists of what vitlens reads in its refusals (``supported_families``;
    #: the name where it says none)
    summary = ""
    #: which capture path the blocks take, in words, where it is not the family's own (``LoadedModel``'s repr)
    path = ""
    #: a fallback family is tried only after every other family and the refusals by name (``family_of``)
    fallback = False
    #: what the family reads, in words, and the model names that lead to it (``vitlens models``)
    reads = ""
    names: tuple[str, ...] = ()
    #: the family's ``abilities`` for every model it reads, unless it says otherwise per model
    capture = CaptureAbilities()
    #: the names a block's child module may have whose output is what the block's attention reads (the
    #: pre-attention norm), in the order they are looked for (``attention_input``)
    attention_inputs: tuple[str, ...] = ()

    def abilities(self, model: nn.Module) -> CaptureAbilities:
        """What capture can do for ``model`` (``capture_plan`` and ``capture_attention`` read it)."""
        return self.capture

    def attention_input(self, model: nn.Module, block: nn.Module) -> str | None:
        """The name of ``block``'s child whose output its attention reads (the pre-attention norm), or None
        when the family does not know it. The Grad-CAM family's default target layer is the last block's."""
        for child in self.attention_inputs:
            if isinstance(getattr(block, child, None), nn.Module):
                return child
        return None

    def cam_layer(self, model: nn.Module) -> str | None:
        """The module name the Grad-CAM family reads by default on a hierarchical model (``spec.kind ==
        "hierarchical"``): the last stage's last block's output, or the module the family names in its place, whose
        output is that stage's tokens ([B, H, W, C], [B, H * W, C] or [B, C, H, W]); None for a ViT, whose CAMs read
        the last block's ``attention_input``."""
        return None

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family (refusals included: ``check`` says why)."""
        raise NotImplementedError

    def check(self, model: nn.Module, name: str) -> None:
        """Raise ``UnsupportedModelError`` naming what this family cannot capture exactly."""
        raise NotImplementedError

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        """The model's spec; ``input_size`` is the (H, W) its preprocessing feeds it (None: the size it was
        built for). A family honours it (Hugging Face towers, timm models built with ``dynamic_img_size``) or
        refuses another size (``refuse_other_size``); none ignores it."""
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The attention module of every block, first block first."""
        raise NotImplementedError

    #: the transformers model types the family reads, their processor defaults and the attention implementation
    #: ``hf:`` names load with (``vitlens.families.common.hf.HfTypes``); None for a family of no transformers models
    hf_types: Any = None

    #: ``windows(model, input_hw) -> list[WindowGeometry]`` for a family whose blocks attend within windows on stages
    #: of coarser grids (Swin: ``spec.kind == "hierarchical"``); None for global attention
    windows: "Callable[[nn.Module, Sequence[int]], list[WindowGeometry]] | None" = None
    #: ``stage_layout(model) -> [(token grid, pixel stride)]`` of every stage at the built size, for a family whose
    #: stages have grids of their own (Swin, PVT); None: the spec's one grid
    stage_layout: "Callable[[nn.Module], list[tuple[tuple[int, int], tuple[int, int]]]] | None" = None
    #: ``block_layout(model) -> list[dict]`` for a family whose blocks are of more than one kind (CaiT:
    #: ``spec.kind == "class-attention"``): each block's kind and the tokens of its queries and keys; None otherwise
    block_layout: Callable[..., Any] | None = None
    #: ``clip_layout(model) -> core.clip_layout.ClipLayout`` for a family of video models (``spec.kind ==
    #: "space-time"``): each token's time step and cell, the prefix tokens, and whether a block's maps are joint or
    #: divided; None for a family of image models
    clip_layout: Callable[..., Any] | None = None
    #: ``block_heads(model) -> list[int]``, the heads of every block's attention, for such a family whose attention
    #: modules do not say it as ``num_heads`` (Hugging Face's Swins); None: read ``num_heads``
    block_heads: Callable[..., Any] | None = None
    #: ``packed_forward(model, images) -> list[ImageTokens] | None``: one forward of preprocessed images of different
    #: sizes, packed in one sequence (Pixtral) or padded (Siglip2), under a capture, returning where each image's
    #: tokens stand in the maps (``core.tokens.ImageTokens``; None: the model takes no such batch, and
    #: ``vl.analyze_each`` runs the images one by one); None for a family of no such models
    packed_forward: Callable[..., Any] | None = None
    #: ``tower(model) -> nn.Module``, the submodule whose blocks the family reads when it reads a whole model through
    #: its vision tower (a CLIP model's ``vision_model``, Idefics3's); None: the model itself
    #: (``ModelSpec.read_module`` names it)
    tower: Callable[..., Any] | None = None

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Side capture (``capture.mode == "side"``): every block's probabilities computed beside the model's
        own forward from the very queries and keys it uses, sent to ``capture`` (by ``capture.query_rows``
        where ``abilities(model).side_rows``); the model's outputs bit-for-bit those of a run without it."""
        raise NotImplementedError

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Inline capture (``capture.mode == "inline"``): the family's non-fused path, whose probabilities are
        sent to ``capture`` (detached unless ``capture.detach`` is False) as the output is computed from them."""
        raise NotImplementedError

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        """(weight [D, C, kh, kw] float64, module name, description) of the pixel-space filters (Fig. 7 left)."""
        raise NotImplementedError

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """Side capture of the attention pool's own attention, for models that pool through one (a MAP head: its
        probe queries over the tokens): ``capture(0, probs[B, heads, queries, T])``, the output untouched.

        Raises:
            ViewNotAvailableError: the model pools otherwise (class token, mean) or by a pool vitlens does not read.
        """
        raise ViewNotAvailableError(f"{type(model).__name__} pools without an attention pool (MAP head) vitlens reads, "
                                    "so there is no pool attention to show.")

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is the heads' outputs side by side, [B, T, heads * head_dim]
        (where head ablation acts), or None when the family has no such module."""
        return None

    def hook_points(self, model: nn.Module) -> dict[str, HookPoint]:
        """The named sites the family declares on ``model`` (``vitlens.families.sites``): each block's residual stream
        in and out (``blocks.{i}.hook_resid_pre`` / ``hook_resid_post``, the input and output of the module that holds
        the block's attention module) and, where ``head_outputs`` names the module, its heads side by side before the
        projection (``blocks.{i}.attn.hook_z``). A family whose blocks are not the attention modules' parents says
        its own."""
        names = {id(mod): n for n, mod in model.named_modules()}
        modules = dict(model.named_modules())
        points: dict[str, HookPoint] = {}
        for i, attn in enumerate(self.attention_modules(model)):
            block = modules[names[id(attn)].rsplit(".", 1)[0]]
            points[f"blocks.{i}.hook_resid_pre"] = HookPoint(block, "input")
            points[f"blocks.{i}.hook_resid_post"] = HookPoint(block)
            heads = self.head_outputs(attn)
            if heads is not None:
                points[f"blocks.{i}.attn.hook_z"] = HookPoint(heads, "input")
        return points

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """E_pos rows of the patch tokens, [1, gh * gw, D], with the (gh, gw) grid they were learned
        on; None when there is no learned absolute table."""
        raise NotImplementedError

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "it has no learned absolute position embedding"

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias | None":
        """The learned relative-position bias every block adds to its attention scores, read from the model's own
        modules (``vitlens.families.common.relative_bias``: timm relpos and BEiT, Hugging Face BEiT); None when it has
        none."""
        return read_relative_bias(model)

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        """Why ``relative_bias`` is None, in words that finish "... is not available for NAME: "."""
        reason = "it adds no learned relative-position bias to its attention scores"
        return reason + ("; its position is a learned absolute table (the position view shows it)"
                         if spec.has_pos_embed else "")

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        """Token grid for another input size (models that accept one)."""
        if tuple(input_hw) == spec.image_size:
            return spec.grid
        sy, sx = spec.stride_px
        return input_hw[0] // sy, input_hw[1] // sx

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        """Preprocessing: input_size, interpolation, mean, std, crop_pct, crop_mode (timm's keys)."""
        raise NotImplementedError

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The classifier output (or features) of a preprocessed batch."""
        return model(x)


class Adapter(Family):
    """A family that reads a model through the family of a module inside it (an OpenCLIP tower's timm trunk).

    Every ``Family`` method that takes the model (``ADAPTED``) and that the adapter does not define itself is
    the inner family's, called on the inner module: an adapter writes only what it changes (its spec's name,
    preprocessing, output), and what the inner family can do (``abilities``: capture by query rows, ...)
    is what the adapter can do.
    """

    def inner(self, model: nn.Module) -> tuple[nn.Module, Family]:
        """(the inner module, its family)."""
        raise NotImplementedError


def _adapted(name: str) -> Callable[..., Any]:
    def method(self: Adapter, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner_model, inner = self.inner(model)
        return getattr(inner, name)(inner_model, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The inner family's ``{name}``, on the inner module (``Adapter``)."
    return method


#: the ``Family`` methods an ``Adapter`` hands to the inner family: every public one whose first argument is
#: the model, except the two that decide whether the adapter reads the model at all (derived, not listed)
ADAPTED = tuple(name for name, fn in vars(Family).items()
                if inspect.isfunction(fn) and not name.startswith("_") and name not in ("matches", "check")
                and list(inspect.signature(fn).parameters)[1:2] == ["model"])
for _name in ADAPTED:
    setattr(Adapter, _name, _adapted(_name))
del _name


def prefix_labels(cls: bool, distillation: bool = False, registers: int = 0) -> tuple[str, ...]:
    """The prefix tokens in sequence order: class, distillation, then registers."""
    return tuple((["class"] if cls else []) + (["distillation"] if distillation else [])
                 + [f"register {i + 1}" for i in range(registers)])
