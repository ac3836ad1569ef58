"""The inline capture's memory layout (issue 52, the cold call): the probabilities' rows padded to an aligned stride
where the native softmax pass reads them, and the block's q/k/v projection, keys, values and output made in the
session's workspace. Only where numbers live changes: each is checked against the layout it replaces and against
float64 within the bound its rounding allows."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from vitlens.core import attention as A
from vitlens.core import native

U = 2.0 ** -24  # float32's unit roundoff
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) to build the kernels")


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "native-cache-aligned"))


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def test_the_padded_stride_rule(monkeypatch):
    """Padded to a multiple of 16 floats only where the native pass runs (``compiled_wanted``); an aligned T stays."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    assert A.padded_row_stride(197, cpu) == 208 and A.padded_row_stride(4097, cpu) == 4112
    assert A.padded_row_stride(208, cpu) == 208
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    assert A.padded_row_stride(4097, cpu) == 4097
    monkeypatch.setenv(native.COMPILE_ENV, "auto")
    assert A.padded_row_stride(native.COMPILE_MIN_TOKENS - 1, cpu) == native.COMPILE_MIN_TOKENS - 1  # below it: torch's
    assert A.padded_row_stride(197, cpu) == 208  # a 224 px /16 ViT: the native pass, aligned rows
    assert A.padded_row_stride(native.COMPILE_MIN_TOKENS + 1, cpu) % A.ROW_ALIGN == 0


@needs_compiler
def test_the_softmax_pass_on_padded_rows_is_the_contiguous_one(monkeypatch):
    """The same kernel row by row: bit-identical probabilities and taps, and the padding never read or written."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    b, h, r, t, ld = 2, 3, 5, 37, 48
    scores = torch.randn(b, h, r, t, generator=torch.Generator().manual_seed(1)) * 4
    padded = torch.full((b, h, r, ld), float("nan"))
    padded[..., :t] = scores
    block = padded[..., :t]
    taps = [native.SoftmaxTaps(mean=torch.empty(b, r, t)) for _ in range(2)]
    contiguous = scores.clone()
    assert native.softmax_taps(contiguous, taps[0]) and native.softmax_taps(block, taps[1])
    assert torch.equal(block, contiguous) and torch.equal(taps[0].mean, taps[1].mean)
    assert bool(padded[..., t:].isnan().all())
    assert not native.softmax_taps(padded[..., ::2, :t], native.SoftmaxTaps())  # rows not packed on one stride


@needs_compiler
@pytest.mark.parametrize("b, t, rows", [(1, 37, 8), (2, 50, 50), (3, 197, 64)])
def test_inline_rows_padded_and_contiguous_both_within_float64_bounds(monkeypatch, b, t, rows):
    """``attention_output_in_rows`` with rows padded (the rule) and contiguous (forced): every block of
    probabilities and the output within the bound of float64 computed from the same q, k, v.

    Bounds (u = 2^-24, d = 64): a score's dot product of d terms is within gamma_d sum_j |q_j k_j| scale of exact, so
    each probability carries twice the largest such error (relatively), beside the softmax's own
    (spread + sum_j p_j spread_j + t + 1 + 4 EXP_ULPS) u and 2^-125 absolute (the native pass's bound,
    tests/test_native.py); the output row sum_k p_k v_k adds gamma_t sum_k p_k |v_k|."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    g = torch.Generator().manual_seed(t)
    h, d, scale = 3, 64, 64 ** -0.5
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    x = (q.double() * scale) @ k.double().transpose(-2, -1)
    want = torch.softmax(x, -1)
    spread = x.amax(-1, keepdim=True) - x
    score_err = _gamma(d) * ((q.double().abs() * scale) @ k.double().abs().transpose(-2, -1)).amax(-1, keepdim=True)
    mean_spread = (want * spread).sum(-1, keepdim=True)
    bound = ((spread + mean_spread + t + 1 + 4 * native.EXP_ULPS) * U + 2 * score_err) * want * 1.01 + 2.0 ** -125
    out_bound = (bound @ v.double().abs() + _gamma(t) * (want @ v.double().abs())) * 1.01 + 1e-30
    out_want = want @ v.double()
    real = A.padded_row_stride
    for pad in (True, False):
        monkeypatch.setattr(A, "padded_row_stride", real if pad else (lambda tokens, device: tokens))
        seen = []

        def on_probs(p, sl, seen=seen):
            assert (p.stride(-2) == (A.padded_row_stride(t, p.device))) and p.shape[-1] == t
            seen.append((p.clone(), sl))

        out = A.attention_output_in_rows(q, k, v, scale, rows, on_probs, workspace={},
                                         taps=lambda sl, shape: native.SoftmaxTaps())
        assert sum(sl.stop - sl.start for _, sl in seen) == t
        for p, sl in seen:
            assert bool(((p.double() - want[..., sl, :]).abs() <= bound[..., sl, :]).all()), pad
        assert bool(((out.double() - out_want).abs() <= out_bound).all()), pad


