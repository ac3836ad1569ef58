"""The kinds of model vitlens reads (``ModelSpec.kind``), as one registry of ``Kind`` records: the one source
of what a kind is. Nothing else names a kind; everything that depends on it reads its record (``kind_of``):

- ``ModelSpec.describe`` words it (``Kind.label``), a survey's tables name it (``Kind.word``);
- the streaming engine hands its blocks' maps only to the consumers that say they read them (``Kind.reader``,
  a consumer's flag such as ``reads_windows``; ``Kind.reads``) and refuses the others in one line
  (``Kind.maps``, ``Kind.use``); a view builds the consumer that reads them (``Kind.reader_among`` over the
  view's consumers), so the views defined for a kind follow from the consumers that exist;
- a reading defined for a ViT's one sequence of tokens refuses it in its own words (``refuse_other_maps``:
  ``Kind.refusal``), and so do the attribution methods (``Kind.method_refusal``) and CKA by block
  (``Kind.blocks_refusal``);
- which attribution methods are defined for it follows from what it has: a ViT's [B, heads, T, T] maps over one
  sequence (``Kind.token_attention``: no ``reader``), a layer the CAMs read (``Kind.cam_layer``), stages of
  coarser grids (``Kind.stages``).

A new kind is one ``register_kind(Kind(...))`` in the module that brings it (its family and the consumers that read
its maps, flagged with its ``reader``); a test registers one for a while with ``registered_kind``. This module
imports nothing of vitlens but its errors, so every layer may read it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, TypeVar

from .errors import UnsupportedModelError

T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """One kind of model: what its attention maps are and how vitlens words, reads and refuses it.

    Attributes:
        name: the ``ModelSpec.kind`` value (what results and manifests store).
        label: how ``ModelSpec.describe`` words it ("hybrid (CNN + ViT)").
        word: its short word in a survey's tables ("hybrid"); default the name.
        reader: the consumer flag (an ``AttentionConsumer`` attribute, e.g. "reads_windows") that says a consumer
            reads its blocks' maps; "" for a ViT's [B, heads, T, T] maps over one sequence, which every consumer
            reads.
        maps: what its blocks' maps are, in words, completing "{name} ..." in the stream's refusal of a consumer
            without ``reader``.
        use: what reads them instead, in that refusal ("the windowed views").
        refusal: why a reading defined for a ViT's one sequence of tokens refuses it (``refuse_other_maps``), with
            the fields {what} (the reading) and {name} (the model); "" for a kind such readings read.
        method_refusal: why an attribution method outside its kinds is not defined for it, with {method} and
            {name}; "" for the generic sentence (``attribution.methods.refusal``).
        blocks_refusal: why CKA by block does not read its blocks' outputs ("" : it reads them).
        pool_refusal: why rollout from an attention pool does not apply, with {name} ("" : it may).
        cam_layer: its family names the layer the CAMs read (``Family.cam_layer``, or the last block's norm).
        stages: its tokens sit on stages of coarser grids, each block's from its family's windows: the CAMs map a
            stage's grid, the spec records its heads by stage (``ModelSpec.stage_heads``).
        class_layers: its last blocks attend from the class token alone (CaiT's class-attention layers): the views
            read its self-attention blocks, with no prefix token among their keys.
        stem: what makes its tokens where Fig. 11's contrast reads it: "cnn" (a hybrid's CNN feature map) or
            "patch" (a plain ViT's patch embedding); "" for a kind outside that contrast.
        plural: its name for two models of it in a comparison's reading ("plain ViTs"); default the word + "s".
        clips: its input is a clip [B, frames, 3, H, W], not an image: the methods of one image's pixels
            (``takes_images``) are not defined for it, the views of clips (``takes_clips``) are.
    """

    name: str
    label: str
    word: str = ""
    reader: str = ""
    maps: str = ""
    use: str = ""
    refusal: str = ""
    method_refusal: str = ""
    blocks_refusal: str = ""
    pool_refusal: str = ""
    cam_layer: bool = True
    stages: bool = False
    class_layers: bool = False
    stem: str = ""
    plural: str = ""
    clips: bool = False

    @property
    def short(self) -> str:
        """Its word in tables (``word``, else the name)."""
        return self.word or self.name

    @property
    def token_attention(self) -> bool:
        """Whether its blocks' maps are a ViT's [B, heads, T, T] over one sequence (no ``reader`` needed)."""
        return not self.reader

    @property
    def cnn_stem(self) -> bool:
        """Whether a CNN makes its tokens (a hybrid: ``stem == "cnn"``)."""
        return self.stem == "cnn"

    def reads(self, consumer: Any) -> bool:
        """Whether a consumer reads this kind's maps: every consumer reads a ViT's, another kind's only a consumer
        whose ``reader`` flag is True or that reads every kind (``reads_every_kind``: it reads no map's shape,
        e.g. the logits alone).

        Args:
            consumer: an attention consumer or its class.

        Returns:
            Whether it reads them.
        """
        return (not self.reader or bool(getattr(consumer, "reads_every_kind", False))
                or bool(getattr(consumer, self.reader, False)))

    def reader_among(self, consumers: Sequence[T]) -> T | None:
        """The first of ``consumers`` that reads this kind's maps (``reads``).

        Args:
            consumers: a view's consumer classes, the one for a ViT's maps first (it reads every kind's maps that
                every consumer reads).

        Returns:
            That consumer, or None when none reads them.
        """
        return next((c for c in consumers if self.reads(c)), None)


_KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    """Add ``kind`` to the registry, which every list of kinds, every refusal and every per-kind reading reads.

    Args:
        kind: the record.

    Returns:
        The record (so a module may keep it as a constant).

    Raises:
        ValueError: a kind of that name is registered already.
    """
    if kind.name in _KINDS:
        raise ValueError(f"a kind of model named {kind.name!r} is registered already.")
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> Kind:
    """Remove a kind from the registry (a test's kind, once it is done: ``registered_kind``).

    Args:
        name: the kind's name.

    Returns:
        Its record.
    """
    return _KINDS.pop(name)


@contextlib.contextmanager
def registered_kind(kind: Kind) -> Iterator[Kind]:
    """``kind`` registered for the ``with`` block and removed after it, whatever happens (tests).

    Args:
        kind: the record.

    Yields:
        The record.
    """
    register_kind(kind)
    try:
        yield kind
    finally:
        unregister_kind(kind.name)


def all_kinds() -> tuple[Kind, ...]:
    """Every registered kind.

    Returns:
        The records, in the order registered (the built-in ones first).
    """
    return tuple(_KINDS.values())


def kind_names() -> tuple[str, ...]:
    """Every registered kind's name.

    Returns:
        The ``ModelSpec.kind`` values, in the order registered.
    """
    return tuple(_KINDS)


def _kind_name(model: Any, missing: Any = None) -> Any:
    """The kind's name of a loaded model, a spec, or a name (what ``find_kind`` and ``kind_of`` take); ``missing``
    for an object without one."""
    return model if isinstance(model, str) else getattr(getattr(model, "spec", model), "kind", missing)


def find_kind(model: Any) -> Kind | None:
    """The kind of a model, as ``kind_of`` reads it, where its name may not be registered.

    Args:
        model: a loaded model, its spec, or a ``ModelSpec.kind`` value.

    Returns:
        The registered record, or None.
    """
    name = _kind_name(model)
    return _KINDS.get(name) if isinstance(name, str) else None


def kind_of(model: Any) -> Kind:
    """The ``Kind`` of a ``LoadedModel``, a ``ModelSpec`` or a kind's name.

    Args:
        model: a loaded model, its spec, or a ``ModelSpec.kind`` value.

    Returns:
        The registered record.

    Raises:
        UnsupportedModelError: the kind is not registered (naming those that are).
    """
    kind = find_kind(model)
    if kind is None:
        raise UnsupportedModelError(f"No kind of model is called {_kind_name(model, model)!r}; vitlens reads "
                                    f"{', '.join(_KINDS)}.")
    return kind


def refuse_other_maps(spec: Any, what: str) -> None:
    """Refuse, in one line, a reading defined for a ViT's one global attention over one sequence of tokens when the
    model's kind has other maps (its ``Kind.refusal``: windows on stages of coarser grids, or blocks of two kinds),
    naming what to use. A kind such readings read, or one not registered, passes.

    Args:
        spec: the model's ``ModelSpec``.
        what: the reading refused, in words ("attention_maps", "head importance ...").

    Raises:
        UnsupportedModelError: the model's kind has a ``refusal``.
    """
    kind = find_kind(spec)
    if kind is not None and kind.refusal:
        raise UnsupportedModelError(kind.refusal.format(what=what, name=spec.name))


# ---------------------------------------------------------------- the built-in kinds
#: a ViT: a patch embedding's tokens, every block's attention over one sequence
VIT = register_kind(Kind("vit", "ViT", "ViT", stem="patch", plural="plain ViTs"))
#: a hybrid: a CNN's feature map as 1x1 tokens, then a ViT's blocks
HYBRID = register_kind(Kind("hybrid", "hybrid (CNN + ViT)", "hybrid", stem="cnn", plural="hybrids"))
#: windowed attention in stages of coarser grids (Swin, SAM / ViTDet, Hiera, MViT v2, PVT)
HIERARCHICAL = register_kind(Kind(
    "hierarchical", "hierarchical (windowed stages)", "hierarchical", reader="reads_windows",
    maps="attends within windows (a hierarchical model: its blocks' maps are [B * windows, heads, N, N] on each "
         "stage's grid)",
    use="the windowed views",
    refusal="{what} reads a ViT's attention over one token grid; {name} attends within windows on stages of coarser "
            "grids (hierarchical), so it is refused rather than read wrong. Its windowed views are exact: "
            "vl.attention_distance, vl.attention_rollout, and one query's window from "
            "vitlens.views.windowed_rollout.window_maps / query_window_attention.",
    method_refusal="{method} reads a ViT's token-by-token attention over one patch grid (its [B, heads, T, T] maps), "
                   "which {name} does not have: it is hierarchical (windowed attention on stages of coarser grids)",
    blocks_refusal="its blocks hand on token grids that shrink from stage to stage (hierarchical; timm's Swin hands "
                   "them on as [images, H, W, width] maps), which this comparison does not read: it reads every "
                   "block's output as a ViT's tokens on one grid",
    stages=True))
#: a ViT with class-attention layers (CaiT): self-attention over the patches alone, then the class token's one query
CLASS_ATTENTION = register_kind(Kind(
    "class-attention", "ViT with class-attention layers (CaiT)", reader="reads_class_attention",
    maps="has self-attention blocks over the patches alone and then class-attention layers (the class token's one "
         "query: [B, heads, 1, 1 + N] maps)",
    use="its views",
    refusal="{what} reads a ViT whose every block attends over the same tokens; {name} has self-attention blocks "
            "over the patches alone and then class-attention layers (the class token's one query), so it is refused "
            "rather than read wrong. Its views are exact: vl.attention_distance (the self-attention blocks), "
            "vl.attention_rollout (from the class token through both kinds), and every block's maps from "
            "vl.capture_attention ([B, heads, N, N], then [B, heads, 1, 1 + N]).",
    method_refusal="{method} reads a ViT whose every block attends over the same tokens, and {name} has "
                   "self-attention blocks over the patches alone, then class-attention layers (CaiT)",
    blocks_refusal="its self-attention blocks hand on the patch tokens alone and its class-attention layers the "
                   "class token alone, so no one token policy (mean, cls, patches) reads every block",
    pool_refusal="{name} reads its class token through class-attention layers, not an attention pool; rollout starts "
                 "from that class token (source=None).",
    cam_layer=False, class_layers=True))

#: a video transformer (issue 50): tokens in space and time (frames or tubelets, each a grid of cells), one joint map
#: per block (VideoMAE, ViViT, V-JEPA 2) or a temporal and a spatial map per block (TimeSformer's divided attention)
VIDEO = register_kind(Kind(
    "space-time", "video (space-time tokens)", "video", reader="reads_clips",
    maps="attends over tokens in space and time (a video model: its maps are over the cells of every frame or "
         "tubelet, or divided into temporal and spatial maps)",
    use="the space-time views",
    refusal="{what} reads a ViT's attention over one image's token grid; {name} is a video model (tokens in space and "
            "time), so it is refused rather than read wrong. Its space-time views are exact: vl.attention_distance "
            "and vl.attention_rollout of a clip [B, frames, 3, H, W], and every block's maps from "
            "vl.capture_attention.",
    method_refusal="{method} is defined for one image (its pixels or its token grid), and {name} is a video model "
                   "(its input is a clip of frames)",
    blocks_refusal="its blocks hand on tokens in space and time (a video model), which this comparison does not "
                   "read as one image's tokens",
    pool_refusal="{name} is a video model; its rollout starts from the class token, or the mean of the cells "
                 "(source=None).",
    cam_layer=False, plural="video models", clips=True))


# what attribution methods and views may need of a kind (``Method.for_kind``)
def takes_images(kind: Kind) -> bool:
    """Defined for every kind whose input is an image (a method of the input's pixels alone: any differentiable
    model of one image; a video model's clip is not one).

    Args:
        kind: the kind's record.

    Returns:
        not ``Kind.clips``.
    """
    return not kind.clips


def has_token_attention(kind: Kind) -> bool:
    """Defined where every block's maps are a ViT's [B, heads, T, T] over one sequence.

    Args:
        kind: the kind's record.

    Returns:
        ``Kind.token_attention``.
    """
    return kind.token_attention


def has_cam_layer(kind: Kind) -> bool:
    """Defined where the family names the layer the CAMs read.

    Args:
        kind: the kind's record.

    Returns:
        ``Kind.cam_layer``.
    """
    return kind.cam_layer


def takes_clips(kind: Kind) -> bool:
    """Defined where the model reads clips (the space-time views and the video weight views).

    Args:
        kind: the kind's record.

    Returns:
        ``Kind.clips``.
    """
    return kind.clips


__all__ = ["CLASS_ATTENTION", "HIERARCHICAL", "HYBRID", "Kind", "VIDEO", "VIT", "all_kinds",
           "find_kind", "has_cam_layer", "has_token_attention", "kind_names", "kind_of", "refuse_other_maps",
           "register_kind", "registered_kind", "takes_clips", "takes_images", "unregister_kind"]
