"""A block's token layout, declared: what each token of the attention sequence is (issue 48).

Serves every view that reads token positions (distance, Fig. 7 right / Fig. 11; rollout and maps, Fig. 6 and
Fig. 7 centre): the views read tokens in the canonical order -- prefix tokens first, then each image's cells
row-major, images in order. A model whose own order differs (YOLOS's detection tokens after the patches,
Llama 4's class token last, Qwen3-VL's 2x2 merge blocks, Pixtral's packed images) declares its order as a
``TokenLayout``; ``to_canonical`` permutes a probability matrix's rows and columns into the canonical order, an
exact relabelling (each entry moves, none is changed), so the views stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError

PREFIX_KINDS = ("class", "register", "distillation", "detection", "other")


@dataclass(frozen=True)
class PrefixToken:
    """A token that is no image cell, e.g. ``PrefixToken("class")``; ``kind`` one of ``PREFIX_KINDS``."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in PREFIX_KINDS:
            raise InvalidParameterError(f"prefix token kind {self.kind!r} is not one of {PREFIX_KINDS}")


@dataclass(frozen=True)
class Cell:
    """An image cell: the token of image ``image`` at (``row``, ``col``) of that image's grid."""

    image: int
    row: int
    col: int


Token = PrefixToken | Cell


@dataclass(frozen=True)
class TokenLayout:
    """Each token of a block's attention sequence, in the model's own order.

    Attributes:
        tokens: one ``PrefixToken`` or ``Cell`` per position of the sequence.
        grids: (rows, cols) of each image's grid, image 0 first; every cell of every grid appears once.
    """

    tokens: tuple[Token, ...]
    grids: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        cells = [t for t in self.tokens if isinstance(t, Cell)]
        expected = {(i, r, c) for i, (gh, gw) in enumerate(self.grids) for r in range(gh) for c in range(gw)}
        seen = {(t.image, t.row, t.col) for t in cells}
        if len(seen) != len(cells) or seen != expected:
            raise InvalidParameterError(
                f"a token layout must hold each cell of its grids {list(self.grids)} exactly once; "
                f"it holds {len(cells)} cells ({len(seen)} distinct) for {len(expected)} expected")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_prefix(self) -> int:
        """Tokens that are no image cell, wherever they stand."""
        return sum(isinstance(t, PrefixToken) for t in self.tokens)

    def prefix_labels(self) -> tuple[str, ...]:
        """The prefix tokens' names in canonical order ("class", "detection 1", ...): a kind held once unnumbered."""
        kinds = [t.kind for t in self.tokens if isinstance(t, PrefixToken)]
        seen: dict[str, int] = {}
        out = []
        for k in kinds:
            seen[k] = seen.get(k, 0) + 1
            out.append(k if kinds.count(k) == 1 else f"{k} {seen[k]}")
        return tuple(out)

    def canonical_order(self) -> list[int]:
        """The model's position of each canonical token: prefix tokens in their own order, then each image's cells
        row-major, images in order. ``x[..., order]`` puts a sequence into canonical order."""
        prefix = [i for i, t in enumerate(self.tokens) if isinstance(t, PrefixToken)]
        cell_at = {i: t for i, t in enumerate(self.tokens) if isinstance(t, Cell)}
        cells = sorted(cell_at, key=lambda i: (cell_at[i].image, cell_at[i].row, cell_at[i].col))
        return prefix + cells

    @property
    def is_standard(self) -> bool:
        """Whether the model's order is already canonical and holds one image (no permutation needed)."""
        return len(self.grids) == 1 and self.canonical_order() == list(range(len(self.tokens)))

    def describe(self) -> str:
        """One line for a spec's ``describe()``: where the prefix tokens stand and the images' grids."""
        kinds = [(i, t.kind) for i, t in enumerate(self.tokens) if isinstance(t, PrefixToken)]
        where = ", ".join(f"{k} at {i}" for i, k in kinds) or "no prefix tokens"
        grids = ", ".join(f"{gh}x{gw}" for gh, gw in self.grids)
        order = "prefix then row-major" if self.is_standard else "permuted to prefix then row-major"
        return f"token layout: {len(self.tokens)} tokens ({where}; grids {grids}); {order}"

    def check_count(self, n_tokens: int) -> None:
        """Refuse a layout whose length is not the attention call's token count, in one line."""
        if n_tokens != len(self.tokens):
            raise InvalidParameterError(
                f"the stated token layout has {len(self.tokens)} tokens ({self.num_prefix} prefix + cells of grids "
                f"{list(self.grids)}), but the model's attention runs over {n_tokens}; state a layout of "
                f"{n_tokens} tokens")

    def to_canonical(self, probs: torch.Tensor) -> torch.Tensor:
        """Permute the last two axes (query, key) of attention probabilities into canonical order; exact."""
        self.check_count(probs.shape[-1])
        order = torch.as_tensor(self.canonical_order(), device=probs.device)
        return probs.index_select(-2, order).index_select(-1, order)


def standard_layout(grid: tuple[int, int], prefix: tuple[str, ...] = ("class",), *,
                    prefix_last: bool = False) -> TokenLayout:
    """One image's layout: the given prefix tokens before (or, ``prefix_last``, after) the row-major cells."""
    gh, gw = grid
    cells: list[Token] = [Cell(0, r, c) for r in range(gh) for c in range(gw)]
    pre: list[Token] = [PrefixToken(k) for k in prefix]
    return TokenLayout(tuple(cells + pre if prefix_last else pre + cells), ((gh, gw),))


def merge_block_layout(grid: tuple[int, int], merge: int = 2) -> TokenLayout:
    """One image's cells in ``merge`` x ``merge`` block order (Qwen-VL): blocks row-major, each block row-major."""
    gh, gw = grid
    if gh % merge or gw % merge:
        raise InvalidParameterError(f"grid {gh}x{gw} is not a whole number of {merge}x{merge} merge blocks")
    tokens = tuple(Cell(0, br * merge + r, bc * merge + c) for br in range(gh // merge)
                   for bc in range(gw // merge) for r in range(merge) for c in range(merge))
    return TokenLayout(tokens, ((gh, gw),))


def packed_layout(grids: tuple[tuple[int, int], ...]) -> TokenLayout:
    """Several images packed in one sequence (Pixtral): each image's cells row-major, images in order."""
    tokens = tuple(Cell(i, r, c) for i, (gh, gw) in enumerate(grids) for r in range(gh) for c in range(gw))
    return TokenLayout(tokens, tuple(grids))


@dataclass(frozen=True)
class ImageTokens:
    """Where one image's tokens stand in the maps [B, heads, T, T] of a forward of several images (``vl.analyze_each``):
    batch row ``row``, positions ``tokens`` (its cells row-major, its queries' whole mass on them), grid ``grid``.
    Pixtral's pack: row 0, each image's slice; Siglip2's padded batch: row i, its first cells."""

    row: int
    tokens: slice
    grid: tuple[int, int]


def packed_images(layout: TokenLayout) -> list[ImageTokens]:
    """Each image of a one-sequence pack (``packed_layout``, no prefix tokens): row 0, its slice, its grid."""
    return [ImageTokens(0, rows, grid) for rows, grid in zip(image_slices(layout), layout.grids)]


def image_slices(layout: TokenLayout) -> list[slice]:
    """Each image's cells in canonical order (after the prefix tokens): a packed result's rows per image."""
    out, start = [], layout.num_prefix
    for gh, gw in layout.grids:
        out.append(slice(start, start + gh * gw))
        start += gh * gw
    return out
