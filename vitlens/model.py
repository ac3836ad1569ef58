"""Loading a timm ViT (hub name, random init, local checkpoint or embedded reference) and
describing it with the facts every view needs: token grid, pixel stride, prefix tokens.

Serves all figures of the paper's section 4.5: the spec's grid and stride turn token indices
into pixel positions (Fig. 7 right, Fig. 11), its prefix count separates the class,
distillation and register tokens from patch tokens (Fig. 6, Fig. 7 centre).
"""
from __future__ import annotations

import contextlib
import difflib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .errors import CheckpointError, UnknownModelError, UnsupportedModelError, WeightsUnavailableError

#: timm modules whose models vitlens captures exactly.
SUPPORTED_MODULES = ("vision_transformer", "vision_transformer_hybrid", "deit")
#: Families vitlens refuses, with what it would silently get wrong.
REFUSED_FAMILIES = {
    "beit": "relative-position bias added to the attention logits (BEiT)",
    "eva": "rotary position embeddings (RoPE) applied to queries and keys (EVA)",
    "vision_transformer_relpos": "relative-position bias added to the attention logits",
    "vision_transformer_sam": "windowed attention with decomposed relative-position bias (SAM)",
    "naflexvit": "variable-resolution patch packing with attention masks and RoPE (NaFlexViT)",
    "cait": "class-attention layers and talking heads (CaiT)",
    "xcit": "cross-covariance attention over channels (XCiT)",
}


