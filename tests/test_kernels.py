"""The compiled attention-distance kernel (``vitlens.views.kernels``, issue 35): the same sums as the eager kernel
and as float64 within the derived ``FLOAT32_RTOL``, the rule for when it runs, one compile shared by threads, and a
failed compile that falls back to the eager kernel with a warning."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views import distance as dist
from vitlens.views import kernels


@pytest.fixture
def fresh_kernel():
    kernels.reset_for_tests()
    yield
    kernels.reset_for_tests()


def _maps(b: int, h: int, q: int, p: int, n: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, h, q, p + n, generator=g) * 4, dim=-1)


@pytest.mark.parametrize("n, grid", [(200, (10, 20)), (256, (16, 16))])  # a shorter last key block; whole blocks
def test_the_compiled_kernel_gives_the_float64_sums_within_the_bound(monkeypatch, fresh_kernel, n, grid):
    """200 patch keys (three blocks of 64 and one of 8) and 256 (four whole blocks), two prefix tokens, 24 queries
    of a larger grid: compiled (forced) against the same sums in float64 and against the eager kernel, both within
    ``FLOAT32_RTOL`` (each is within it of float64), raw and renormalised."""
    p = 2
    attn = _maps(3, 4, 24, p, n)
    d = dist.token_distance_matrix(grid, (16, 8), queries=slice(5, 29))
    a = attn.double()[..., p:]
    for renormalize in (True, False):
        monkeypatch.setenv(kernels.COMPILE_ENV, "1")
        got = dist.per_query_distance(attn, d.float(), p, renormalize)
        assert kernels._kernel(dist.KEY_BLOCK) is not None  # it did run compiled
        monkeypatch.setenv(kernels.COMPILE_ENV, "0")
        eager = dist.per_query_distance(attn, d.float(), p, renormalize)
        want = (a * d).sum(-1) / (a.sum(-1) if renormalize else 1.0)  # [B, H, q] float64
        np.testing.assert_allclose(got.permute(1, 2, 0).numpy(), want.numpy(), rtol=dist.FLOAT32_RTOL)
        np.testing.assert_allclose(got.numpy(), eager.numpy(), rtol=2 * dist.FLOAT32_RTOL)


def test_the_rule_for_when_the_kernel_runs(monkeypatch, fresh_kernel):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(kernels.COMPILE_ENV, raising=False)
    assert kernels.compile_choice() == "auto"
    assert kernels.compiled_wanted(cpu, kernels.COMPILE_MIN_TOKENS)
    assert not kernels.compiled_wanted(cpu, kernels.COMPILE_MIN_TOKENS - 1)
    assert not kernels.compiled_wanted(cuda, 4097)  # auto: the CPU only (measured there)
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")
    assert kernels.compiled_wanted(cuda, 10) and kernels.compiled_wanted(cpu, 10)
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    assert not kernels.compiled_wanted(cpu, 10**6)
    monkeypatch.setenv(kernels.COMPILE_ENV, "yes")
    with pytest.raises(vl.InvalidParameterError, match="VITLENS_COMPILE must be one of auto, 0, 1; got 'yes'"):
        kernels.compiled_wanted(cpu, 10**6)


def test_maps_the_kernel_does_not_take_go_eager(monkeypatch, fresh_kernel):
    """Fewer keys than a block, one query, half precision: the eager kernel, nothing compiled."""
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")
    out = torch.empty(2, 4, 1, dtype=torch.float64)
    assert not kernels.key_block_sums_compiled(_maps(1, 4, 1, 0, 100)[0], torch.ones(1, 100), 64, out)
    assert not kernels.key_block_sums_compiled(_maps(1, 4, 3, 0, 40)[0], torch.ones(3, 40), 64, out)
    assert not kernels.key_block_sums_compiled(_maps(1, 4, 3, 0, 100)[0].half(), torch.ones(3, 100).half(), 64, out)
    assert kernels._kernel(64) is None


def test_two_threads_share_one_compile_and_get_their_own_sums(monkeypatch, fresh_kernel):
    """Two threads reach the kernel before it exists: one compiles, the other waits, each gets its own maps'
    numbers (those of the eager kernel within the bound)."""
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")
    d = dist.token_distance_matrix((8, 16), (16, 16), queries=slice(0, 16)).float()
    maps = [_maps(2, 3, 16, 1, 128, seed=s) for s in (1, 2)]
    got: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        got[i] = dist.per_query_distance(maps[i], d, 1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    for i in range(2):
        np.testing.assert_allclose(got[i].numpy(), dist.per_query_distance(maps[i], d, 1).numpy(),
                                   rtol=2 * dist.FLOAT32_RTOL)
    assert not np.allclose(got[0].numpy(), got[1].numpy())


def test_a_failed_compile_warns_once_and_the_eager_kernel_takes_over(monkeypatch, fresh_kernel):
    """Where inductor cannot build its code (no C++ compiler): one warning that says so and how to stop trying,
    then the eager kernel's numbers, and no second attempt."""
    calls = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            calls.append(1)
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")
    attn = _maps(2, 3, 8, 1, 128)
    d = dist.token_distance_matrix((8, 16), (16, 16), queries=slice(0, 8)).float()
    with pytest.warns(RuntimeWarning, match="compiled attention-distance kernel is not available .*No working C"
                                            ".*VITLENS_COMPILE=0"):
        got = dist.per_query_distance(attn, d, 1)
    again = dist.per_query_distance(attn, d, 1)
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    eager = dist.per_query_distance(attn, d, 1)
    assert torch.equal(got, eager) and torch.equal(again, eager)
    assert len(calls) == 1 and not kernels.compiled_wanted(torch.device("cpu"), 10**6)
