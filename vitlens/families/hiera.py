"""Hiera (timm ``hiera_*``, ``timm.models.hiera``; Hugging Face ``HieraModel`` / ``HieraForImageClassification``):
mask-unit attention over an "unrolled" token sequence, with the queries max-pooled at the first block of each
pooling stage; and SAM 2's Hiera (timm ``HieraDet``, ``sam2_hiera_*``: ``read_hieradet_windows``, ``TimmHieraDet``),
windows padded on a row-major grid, queries pooled inside each window.

Token order. Hiera's patch tokens are reordered once, before the first block (``Unroll``: the q-stride offsets
of every pooling moved outward, so that mask units are contiguous by stride and a max over ``q_stride`` groups
of the sequence is a 2-D max pool). A mask-unit attention views the tokens as [tokens per window, windows] (the
window of a sequence position is its number modulo the windows); a pooling block max-pools its queries over
``q_stride`` groups, so its queries are tokens of the next stage's coarser grid while its keys are the block's
input tokens on the finer grid ("query-pooled"), and max-pools its residual the same way (after its ``proj``).
A global block is one window over all tokens.

Geometry (``windows``). None of this is re-derived: every block's windows are read by running the model's own
code on one-hot token numbers. The model's ``Unroll`` (transformers: ``unroll``) places each stage-0 token; each
block's attention runs on a stand-in (``common.windows.StandIn``: one head of one-hot channels, ``qkv`` three copies of
its input, ``proj`` the identity, scale 1, the non-fused path) and its own reshapes, window view and query
max-pool hand over, at its first matrix product, q (each query: the one-hot of the tokens it pools) and k^T;
the block's own ``forward`` on a stand-in (norms the identity, attention and MLP zero) gives its pooled
residual, the token order handed to the next block. A pooled query is placed on the coarse grid at the block
of fine tokens it pools (checked to be one whole ``q_stride`` block), its centre in pixels the mean of theirs;
a stage-0 token sits at its patch's centre, (r + 0.5) x the patch stride. The pooled residual's transport (the
rollout) is stated as each pooled token the mean of the fine tokens it max-pools (``query_from``).

Capture. timm's ``MaskUnitAttention`` computes softmax(q * scale @ k^T) over [B, heads, windows, Nq, Nk] (5-D)
or [B, heads, Nq, Nk] (global): on its non-fused path the probabilities are read as its own ``softmax`` returns
them (the only one in its forward), on its fused path side capture reads its one
``F.scaled_dot_product_attention`` call (softmax(q k^T * scale) from its very arguments, the real output kept)
and inline capture turns the non-fused path on for the session. transformers' ``HieraMaskUnitAttention`` is
eager only and returns its probabilities when asked (``output_attentions``): they are asked for and handed on,
the output unchanged. Either way the maps are handed on as [B * windows, heads, Nq, Nk], windows in the
model's order.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import Transport, WindowGeometry, pooling_transport, transport_centres
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily, check_blocks
from .common.hf import IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults
from .common.readers import read_fused_or_own, read_returned, read_softmax
from .common.timm import timm_data_config
from .common.windows import StandIn, identity, token_centres

#: channels of one-hot token numbers run through a block at a time (the geometry's memory: tokens x CHUNK)
CHUNK = 512
_MATMULS = (torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul)


def _zero(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.new_zeros(())


class _QueriesAndKeys(TorchFunctionMode):
    """Inside an attention's forward on one-hot channels: the first matrix product's operands are q * scale and
    k^T (recorded); the second (probabilities @ v) is answered with q itself, so the attention's own output code
    puts each query's one-hot where its output token goes."""

    def __init__(self, zero: bool = False) -> None:
        super().__init__()
        self.operands: list[tuple] = []
        self.zero = zero  # answer the second product with zeros instead (the block's residual alone)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _MATMULS:
            self.operands.append(args)
            if len(self.operands) == 2:
                q = self.operands[0][0]
                return torch.zeros_like(q) if self.zero else q
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Dialect:
    """Where timm's and transformers' Hiera keep what the geometry reads: the attention's heads / head size /
    output width / query stride / scale attributes, what its non-fused path needs, the block's modules replaced
    by the identity or zero on the stand-in, and how its attention's and its own outputs come back."""

    heads: str
    out_dim: str
    q_stride: str
    attention_extra: tuple[tuple[str, Any], ...]
    identities: tuple[str, ...]
    zeros: tuple[str, ...]
    attention_returns_tuple: bool
    #: the block's width attributes its forward reads, for a stand-in of ``c`` channels (transformers' layer pools
    #: its residual where its input and output widths differ, and views it at its output width)
    widths: Callable[[nn.Module, int], dict[str, int]] = lambda block, c: {}