@dataclass(frozen=True)
class ModelSpec:
    """What the views need to know about a model.

    Attributes:
        name: the name it was loaded by.
        kind: "vit" (patch embedding) or "hybrid" (CNN feature map, 1x1 tokens).
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        for key in ("image_size", "grid", "stride_px"):
            d[key] = tuple(d[key])
        return cls(**d)


def check_supported(model: nn.Module, name: str) -> None:
    """Refuse any model whose attention vitlens cannot reproduce exactly.

    Raises:
        UnsupportedModelError: naming the family or the block/attention class that is not supported.
    """
    from timm.layers import HybridEmbed, PatchEmbed
    from timm.layers.attention import Attention
    from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer

    module = type(model).__module__.rsplit(".", 1)[-1]
    if module in REFUSED_FAMILIES:
        raise UnsupportedModelError(
            f"{name!r} ({type(model).__name__}) uses {REFUSED_FAMILIES[module]}, which vitlens does not reproduce "
            "exactly, so its attention maps are refused rather than shown wrong. Supported: timm "
            "VisionTransformer models (vit_*, deit_*, register, GAP/MAP and R50 hybrid variants)."
        )
    if not isinstance(model, VisionTransformer):
        raise UnsupportedModelError(
            f"{name!r} is not a Vision Transformer (it builds {type(model).__name__} from timm.models.{module}). "
            "vitlens analyses timm VisionTransformer models: try e.g. 'vit_base_patch16_224', "
            "'deit_small_patch16_224', 'vit_base_r50_s16_224' or the embedded 'ref-vit'."
        )
    if not isinstance(model.patch_embed, (PatchEmbed, HybridEmbed)):
        raise UnsupportedModelError(
            f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens supports PatchEmbed and "
            "HybridEmbed, whose token grid and pixel stride it knows."
        )
    for i, block in enumerate(model.blocks):
        if type(block) not in (Block, ResPostBlock):
            raise UnsupportedModelError(
                f"{name!r}: block {i} is a {type(block).__name__}, which computes attention its own way; "
                "vitlens captures the attention of timm's Block/ResPostBlock only."
            )
        if type(block.attn) is not Attention:
            raise UnsupportedModelError(
                f"{name!r}: block {i} uses {type(block.attn).__name__}; vitlens reproduces timm's standard "
                "Attention (softmax(q k^T * scale + mask)) exactly and refuses other attention variants."
            )


def build_spec(model: nn.Module, name: str) -> ModelSpec:
    """Read the spec off a supported timm VisionTransformer."""
    from timm.layers import HybridEmbed

    pe = model.patch_embed
    kind = "hybrid" if isinstance(pe, HybridEmbed) else "vit"
    image_size = tuple(int(s) for s in pe.img_size)
    grid = tuple(int(g) for g in pe.grid_size)
    stride = tuple(int(s) for s in pe.feat_ratio(as_scalar=False))
    pos = getattr(model, "pos_embed", None)
    prefix = int(model.num_prefix_tokens)
    pos_prefix = 0 if (pos is None or getattr(model, "no_embed_class", False)) else int(pos.shape[1]) - grid[0] * grid[1]
    return ModelSpec(
        name=name,
        kind=kind,
        image_size=image_size,  # type: ignore[arg-type]
        grid=grid,  # type: ignore[arg-type]
        stride_px=stride,  # type: ignore[arg-type]
        num_prefix_tokens=prefix,
        num_layers=len(model.blocks),
        num_heads=int(model.blocks[0].attn.num_heads),
        embed_dim=int(model.embed_dim),
        has_class_token=getattr(model, "cls_token", None) is not None,
        has_pos_embed=pos is not None,
        pos_embed_prefix=pos_prefix,
        num_classes=int(getattr(model, "num_classes", 0)),
        num_params=sum(p.numel() for p in model.parameters()),
        dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)),
    )


@dataclass
class LoadedModel:
    """A timm ViT in eval mode with its spec, device, compute dtype and data config.

    ``model`` is the plain timm module: vitlens never changes what it computes.
    """

    model: nn.Module
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype = torch.float32
    data_config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    _label_cache: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward when ``dtype`` is not float32 (e.g. bf16 on CUDA)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def preprocess(self, images: Any) -> torch.Tensor:
        """PIL images / paths / arrays -> [B, 3, H, W] on the model's device, with its data config."""
        from .images import preprocess

        return preprocess(images, self.data_config).to(self.device)

    def grid_for(self, input_hw: Sequence[int]) -> tuple[int, int]:
        """Patch-token grid for an input of (H, W) pixels (differs from spec.grid for dynamic sizes)."""
        pe = self.model.patch_embed
        if tuple(input_hw) == self.spec.image_size:
            return self.spec.grid
        gh, gw = pe.dynamic_feat_size(tuple(int(s) for s in input_hw))
        return int(gh), int(gw)

    def label_names(self) -> list[str] | None:
        """Class names of the classifier when known (ImageNet subsets via timm, reference classes)."""
        if self._label_cache is None:
            self._label_cache = self._find_label_names() or []
        return list(self._label_cache) or None

    def _find_label_names(self) -> list[str] | None:
        names = self.data_config.get("label_names")
        if names:
            return list(names)
        if self.spec.num_classes <= 0:
            return None
        try:
            from timm.data import ImageNetInfo, infer_imagenet_subset

            subset = infer_imagenet_subset(self.model)
            if subset is None:
                return None
            info = ImageNetInfo(subset)
            names = [info.index_to_description(i) for i in range(info.num_classes())]
        except Exception:  # class names are a convenience; never fail a view for them
            return None
        return names if len(names) == self.spec.num_classes else None

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for a preprocessed batch, in float32."""
        with self.autocast():
            return self.model(x.to(self.device)).float()


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _suggest(name: str) -> str:
    import timm

    base = name.split(".")[0]
    choices = timm.list_models()
    close = difflib.get_close_matches(base, choices, n=5, cutoff=0.6)
    if not close:
        close = [c for c in choices if base[:6] and c.startswith(base[:6])][:5]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return (f"Unknown model {name!r}: it is not a vitlens reference model, a timm model name or an existing "
            f"file.{hint} vl.list_models() lists presets; timm.list_models('vit_*') lists timm's ViTs.")


def _data_config(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    from timm.data import resolve_data_config

    cfg = dict(resolve_data_config({}, model=model))
    cfg["input_size"] = (3, *spec.image_size)
    names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
    if names:
        cfg["label_names"] = list(names)
    return cfg


def _finish(model: nn.Module, name: str, device: torch.device, dtype: torch.dtype, source: str) -> LoadedModel:
    check_supported(model, name)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model.to(device)
    spec = build_spec(model, name)
    return LoadedModel(model=model, spec=spec, device=device, dtype=dtype,
                       data_config=_data_config(model, spec), source=source)


def _create_checked(name: str, **kwargs: Any) -> None:
    """Build ``name`` on the meta device (no memory, no weights) to refuse unsupported models early."""
    import timm

    try:
        meta = timm.create_model(name, pretrained=False, device="meta", **kwargs)
    except TypeError as e:
        raise UnknownModelError(f"timm cannot build {name!r} with {kwargs}: {e}") from e
    check_supported(meta, name)


def load_model(
    name: str,
    pretrained: bool = True,
    arch: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> LoadedModel:
    """Load a ViT for analysis.

    Args:
        name: an embedded reference model ("ref-vit", "ref-hybrid"), a timm model name with optional
            pretrained tag ("vit_base_patch16_224.augreg2_in21k_ft_in1k"), or a local checkpoint file
            (.safetensors, .pth/.pt/.bin state dict, original ViT .npz) together with ``arch``.
        pretrained: load hub weights for a timm name (False: random init).
        arch: timm architecture of a local checkpoint.
        device: torch device; default CUDA when available, else CPU.
        dtype: compute dtype; torch.bfloat16/float16 run the forward under autocast while every
            statistic vitlens computes stays in float32/float64.
        **kwargs: passed to ``timm.create_model`` (e.g. ``img_size=(160, 224)``, ``dynamic_img_size=True``).

    Raises:
        UnknownModelError, UnsupportedModelError, WeightsUnavailableError, CheckpointError.
    """
    import timm

    from .reference import REFERENCE_NAMES, build_reference, weights_path

    dev = _resolve_device(device)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        from .errors import InvalidParameterError

        raise InvalidParameterError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, not {dtype}.")
    if name in REFERENCE_NAMES:
        model = build_reference(name)
        path = weights_path(name)
        if not path.is_file():
            raise WeightsUnavailableError(
                f"The weights of the embedded model {name!r} are missing ({path}); reinstall vitlens or "
                "train them with: python analyses/train_reference.py")
        from .checkpoint import load_checkpoint_into

        load_checkpoint_into(model, path, name)
        return _finish(model, name, dev, dtype, source=str(path))

    from .checkpoint import load_checkpoint_into, looks_like_checkpoint_path

    if looks_like_checkpoint_path(name) and not timm.is_model(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file not found: {path}. Check the path.")
        if not arch:
            raise CheckpointError(f"{path} is a checkpoint file: pass its architecture too, e.g. "
                                  f"vl.load_model({str(path)!r}, arch='vit_base_patch16_224').")
        if arch in REFERENCE_NAMES:
            model = build_reference(arch)
        else:
            if not timm.is_model(arch):
                raise UnknownModelError(_suggest(arch))
            _create_checked(arch, **kwargs)
            model = timm.create_model(arch, pretrained=False, **kwargs)
        check_supported(model, arch)
        load_checkpoint_into(model, path, arch)
        return _finish(model, f"{arch} ({path.name})", dev, dtype, source=str(path))

    if not timm.is_model(name):
        raise UnknownModelError(_suggest(name))
    if "." in name and name not in timm.list_pretrained(name):
        tags = timm.list_pretrained(name.split(".")[0] + ".*")
        raise UnknownModelError(f"timm has no pretrained weights named {name!r}. "
                                f"Available for this architecture: {', '.join(tags) or 'none'}; "
                                "or pass pretrained=False.")
    _create_checked(name, **kwargs)
    if not pretrained:
        model = timm.create_model(name, pretrained=False, **kwargs)
        return _finish(model, name, dev, dtype, source="random init")

    from timm.models import get_pretrained_cfg

    from .hub import resolve_pretrained_source

    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise WeightsUnavailableError(f"timm has no pretrained weights for {name!r}; pass pretrained=False.")
    cached = resolve_pretrained_source(name, cfg.to_dict())
    overlay = {"file": str(cached), "source": ""} if cached is not None else None
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except (OSError, RuntimeError) as e:
        raise WeightsUnavailableError(f"Loading the pretrained weights of {name!r} failed: {e}") from e
    return _finish(model, name, dev, dtype, source=str(cached) if cached else f"hub:{cfg.hf_hub_id or cfg.url}")


def iter_blocks(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(index, attention module) of each transformer block, first to last."""
    for i, block in enumerate(model.blocks):
        yield i, block.attn


def param_count_str(n: int) -> str:
    """3.1M-style parameter count for display."""
    if n <= 0:
        return "0"
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 10 ** (3 * exp):.1f}{['', 'K', 'M', 'B'][exp]}"
