"""What every view needs to know about a model: token grid, pixel stride, prefix tokens, depth.

Serves all figures of the paper's section 4.5: grid and stride turn token indices into pixel
positions (Fig. 7 right, Fig. 11); the prefix count separates the class, distillation and
register tokens from patch tokens (Fig. 6, Fig. 7 centre).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..kinds import find_kind


@dataclass(frozen=True)
class ModelSpec:
    """What the views need to know about a model.

    Attributes:
        name: the name it was loaded by.
        kind: the kind of model, a name of the kind registry (``vitlens.kinds``, which says what each is and how it
            is read): "vit" (patch embedding), "hybrid" (CNN feature map, 1x1 tokens) or "hierarchical" (windowed
            attention in stages of coarser grids, Swin: ``grid`` and ``stride_px`` are the first stage's,
            ``num_heads`` the most of any block; each block's windows from ``Family.windows``) or "class-attention"
            (CaiT: self-attention blocks over the patch tokens alone, then class-attention layers whose one query is
            the class token, over the class token and the patches; ``num_layers`` counts both, ``num_prefix_tokens``
            is the class token of the class-attention layers, ``Family.block_layout`` says each block's kind).
        image_size: (H, W) input size the model was built for.
        grid: (gh, gw) patch-token grid at ``image_size``.
        stride_px: (sy, sx) input pixels between neighbouring tokens: the patch size of a ViT,
            the CNN's total stride for a hybrid.
        num_prefix_tokens: class + distillation + register tokens before the patch tokens.
        num_layers: transformer blocks.
        num_heads: attention heads per block.
        embed_dim: token width D.
        has_class_token: whether token 0 is a class token.
        has_pos_embed: whether there is a learned absolute position embedding E_pos.
        pos_embed_prefix: rows of E_pos that belong to prefix tokens (0 with ``no_embed_class``).
        num_classes: classifier outputs (0 for a feature model).
        num_params: parameter count.
        dynamic_img_size: whether the model accepts other input sizes (E_pos resampled).
        family: which model family captures its attention (e.g. "timm-vit").
        prefix_labels: what each prefix token is ("class", "distillation", "register 1", ...).
        stage_heads: a hierarchical model's heads of every block, grouped by stage, first stage first (Swin-T:
            ((3, 3), (6, 6), (12,) * 6, (24, 24)); ``core.windows.stage_heads``); () when unknown or for a model
            without windows. ``describe`` shows a model of more than one stage by its stages and heads per stage.
        read_module: where in the model given the blocks read are, for a whole model read through its vision tower
            (a VLM's ``"model.vision_tower"``, a depth model's ``"backbone"``, a CLIP model's ``"vision_model"``,
            with the tower's class: ``"backbone (Dinov2Backbone)"``); "" when the model given is the one read.
        token_order: the model's own token order in words when it is not prefix then row-major cells (its declared
            ``core.tokens.TokenLayout``; the captured maps are permuted into the views' order); "" when it is.
        not_drawn: attention in the model that is not a token attention, in words (DaViT's channel attention: a
            softmax over channels), which no view captures or draws; "" when there is none.
    """

    name: str
    kind: str
    image_size: tuple[int, int]
    grid: tuple[int, int]
    stride_px: tuple[int, int]
    num_prefix_tokens: int
    num_layers: int
    num_heads: int
    embed_dim: int
    has_class_token: bool
    has_pos_embed: bool
    pos_embed_prefix: int = 0
    num_classes: int = 0
    num_params: int = 0
    dynamic_img_size: bool = False
    family: str = "timm-vit"
    prefix_labels: tuple[str, ...] = ()
    stage_heads: tuple[tuple[int, ...], ...] = ()
    read_module: str = ""
    token_order: str = ""
    not_drawn: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        for key in ("image_size", "grid", "stride_px", "prefix_labels"):
            if key in d:
                d[key] = tuple(d[key])
        if "stage_heads" in d:
            d["stage_heads"] = tuple(tuple(int(h) for h in stage) for stage in d["stage_heads"])
        return cls(**d)

    @property
    def num_patch_tokens(self) -> int:
        """Patch tokens at the built size: gh * gw."""
        return self.grid[0] * self.grid[1]

    def num_tokens(self, grid: tuple[int, int] | None = None) -> int:
        """Tokens T of the sequence every block attends over (the side of its [T, T] maps): the prefix tokens
        and the patch tokens of ``grid`` (default the built size's, ``spec.grid``; another input size's from
        ``LoadedModel.grid_for``)."""
        gh, gw = grid if grid is not None else self.grid
        return self.num_prefix_tokens + int(gh) * int(gw)

    def depth_description(self) -> dict[str, str]:
        """The blocks and heads in words: "layers x heads" ("12 x 6"), or for a model of more than one stage
        (``stage_heads``) its "stages" ("4 (2, 2, 6, 2 blocks)") and "heads per stage" ("3, 6, 12, 24"; a stage
        whose blocks differ shows its range, "1-2")."""
        if len(self.stage_heads) < 2:
            return {"layers x heads": f"{self.num_layers} x {self.num_heads}"}
        blocks = ", ".join(str(len(s)) for s in self.stage_heads)
        heads = ", ".join(str(min(s)) if min(s) == max(s) else f"{min(s)}-{max(s)}" for s in self.stage_heads)
        return {"stages": f"{len(self.stage_heads)} ({blocks} blocks)", "heads per stage": heads}

    def prefix_description(self) -> str:
        """'1 (class)', '2 (class, distillation)', '4 (4 registers)', '0 (none: patch tokens only)' (a GAP or MAP
        head, or a tower with no head at all: the spec does not say which, so neither is claimed)."""
        if self.num_prefix_tokens == 0:
            return "0 (none: patch tokens only)"
        labels = list(self.prefix_labels)
        if len(labels) != self.num_prefix_tokens:
            labels = ["class"] if self.has_class_token else []
            extra = self.num_prefix_tokens - len(labels)
            if extra:
                labels.append(f"{extra} more (distillation/register)")
        registers = sum(lab.startswith("register") for lab in labels)
        named = [lab for lab in labels if not lab.startswith("register")]
        if registers:
            named.append(f"{registers} register{'s' if registers > 1 else ''}")
        return f"{self.num_prefix_tokens} ({', '.join(named)})"

    def describe(self) -> dict[str, str]:
        """The spec in words, one fact per entry (the app's sidebar, the report's model table); the kind as its
        registry words it (``Kind.label``)."""
        sy, sx = self.stride_px
        return {
            "name": self.name,
            "kind": _kind_label(self.kind),
            "input": f"{self.image_size[0]}x{self.image_size[1]} px",
            "grid": f"{self.grid[0]}x{self.grid[1]} tokens",
            "stride": f"{sy} px" if sy == sx else f"{sy}x{sx} px",
            "prefix tokens": self.prefix_description(),
            **self.depth_description(),
            "width": str(self.embed_dim),
            "parameters": param_count_str(self.num_params),
            "classes": str(self.num_classes) if self.num_classes else "none (feature model)",
            "position embedding": "learned, absolute" if self.has_pos_embed else "none learned (absolute table absent)",
            **({"read through": self.read_module} if self.read_module else {}),
            **({"token order": self.token_order} if self.token_order else {}),
            **({"not drawn": self.not_drawn} if self.not_drawn else {}),
        }


def _kind_label(name: str) -> str:
    """A kind's words (``Kind.label``), or its name when no registered kind has it."""
    kind = find_kind(name)
    return kind.label if kind is not None else name


def param_count_str(n: int) -> str:
    """3.1M-style parameter count for display.

    Args:
        n: a parameter count.

    Returns:
        The count with a K/M/B suffix (e.g. "3.1M").
    """
    if n <= 0:
        return "0"
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 10 ** (3 * exp):.1f}{['', 'K', 'M', 'B'][exp]}"