TIMM = Dialect(heads="heads", out_dim="dim_out", q_stride="q_stride", attention_extra=(("fused_attn", False),),
               identities=("norm1", "proj", "norm2", "ls1", "ls2", "drop_path1", "drop_path2"),
               zeros=("mlp",), attention_returns_tuple=False)
HF = Dialect(heads="num_heads", out_dim="hidden_size_output", q_stride="query_stride", attention_extra=(),
             identities=("layernorm_before", "proj", "layernorm_after", "drop_path"), zeros=("mlp",),
             attention_returns_tuple=True,
             widths=lambda block, c: {"hidden_size": c if block.hidden_size == block.hidden_size_output else 0,
                                      "hidden_size_output": c})


def _triple(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x, x], dim=-1)


def _run_attention(attn: nn.Module, x: torch.Tensor, d: Dialect) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [windows, Nq, c], k [windows, Nk, c], the output [N_out, c]) of ``attn``'s own code on one-hot
    channels ``x`` [1, N, c] (one head of c channels, the module itself untouched)."""
    c = x.shape[-1]
    stand_in = StandIn(attn, qkv=_triple, proj=identity, scale=1.0, head_dim=c,
                       **{d.heads: 1, d.out_dim: c}, **dict(d.attention_extra))
    mode = _QueriesAndKeys()
    with mode:
        out = type(attn).forward(stand_in, x)
    out = out[0] if d.attention_returns_tuple else out
    if len(mode.operands) != 2:
        raise UnsupportedModelError(f"{type(attn).__name__}: its non-fused path made {len(mode.operands)} matrix "
                                    "products, not q k^T and then the probabilities times v; vitlens cannot read "
                                    "its windows.")
    q, kt = mode.operands[0]
    return q.reshape(-1, *q.shape[-2:]), kt.transpose(-1, -2).reshape(-1, kt.shape[-1], kt.shape[-2]), out[0]


class _ZeroAttention(StandIn):
    """The block's attention seen with its attributes (its query stride), answering zero."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        zero = args[0].new_zeros(())
        return (zero, None) if self.__dict__["_tuple"] else zero

    def __init__(self, attn: nn.Module, d: Dialect) -> None:
        super().__init__(attn, _tuple=d.attention_returns_tuple)


def _run_block(block: nn.Module, attn_out: torch.Tensor, x: torch.Tensor, d: Dialect) -> torch.Tensor:
    """The block's own forward on one-hot channels ``x`` [1, N, c], its norms the identity and its attention and
    MLP zero: its residual, pooled where it pools ([N_out, c'])."""
    replaced: dict[str, Any] = {name: identity for name in d.identities if getattr(block, name, None) is not None}
    replaced.update({name: _zero for name in d.zeros})
    replaced.update(d.widths(block, x.shape[-1]))
    out = inspect.unwrap(type(block).forward)(StandIn(block, attn=_ZeroAttention(block.attn, d), **replaced), x)
    return (out[0] if isinstance(out, tuple) else out)[0]


def _one_hot(n: int, start: int, stop: int) -> torch.Tensor:
    """[1, n, stop - start]: channel j the one-hot of position start + j (float32: 0 and 1, maxima and copies exact)."""
    x = torch.zeros(1, n, stop - start, dtype=torch.float32)
    x[0, torch.arange(start, stop), torch.arange(stop - start)] = 1.0
    return x


def _sets(parts: list[torch.Tensor], n: int) -> np.ndarray:
    """[..., n] bool: which of the n input positions each row's channels hold (parts: the chunks' channels)."""
    return np.concatenate([p.ne(0).numpy() for p in parts], axis=-1)[..., :n]