def test_linear_in_is_the_layer_bit_for_bit():
    """``linear_in`` = ``nn.Linear`` to the bit (with and without a bias, 1 and 2 threads), made in the workspace and
    reused; the layer itself wherever it may differ: hooks, gradients, another module."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for bias in (True, False):
                layer = nn.Linear(48, 144, bias=bias)
                x = torch.randn(2, 37, 48, generator=torch.Generator().manual_seed(n))
                ws: dict = {}
                with torch.no_grad():
                    got = A.linear_in(ws, "qkv", layer, x)
                    assert torch.equal(got, layer(x)) and got.data_ptr() == ws["qkv"].data_ptr()
                    again = A.linear_in(ws, "qkv", layer, x[:1].contiguous())
                    assert again.data_ptr() == ws["qkv"].data_ptr() and torch.equal(again, layer(x[:1]))
    finally:
        torch.set_num_threads(threads)
    layer = nn.Linear(8, 8)
    x = torch.randn(1, 3, 8)
    called = []
    handle = layer.register_forward_hook(lambda *_: called.append(1))
    with torch.no_grad():
        A.linear_in({}, "qkv", layer, x)
    handle.remove()
    assert called == [1]  # a hooked layer runs itself
    ws = {}
    assert A.linear_in(ws, "qkv", layer, x).requires_grad and ws == {}  # gradients: the layer's own output


def test_session_copy_reuses_one_buffer_and_keeps_gradients_apart():
    ws: dict = {}
    a = torch.randn(4, 6).t()
    with torch.no_grad():
        c = A.session_copy(ws, "keys", a)
        assert c.is_contiguous() and torch.equal(c, a)
        c2 = A.session_copy(ws, "keys", a[:3])
        assert c2.data_ptr() == c.data_ptr() and torch.equal(c2, a[:3])
    w = torch.randn(3, 3, requires_grad=True)
    assert A.session_copy(ws, "keys", w.t()).requires_grad


@needs_compiler
def test_padded_keys_fill_whole_padded_rows_with_the_strided_products_numbers(monkeypatch):
    """Where the rows are padded, the keys' copy is k^T padded with zeros (issue 67): each block's product writes its
    whole padded rows (a contiguous output), the padding columns zeros that nothing reads; the probabilities are the
    strided product's (one batched product without the padded keys) to float rounding."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    b, h, t, d, rows = 2, 3, 37, 64, 8
    ld = A.padded_row_stride(t, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(b, h, t, d, generator=g) for _ in range(2))
    ws: dict = {}
    got = [(p.clone(), sl) for p, sl in A.attention_probs_in_rows(q, k, d ** -0.5, rows, workspace=ws)]
    keys = ws["keys"][:b * h * d * ld].view(b, h, d, ld)
    assert torch.equal(keys[..., :t], k.transpose(-2, -1)) and not keys[..., t:].any()
    real = A.attention_probs
    monkeypatch.setattr(A, "attention_probs", lambda *a, padded_keys=None, **kw: real(*a, **kw))
    want = [(p.clone(), sl) for p, sl in A.attention_probs_in_rows(q, k, d ** -0.5, rows, workspace={})]
    assert [sl for _, sl in got] == [sl for _, sl in want]
    for (p, _), (w, _) in zip(got, want):
        torch.testing.assert_close(p, w, rtol=4 * _gamma(d), atol=2.0 ** -125)
