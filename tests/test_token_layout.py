"""The declared token layout (issue 48): canonical order, exact permutation, refusals."""
from __future__ import annotations

import pytest
import torch

from vitlens.core.tokens import (Cell, PrefixToken, TokenLayout, image_slices, merge_block_layout, packed_layout,
                                 standard_layout)
from vitlens.errors import InvalidParameterError


def _softmax_attention(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    return torch.softmax((x @ wq) @ (x @ wk).T / x.shape[-1] ** 0.5, dim=-1)


def test_standard_layout_needs_no_permutation():
    lay = standard_layout((2, 3), ("class", "register"))
    assert lay.is_standard and lay.num_prefix == 2 and lay.canonical_order() == list(range(8))


def test_class_token_last_maps_to_the_same_attention_as_class_first():
    # Attention without position terms is equivariant: the model that holds its class token last gives, once
    # permuted, exactly the matrix of the same tokens with the class token first.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=g)  # class token + 2x3 cells, canonical order
    wq, wk = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    want = _softmax_attention(x, wq, wk)
    last = standard_layout((2, 3), ("class",), prefix_last=True)
    assert not last.is_standard and last.canonical_order() == [6, 0, 1, 2, 3, 4, 5]
    x_model = torch.cat([x[1:], x[:1]])  # the model's own order: cells, then the class token
    got = last.to_canonical(_softmax_attention(x_model, wq, wk))
    assert torch.equal(got, _softmax_attention(x_model, wq, wk)[[6, 0, 1, 2, 3, 4, 5]][:, [6, 0, 1, 2, 3, 4, 5]])
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_detection_tokens_after_the_patches():
    lay = standard_layout((2, 2), ("class",))
    yolos = TokenLayout(lay.tokens + (PrefixToken("detection"),) * 2, lay.grids)
    assert yolos.num_prefix == 3 and yolos.canonical_order() == [0, 5, 6, 1, 2, 3, 4]
    assert "detection at 5" in yolos.describe() and "permuted" in yolos.describe()


def test_merge_block_order_known_answer():
    lay = merge_block_layout((2, 4))
    # blocks (0,0)-(1,1) then (0,2)-(1,3): the model's positions 0,1,4,5 form row 0
    assert [(t.row, t.col) for t in lay.tokens] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert lay.canonical_order() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(InvalidParameterError, match="merge blocks"):
        merge_block_layout((3, 4))


def test_packed_images_slices():
    lay = packed_layout(((2, 2), (1, 3)))
    assert lay.canonical_order() == list(range(7)) and not lay.is_standard
    assert image_slices(lay) == [slice(0, 4), slice(4, 7)]


def test_count_mismatch_is_refused_in_one_line():
    lay = standard_layout((4, 4), ("class",))
    with pytest.raises(InvalidParameterError, match="has 17 tokens .* runs over 21"):
        lay.to_canonical(torch.zeros(1, 21, 21))


def test_a_layout_must_hold_each_cell_once():
    with pytest.raises(InvalidParameterError, match="exactly once"):
        TokenLayout((Cell(0, 0, 0), Cell(0, 0, 0)), ((1, 2),))
    with pytest.raises(InvalidParameterError, match="kind"):
        PrefixToken("banana")