def _cells(sets: np.ndarray, tokens: np.ndarray, grid: tuple[int, int], stride: tuple[int, int],
           what: str) -> np.ndarray:
    """The cell of the grid pooled by ``stride`` that each row's positions fill ([rows]): each row's positions
    (input grid tokens ``tokens`` at them) must be exactly one whole ``stride`` block of the input grid."""
    h, w = grid
    sy, sx = stride
    k = sy * sx
    counts = sets.sum(1)
    if not (counts == k).all():
        raise UnsupportedModelError(f"{what}: a token holds {int(counts[counts != k][0])} input tokens, not the "
                                    f"{sy}x{sx} = {k} of its pooling; vitlens cannot place it.")
    held = np.sort(tokens[np.nonzero(sets)[1].reshape(-1, k)], axis=1)  # [rows, k] input grid tokens
    r, c = np.divmod(held[:, 0], w)
    want = ((r[:, None] + np.repeat(np.arange(sy), sx)[None]) * w + c[:, None] + np.tile(np.arange(sx), sy)[None])
    bad = (r % sy != 0) | (c % sx != 0) | (held != want).any(1)
    if bad.any():
        raise UnsupportedModelError(f"{what}: a token pools tokens {held[bad][0].tolist()} of the {h}x{w} grid, not "
                                    f"one {sy}x{sx} block; vitlens reads Hiera's 2-D max pools only.")
    return (r // sy) * (w // sx) + c // sx


def _pool_transport(sets: np.ndarray, tokens: np.ndarray, cells: np.ndarray, coarse: int, fine: int) -> Transport:
    """Each pooled token the mean of the fine tokens it max-pools (the rows' positions, read from the model)."""
    row, pos = np.nonzero(sets)
    rows, cols = cells[row].astype(np.int64), tokens[pos].astype(np.int64)
    weights = 1.0 / sets.sum(1)[row]
    order = np.lexsort((cols, rows))
    return Transport(rows[order], cols[order], weights[order], (coarse, fine))


def read_windows(unroll: Callable[[torch.Tensor], torch.Tensor], blocks: Sequence[tuple[int, nn.Module]],
                 grid: tuple[int, int], patch_stride: tuple[int, int], q_stride: tuple[int, int],
                 d: Dialect) -> list[WindowGeometry]:
    """Every block's ``WindowGeometry``, read through the model's own code (module docstring).

    Args:
        unroll: the model's unroll of [1, H * W, C] row-major tokens into its sequence order.
        blocks: (stage, block) of every block, first to last.
        grid: (H, W) the patch tokens' grid.
        patch_stride: (sy, sx) the patch embedding's stride in pixels.
        q_stride: (qy, qx) the query pooling's 2-D stride.
        d: the implementation's ``Dialect``.

    Returns:
        One ``WindowGeometry`` per block: "window" (mask units), "global", or "query-pooled window" /
            "query-pooled global" for a block that max-pools its queries.
    """
    h, w = grid
    n = h * w
    parts = [unroll(_one_hot(n, s, min(s + CHUNK, n))) for s in range(0, n, CHUNK)]
    order = _sets([p[0] for p in parts], n)  # [positions, grid tokens]
    if not (order.sum(1) == 1).all():
        raise UnsupportedModelError("Hiera's unroll did not place every patch token once; vitlens cannot read it.")
    tokens = order.argmax(1)  # the grid token at each sequence position
    centres = token_centres((h, w), patch_stride)
    stride = tuple(int(s) for s in patch_stride)
    out = []
    with torch.no_grad():
        for layer, (stage, block) in enumerate(blocks):
            what = f"block {layer + 1} (stage {stage + 1}, {type(block).__name__})"  # counted from 1, as the app
            attn = block.attn
            pooled = int(getattr(attn, d.q_stride)) > 1
            if pooled and int(getattr(attn, d.q_stride)) != math.prod(q_stride):
                raise UnsupportedModelError(f"{what}: its query stride {getattr(attn, d.q_stride)} is not the "
                                            f"model's {q_stride[0]}x{q_stride[1]}.")
            step = (q_stride[0], q_stride[1]) if pooled else (1, 1)
            n_in = tokens.size
            qs, ks, att, res = [], [], [], []
            for s in range(0, n_in, CHUNK):
                x = _one_hot(n_in, s, min(s + CHUNK, n_in))
                q, k, a = _run_attention(attn, x, d)
                qs.append(q)
                ks.append(k)
                att.append(a)
                res.append(_run_block(block, a, x, d)[:, : x.shape[-1]])  # a max|mean concat: its max half
            q_sets, k_sets, a_sets, r_sets = (_sets(p, n_in) for p in (qs, ks, att, res))
            if not np.array_equal(a_sets, r_sets):
                raise UnsupportedModelError(f"{what}: its attention's output tokens are not in the order of its "
                                            "(pooled) residual; vitlens cannot read it.")
            if not (k_sets.sum(-1) == 1).all():
                raise UnsupportedModelError(f"{what}: a key is not one input token; vitlens cannot read it.")
            nw, nq = q_sets.shape[:2]
            out_grid = (h // step[0], w // step[1])
            index = _cells(q_sets.reshape(nw * nq, -1), tokens, (h, w), step, what).reshape(nw, nq)
            keys = tokens[k_sets.argmax(-1)]  # [windows, Nk] input grid tokens
            next_tokens = _cells(r_sets, tokens, (h, w), step, what)
            stride = (stride[0] * step[0], stride[1] * step[1])
            allowed = np.ones((nw, nq, keys.shape[1]), dtype=bool)
            if pooled:
                move = _pool_transport(r_sets, tokens, next_tokens, out_grid[0] * out_grid[1], n_in)
                coarse = transport_centres(move, centres)
                g = WindowGeometry(stage=stage, grid=out_grid, stride_px=stride, index=index, allowed=allowed,
                                   kind="query-pooled " + ("global" if nw == 1 else "window"), key_index=keys,
                                   key_grid=(h, w), query_centres=coarse, key_centres=centres, input_grid=(h, w),
                                   query_from=move)
                centres = coarse
            else:
                if not np.array_equal(keys, index):
                    raise UnsupportedModelError(f"{what}: its keys are not its queries' tokens; vitlens cannot "
                                                "read it.")
                g = WindowGeometry(stage=stage, grid=out_grid, stride_px=stride, index=index, allowed=allowed,
                                   kind="global" if nw == 1 else "window", query_centres=centres)
            out.append(g)
            tokens, (h, w) = next_tokens, out_grid
    return out


def _by_window(emit: CaptureRequest) -> Callable[..., None]:
    """Hiera's probabilities [B, heads, windows, Nq, Nk] (global: [B, heads, Nq, Nk]) handed on as
    [B * windows, heads, Nq, Nk]."""
    def send(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        if probs.dim() == 5:
            probs = probs.transpose(1, 2).reshape(-1, probs.shape[1], *probs.shape[-2:])
        emit(layer, probs, rows)
    return send


def _softmax_of(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A non-fused ``MaskUnitAttention``'s own probabilities, as its one ``softmax`` returns them (the very tensor its
    output is computed from)."""
    read_softmax(attn, layer, capture, handles, capture.detach,
                 lambda n: f"{type(attn).__name__}'s non-fused forward made {n} softmax calls; vitlens reads one.")


class _TimmHieraFamily(StagedFamily):
    """What timm's Hiera and HieraDet share: blocks of one attention module (``attn``, with a ``fused_attn`` switch:
    side capture reads a fused module's one SDPA call, a non-fused one's own softmax; inline turns the non-fused path
    on for the session and reads its softmax), handed on as [B * windows, heads, Nq, Nk]; the patch convolution's
    filters and timm's data config."""

    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("norm1",)

    def check_block_classes(self, model: nn.Module, name: str, block_cls: type, attn_cls: type) -> None:
        """Refuse, in one line, a block that is not exactly ``block_cls`` with ``attn_cls``."""
        check_blocks(name, ((f"block {i}", b) for i, b in enumerate(model.blocks)), block_cls, (attn_cls,), "timm")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(_by_window(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, by_window, handles, inline=False, own=_softmax_of)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(_by_window(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, by_window, handles, inline=True, own=_softmax_of)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads side by side at the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


class TimmHiera(_TimmHieraFamily):
    """timm ``Hiera`` (``hiera_*``): mask-unit and global attention over its unrolled tokens, queries max-pooled at
    each pooling stage's first block (module docstring)."""

    name = "timm-hiera"
    summary = "timm Hiera (hiera_*)"
    reads = ("timm Hiera (hiera_*, timm.models.hiera): mask-unit (windowed) and global attention over its unrolled "
             "token order, query pooling between stages; attention distance in image pixels per block and stage, "
             "one query's window, rollout through the windows and the query pooling")
    names = ("timm names: hiera_tiny_224, hiera_small_abswin_256 (timm.list_models('hiera_*'))",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.hiera import Hiera

        return isinstance(model, Hiera)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models.hiera import HieraBlock, MaskUnitAttention, PatchEmbed

        if type(model.patch_embed) is not PatchEmbed or model.patch_embed.spatial_dims != 2 \
                or not model.patch_embed.reshape or len(model.patch_stride) != 2:
            raise UnsupportedModelError(f"{name!r}: vitlens reads 2-D image Hiera (one Conv2d patch embedding); this "
                                        f"one embeds {getattr(model.patch_embed, 'spatial_dims', '?')}-D patches.")
        if model.pos_embed_spatial is not None:
            raise UnsupportedModelError(f"{name!r}: separate spatial and temporal position tables (video Hiera); "
                                        "vitlens reads image Hiera.")
        self.check_block_classes(model, name, HieraBlock, MaskUnitAttention)

    def grid(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(g) for g in model.tokens_spatial_shape)  # type: ignore[return-value]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(g) * int(s) for g, s in zip(model.tokens_spatial_shape, model.patch_stride))  # type: ignore[return-value]

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, block) of every block (a block after the i-th stage end is in stage i + 1)."""
        return [(sum(1 for e in model.stage_ends if e < i), block) for i, block in enumerate(model.blocks)]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model),
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(s) for s in model.patch_stride),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(model.patch_embed.proj.out_channels), has_class_token=False,
            has_pos_embed=model.pos_embed is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        return read_windows(model.unroll, self.blocks(model), self.grid(model),
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in model.patch_stride),  # type: ignore[arg-type]
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in model.q_stride), TIMM)  # type: ignore[arg-type]

    def heads_of(self, block: nn.Module) -> int:
        return int(block.attn.heads)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        if model.pos_embed is None:
            return None
        if model.pos_embed_win is None:  # one learned row per stage-0 token, row-major
            return model.pos_embed.detach(), spec.grid
        # abs-win: what the model adds at each stage-0 token, its own sum of the interpolated global table and the
        # tiled window table (model._pos_embed on zeros)
        with torch.no_grad():
            zeros = model.pos_embed.new_zeros(1, spec.grid[0] * spec.grid[1], model.pos_embed.shape[1])
            return model._pos_embed(zeros).detach(), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "this Hiera was built without a learned absolute position table"


#: the transformers classes read (a backbone or the MAE pre-training model is refused)
HF_CLASSES = ("HieraModel", "HieraForImageClassification")


class HuggingFaceHiera(HuggingFaceFamily, StagedFamily):
    """transformers ``HieraModel`` / ``HieraForImageClassification`` (module docstring)."""

    name = "hf-hiera"
    summary = "Hugging Face Hiera"
    reads = ("Hugging Face transformers Hiera (HieraModel, HieraForImageClassification): mask-unit and global "
             "attention over the unrolled tokens, query pooling between stages; the windowed views as for timm's "
             "Hiera; needs transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a Hiera checkpoint, e.g. hf:facebook/hiera-tiny-224-in1k-hf",)
    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("layernorm_before",)
    hf_types = HfTypes(processors={"hiera": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD,
                                                              "bicubic")})
    model_classes = {"hiera": HF_CLASSES}
    base_attrs = ("hiera",)

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        modeling = self.modeling(model)
        cfg = model.config
        if len(cfg.patch_stride) != 2:
            raise UnsupportedModelError(f"{name!r}: vitlens reads 2-D image Hiera.")
        if float(getattr(cfg, "mask_ratio", 0.0) or 0.0) and getattr(self.base(model).embeddings, "is_mae", False):
            raise UnsupportedModelError(f"{name!r}: an MAE Hiera drops mask units at random; vitlens reads every "
                                        "token.")
        for i, (_s, layer) in enumerate(self.blocks(model)):
            if type(layer) is not modeling.HieraLayer or type(layer.attn) is not modeling.HieraMaskUnitAttention:
                raise UnsupportedModelError(
                    f"{name!r}: layer {i} is a {type(layer).__name__} with "
                    f"{type(getattr(layer, 'attn', None)).__name__}; vitlens reads transformers' HieraLayer with "
                    "HieraMaskUnitAttention exactly.")

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, layer) for s, stage in enumerate(self.base(model).encoder.stages) for layer in stage.layers]

    def grid(self, model: nn.Module) -> tuple[int, int]:
        cfg = model.config
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(i) // int(s) for i, s in zip(cfg.image_size, cfg.patch_stride))  # type: ignore[return-value]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = model.config
        size = tuple(int(s) for s in cfg.image_size)
        refuse_other_size(name, self.name, size, input_size)
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model),  # type: ignore[arg-type]
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(s) for s in cfg.patch_stride),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(cfg.embed_dim), has_class_token=False, has_pos_embed=True,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        cfg, base = model.config, self.base(model)
        unroll = self.modeling(model).unroll
        size = tuple(int(s) for s in cfg.image_size)
        stride = tuple(int(s) for s in cfg.patch_stride)

        def run(x: torch.Tensor) -> torch.Tensor:
            return unroll(x, image_shape=size, patch_stride=stride, schedule=base.unroll_schedule)

        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return read_windows(run, self.blocks(model), self.grid(model), stride,  # type: ignore[arg-type]
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in cfg.query_stride), HF)  # type: ignore[arg-type]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(_by_window(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            # its own probabilities, asked for (``output_attentions=True``) and handed on; the caller gets its output
            # unchanged and the probabilities only if it asked
            read_returned(attn, layer, by_window, handles, lambda out, asked: (out[0], out[1] if asked else None))

    install_inline = install_side  # eager only: the probabilities it returns are those its output is made from

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.base(model).embeddings.patch_embeddings.projection
        where = {id(mod): n for n, mod in model.named_modules()}
        return conv_filters(conv, where[id(conv)], "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return self.base(model).embeddings.position_embeddings.detach(), spec.grid



# --------------------------------------------------------------------------------------- SAM 2's Hiera (HieraDet)
def _hieradet_step(block: nn.Module, x: torch.Tensor, zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [windows, Nq, c], k [windows, Nk, c], the block's output [H', W', c]) of a HieraDet ``MultiScaleBlock``'s own
    forward on coded channels ``x`` [1, H, W, c] (``_coded``): its norms the identity, its MLP zero, its attention on
    a stand-in (one head of c channels, ``qkv`` three copies, ``proj`` the identity, scale 1, the non-fused path)
    whose probabilities times v is answered with q (``zero``: with zeros, the output then the residual alone)."""
    attn = block.attn
    stand_in = StandIn(attn, qkv=_triple, proj=identity, scale=1.0, num_heads=1, fused_attn=False)
    mode = _QueriesAndKeys(zero=zero)

    def attention(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return type(attn).forward(stand_in, t)

    replaced: dict[str, Any] = {name: identity for name in ("norm1", "proj", "norm2", "ls1", "ls2", "drop_path1",
                                                                "drop_path2")}
    out = type(block).forward(StandIn(block, attn=attention, mlp=_zero, **replaced), x)
    if len(mode.operands) != 2:
        raise UnsupportedModelError(f"{type(attn).__name__}: its non-fused path made {len(mode.operands)} matrix "
                                    "products, not q k^T and then the probabilities times v; vitlens cannot read "
                                    "its windows.")
    q, kt = mode.operands[0]
    return q.reshape(-1, *q.shape[-2:]), kt.transpose(-1, -2).reshape(-1, kt.shape[-1], kt.shape[-2]), out[0]


def _coded(h: int, w: int) -> tuple[torch.Tensor, int]:
    """[1, h, w, 5] each token's code (r + 1, c + 1, big - r, big - c, -1): under a max over tokens (a max pool)
    the first four give the members' bounding box and the last is 0 where padding (all zero) was among them."""
    big = h + w + 2
    r, c = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    return torch.stack([r + 1, c + 1, big - r, big - c, -torch.ones_like(r)], -1)[None], big


def _decode(v: np.ndarray, big: int, grid: tuple[int, int], step: tuple[int, int], what: str) -> np.ndarray:
    """[rows] the cell of the grid pooled by ``step`` each coded row ([rows, 5], ``_coded`` under max pools) stands
    for: its members' bounding box must be exactly one aligned ``step`` block of real tokens; a row of padding
    alone is -1."""
    h, w = grid
    sy, sx = step
    pad = v[:, 0] == 0
    r1, c1, r0, c0 = v[:, 0] - 1, v[:, 1] - 1, big - v[:, 2], big - v[:, 3]
    bad = ~pad & ((v[:, 4] != -1) | (r1 - r0 + 1 != sy) | (c1 - c0 + 1 != sx) | (r0 % sy != 0) | (c0 % sx != 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UnsupportedModelError(f"{what}: a token pools rows {r0[i]:.0f}-{r1[i]:.0f}, columns {c0[i]:.0f}-"
                                    f"{c1[i]:.0f} of the {h}x{w} grid{' and padding' if v[i, 4] != -1 else ''}, not "
                                    f"one {sy}x{sx} block; vitlens reads 2-D max pools of whole blocks only.")
    return np.where(pad, -1, (r0 // sy) * (w // sx) + c0 // sx).astype(np.int64)


def read_hieradet_windows(model: nn.Module, grid: tuple[int, int], patch_stride: tuple[int, int],
                          stages: Sequence[int]) -> list[WindowGeometry]:
    """Every HieraDet block's ``WindowGeometry``, read through its own ``forward`` on coded token positions of its
    input grid (row-major, [B, H, W, C] as the model keeps them; ``_coded``: five channels, so a 1024 px SAM 2
    encoder's 65536 tokens cost what its forward does): its padding to whole windows, its window partition, its
    query max-pool inside each window, its max-pooled residual and its window unpartition. A query or key is
    placed by the bounding box of the tokens it holds (one token; a pooled query: exactly one aligned 2x2 block).

    Args:
        model: a timm ``HieraDet``.
        grid: (H, W) the patch tokens' grid.
        patch_stride: (sy, sx) the patch embedding's stride in pixels.
        stages: the stage of every block.

    Returns:
        One ``WindowGeometry`` per block ("window", "global", "query-pooled window" / "query-pooled global"; padding
            queries and keys -1).
    """
    h, w = grid
    centres = token_centres((h, w), patch_stride)
    stride = tuple(int(s) for s in patch_stride)
    out = []
    with torch.no_grad():
        for layer, (stage, block) in enumerate(zip(stages, model.blocks)):
            what = f"block {layer + 1} (stage {stage + 1}, {type(block).__name__})"  # counted from 1, as the app
            pooled = block.attn.q_pool is not None
            step = (int(block.q_stride[0]), int(block.q_stride[1])) if pooled else (1, 1)
            x, big = _coded(h, w)
            q, k, both = _hieradet_step(block, x, zero=False)
            _q, _k, res = _hieradet_step(block, x, zero=True)
            out_grid = (int(res.shape[0]), int(res.shape[1]))
            index = _decode(q.reshape(-1, 5).numpy(), big, (h, w), step, what).reshape(q.shape[:2])
            keys = _decode(k.reshape(-1, 5).numpy(), big, (h, w), (1, 1), what).reshape(k.shape[:2])
            cells = _decode(res.reshape(-1, 5).numpy(), big, (h, w), step, what)
            if not np.array_equal(cells, np.arange(out_grid[0] * out_grid[1])):
                raise UnsupportedModelError(f"{what}: its output tokens are not its grid's in row-major order.")
            if not np.array_equal(_decode((both - res).reshape(-1, 5).numpy(), big, (h, w), step, what), cells):
                raise UnsupportedModelError(f"{what}: its attention's output tokens are not in the order of its "
                                            "(pooled) residual; vitlens cannot read it.")
            nw, nq = index.shape
            stride = (stride[0] * step[0], stride[1] * step[1])
            allowed = np.broadcast_to((keys >= 0)[:, None, :], (nw, nq, keys.shape[1])).copy()
            kind = "global" if nw == 1 and (index >= 0).all() else "window"
            if pooled:
                move = pooling_transport((h, w), step, step, (0, 0), coarse=out_grid)
                coarse = transport_centres(move, centres)
                g = WindowGeometry(stage=stage, grid=out_grid, stride_px=stride, index=index, allowed=allowed,
                                   kind="query-pooled " + kind, key_index=keys, key_grid=(h, w), query_centres=coarse,
                                   key_centres=centres, input_grid=(h, w), query_from=move)
                centres = coarse
            else:
                if not np.array_equal(keys, index):
                    raise UnsupportedModelError(f"{what}: its keys are not its queries' tokens; vitlens cannot "
                                                "read it.")
                g = WindowGeometry(stage=stage, grid=out_grid, stride_px=stride, index=index, allowed=allowed,
                                   kind=kind, query_centres=centres)
            out.append(g)
            h, w = out_grid
    return out


class TimmHieraDet(_TimmHieraFamily):
    """timm ``HieraDet`` (SAM 2's Hiera image encoder, ``sam2_hiera_*``, ``hieradet_*``): windowed (padded to whole
    windows) and global attention on a row-major token grid, queries max-pooled 2x2 inside each window at each
    pooling stage's first block (``read_hieradet_windows``)."""

    name = "timm-hieradet"
    summary = "timm SAM 2 Hiera (sam2_hiera_*)"
    reads = ("timm HieraDet, SAM 2's Hiera image encoder (sam2_hiera_*, hieradet_*, timm.models.hieradet_sam2): "
             "windowed (padded) and global attention, query pooling inside the windows between stages; the "
             "windowed views as for Hiera")
    names = ("timm names: sam2_hiera_tiny, hieradet_small (timm.list_models('sam2_hiera_*'))",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.hieradet_sam2 import HieraDet

        return isinstance(model, HieraDet)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models.hieradet_sam2 import HieraPatchEmbed, MultiScaleAttention, MultiScaleBlock

        if type(model.patch_embed) is not HieraPatchEmbed:
            raise UnsupportedModelError(f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens "
                                        "reads HieraDet's own HieraPatchEmbed (one convolution).")
        self.check_block_classes(model, name, MultiScaleBlock, MultiScaleAttention)

    def image_size(self, model: nn.Module, input_size: tuple[int, int] | None = None) -> tuple[int, int]:
        if input_size is not None:
            return tuple(int(s) for s in input_size)  # type: ignore[return-value]  # 2 ints (mypy: tuple[int, ...])
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(s) for s in (getattr(model, "pretrained_cfg", None) or {}).get(  # type: ignore[return-value]
            "input_size", (3, 1024, 1024))[-2:])

    def grid(self, model: nn.Module, size: Sequence[int]) -> tuple[int, int]:
        conv = model.patch_embed.proj
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple((int(n) + 2 * int(p) - int(k)) // int(st) + 1  # type: ignore[return-value]
                     for n, p, k, st in zip(size, conv.padding, conv.kernel_size, conv.stride))

    def stages(self, model: nn.Module) -> list[int]:
        return [sum(1 for e in model.stage_ends if e < i) for i in range(len(model.blocks))]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model, input_size)
        conv = model.patch_embed.proj
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model, size),
            stride_px=tuple(int(s) for s in conv.stride),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(conv.out_channels), has_class_token=False, has_pos_embed=True,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        conv = model.patch_embed.proj
        return read_hieradet_windows(model, self.grid(model, input_hw),
                                     # the ignore below: 2 ints (mypy: tuple[int, ...])
                                     tuple(int(s) for s in conv.stride), self.stages(model))  # type: ignore[arg-type]

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return list(zip(self.stages(model), model.blocks))

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        # what the model adds at each stage-0 token: its interpolated global table plus the tiled window table
        with torch.no_grad():
            zeros = model.pos_embed.new_zeros(1, *spec.grid, model.pos_embed.shape[1])
            return model._pos_embed(zeros).reshape(1, spec.grid[0] * spec.grid[1], -1).detach(), spec.grid


register(TimmHiera())
register(HuggingFaceHiera())
register(TimmHieraDet())
