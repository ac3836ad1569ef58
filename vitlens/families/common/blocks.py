"""What the families of models in stages share (Swin, MViT v2, PVT, Hiera, SAM / ViTDet): their blocks listed with
their stage (``StagedFamily``), and the one-line refusal of a block that is not exactly the class a family reads
(``check_blocks``).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import nn

from ...errors import UnsupportedModelError
from ..base import Family


class StagedFamily(Family):
    """A family whose blocks sit in stages: ``blocks`` lists (stage, block) of every block, first to last; each
    block's attention module is ``attention_of(block)`` (its ``attn``) with ``heads_of(block)`` heads (its
    ``num_heads``): what ``attention_modules`` and ``block_heads`` (the windowed views) read."""

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, block) of every block, first to last."""
        raise NotImplementedError

    def attention_of(self, block: nn.Module) -> nn.Module:
        """A block's attention module (its parent is the block: ``LoadedModel.block_names``)."""
        return block.attn

    def heads_of(self, block: nn.Module) -> int:
        """A block's attention heads."""
        return int(self.attention_of(block).num_heads)

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [self.attention_of(block) for _s, block in self.blocks(model)]

    def block_heads(self, model: nn.Module) -> list[int]:
        """The heads of every block's attention, first block first (the windowed views)."""
        return [self.heads_of(block) for _s, block in self.blocks(model)]


def check_blocks(name: str, blocks: Iterable[tuple[str, nn.Module]], block_cls: type, attn_classes: tuple[type, ...],
                 source: str, attn_attr: str = "attn") -> None:
    """Refuse, in one line, the first block that is not exactly ``block_cls`` with an ``attn_attr`` child of exactly
    one of ``attn_classes`` (a subclass may compute its attention otherwise).

    Args:
        name: the model's name, for the message.
        blocks: (the block in words, e.g. "stage 0 block 1", the block) of every block.
        block_cls: the block class the family reads.
        attn_classes: the attention classes it reads.
        source: whose classes they are, in words ("timm", "transformers", "timm.models.mvitv2").
        attn_attr: the block's child that is its attention.

    Raises:
        UnsupportedModelError: naming the block, its classes and the ones read.
    """
    for where, block in blocks:
        attn = getattr(block, attn_attr, None)
        if type(block) is not block_cls or type(attn) not in attn_classes:
            raise UnsupportedModelError(
                f"{name!r}: {where} is a {type(block).__name__} with {type(attn).__name__}; vitlens reads {source}'s "
                f"{block_cls.__name__} with {' or '.join(c.__name__ for c in attn_classes)} exactly and refuses "
                "others.")


__all__ = ["StagedFamily", "check_blocks"]
