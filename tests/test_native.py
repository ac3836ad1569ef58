"""The native CPU kernels (``vitlens.core.native``, issue 35): a block's softmax with the views' taps in one pass,
attention distance's sums, rollout's chain step. Each against float64 within a bound derived from its summation
(not observed), against the eager code it replaces, end to end through ``analyze``; the rule for when they run; one
build shared by threads; a failed build that warns once and leaves the eager code; a cache that only a library
built here, recorded and checked, ever loads from (planted, truncated, a FIFO, another user's folder).

Every test here builds into a temporary cache folder (``cache`` below; the suite's conftest points
``VITLENS_CACHE_DIR`` at one too), never ``~/.cache/vitlens``; what needs a compiler is skipped without ``g++``."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import threading
import warnings

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.core import native
from vitlens.views import distance as dist
from vitlens.views import rollout as roll

U = 2.0 ** -24  # float32's unit roundoff
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) on PATH to build the "
                                    "native kernels with")


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture(autouse=True)
def cache(monkeypatch, module_cache):
    """The module's own cache folder (one build for the module's tests), never the user's."""
    monkeypatch.setenv(native.CACHE_ENV, str(module_cache))
    return module_cache


@pytest.fixture
def fresh_library():
    native.reset_for_tests()
    yield
    native.reset_for_tests()


def _scores(b: int, h: int, r: int, t: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, r, t, generator=g) * 4


def _taps(b: int, h: int, r: int, t: int, first: int, prefix: int, distances: torch.Tensor) -> native.SoftmaxTaps:
    return native.SoftmaxTaps(distances=distances, first=first, prefix=prefix, key_block=dist.KEY_BLOCK,
                              sums=torch.empty(2, b * h, r - first, dtype=torch.float64), mean=torch.empty(b, r, t))


@needs_compiler
@pytest.mark.parametrize("t, grid", [(202, (10, 20)), (258, (16, 16))])  # a shorter last key block; whole blocks
def test_softmax_taps_against_float64_within_derived_bounds(monkeypatch, t, grid):
    """Scores [2, 3, 9, t] (two prefix tokens, the first three rows not patch queries): the probabilities, the
    distance sums and the head mean, each against float64 computed from the same inputs.

    Bounds, with u = 2^-24: a probability p_i = exp(x_i - m) / s carries the rounding of x_i - m (|x_i - m| u relative
    after exp) and exp's ``EXP_ULPS`` ulps (2 u each); the sum s of the same rounded exps carries their errors averaged
    (at most (sum_j p_j |x_j - m| + 2 EXP_ULPS) u) and its float32 summation of t terms in any vector width (at most
    (t - 1) u); the product by 1 / s adds 2 u. ATen's exp_u20 flushes an exp under about sqrt(2) 2^-126 to 0: at most
    2^-125 absolute (s >= 1). The sums are ``FLOAT32_RTOL``'s rule over the kernel's own probabilities; the mean over
    H heads summed in float32 is within H u of float64."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    b, h, r, p, first = 2, 3, 9, 2, 3
    scores = _scores(b, h, r, t)
    d = dist.token_distance_matrix(grid, (16, 8), queries=slice(4, 4 + r - first))
    probs = scores.clone()
    taps = _taps(b, h, r, t, first, p, d.float())
    assert native.softmax_taps(probs, taps) and taps.filled
    x = scores.double()
    want = torch.softmax(x, -1)
    spread = (x.amax(-1, keepdim=True) - x)
    mean_spread = (want * spread).sum(-1, keepdim=True)
    bound = (spread + mean_spread + t + 1 + 4 * native.EXP_ULPS) * U * want + 2.0 ** -125
    assert bool(((probs.double() - want).abs() <= bound).all())
    a = probs.double()[:, :, first:, p:].reshape(b * h, r - first, t - p)
    weighted, mass = (a * d).sum(-1), a.sum(-1)
    np.testing.assert_allclose(taps.sums[0].numpy(), weighted.numpy(), rtol=dist.FLOAT32_RTOL)
    np.testing.assert_allclose(taps.sums[1].numpy(), mass.numpy(), rtol=dist.FLOAT32_RTOL)
    mean = probs.double().mean(1)
    assert bool(((taps.mean.double() - mean).abs() <= h * U * mean + 1e-45).all())
    # the same probabilities as torch.softmax to both bounds
    assert bool(((probs.double() - torch.softmax(scores, -1).double()).abs() <= 2 * bound + 1e-45).all())


def test_taps_are_refused_where_they_do_not_apply(monkeypatch):
    """Half precision, a non-contiguous block, gradients, a tap of the wrong shape, ``VITLENS_COMPILE=0``, small maps
    under ``auto``: nothing written, nothing filled (the caller's torch.softmax and the consumers' own code run)."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    scores = _scores(1, 2, 4, 70)
    taps = native.SoftmaxTaps(mean=torch.empty(1, 4, 70))
    for bad in (scores.half(), scores.transpose(-1, -2).contiguous().transpose(-1, -2),
                scores.clone().requires_grad_()):
        before = bad.detach().clone()
        assert not native.softmax_taps(bad, taps) and not taps.filled
        assert torch.equal(bad.detach(), before)
    assert not native.softmax_taps(scores.clone(), native.SoftmaxTaps(mean=torch.empty(1, 5, 70)))
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    assert not native.softmax_taps(scores.clone(), taps)
    monkeypatch.setenv(native.COMPILE_ENV, "auto")
    assert not native.softmax_taps(scores.clone(), taps)  # 70 tokens: below COMPILE_MIN_TOKENS


@needs_compiler
@pytest.mark.parametrize("n, grid", [(200, (10, 20)), (256, (16, 16))])
def test_distance_sums_on_given_maps_match_float64_and_the_eager_kernel(monkeypatch, n, grid):
    """``per_query_distance`` through the native kernel (forced) against float64 and the eager kernel, raw and
    renormalised, on a block whose queries are a slice of a larger map (strided rows)."""
    p = 2
    attn = torch.softmax(_scores(3, 4, 30, p + n), -1)[:, :, 6:]
    d = dist.token_distance_matrix(grid, (16, 8), queries=slice(5, 29))
    a = attn.double()[..., p:]
    calls = []
    real = native.key_block_sums
    monkeypatch.setattr(dist, "key_block_sums", lambda *args: calls.append(real(*args)) or calls[-1])
    for renormalize in (True, False):
        monkeypatch.setenv(native.COMPILE_ENV, "1")
        got = dist.per_query_distance(attn, d.float(), p, renormalize)
        monkeypatch.setenv(native.COMPILE_ENV, "0")
        eager = dist.per_query_distance(attn, d.float(), p, renormalize)
        want = (a * d).sum(-1) / (a.sum(-1) if renormalize else 1.0)
        np.testing.assert_allclose(got.permute(1, 2, 0).numpy(), want.numpy(), rtol=dist.FLOAT32_RTOL)
        np.testing.assert_allclose(got.numpy(), eager.numpy(), rtol=2 * dist.FLOAT32_RTOL)
    assert calls == [True, False, True, False]  # the native kernel ran when asked, and only then


@needs_compiler
def test_rollout_step_matches_the_float64_chain(monkeypatch):
    """One chain step from a float32 head-fused map: the same float64 terms as the eager step, summed in another
    order (relative difference within T x float64's epsilon, 2,305 x 2.2e-16)."""
    g = torch.Generator().manual_seed(1)
    a = torch.softmax(torch.randn(2, 300, 300, generator=g), -1)
    v = torch.rand(2, 300, dtype=torch.float64, generator=g)
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    got = roll.rollout_row([a, a.flip(-1)], 1, True, v)
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    want = roll.rollout_row([a, a.flip(-1)], 1, True, v)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=300 * np.finfo(np.float64).eps)


def test_the_rule_for_when_the_kernels_run(monkeypatch, fresh_library):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(native.COMPILE_ENV, raising=False)
    assert native.compile_choice() == "auto"
    assert native.compiled_wanted(cpu, native.COMPILE_MIN_TOKENS)
    assert not native.compiled_wanted(cpu, native.COMPILE_MIN_TOKENS - 1)
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    assert native.compiled_wanted(cpu, 10) and not native.compiled_wanted(cuda, 10**6)  # the CPU only
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    assert not native.compiled_wanted(cpu, 10**6)
    monkeypatch.setenv(native.COMPILE_ENV, "yes")
    with pytest.raises(vl.InvalidParameterError, match="VITLENS_COMPILE must be one of auto, 0, 1; got 'yes'"):
        native.compiled_wanted(cpu, 10**6)


@pytest.fixture(scope="module")
def small_vit():
    return vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=96)


@needs_compiler
def test_analyze_through_the_taps_gives_the_eager_numbers(monkeypatch, small_vit):
    """``analyze`` on a 6x6-grid ViT, by query rows, with the kernels forced on and off: every block of rows went
    through the taps (each consumer's ask filled), and the results equal the eager ones within the bounds — two
    distance consumers (the second's ask is not the one filled: it reads the probabilities) and rollout."""
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    filled = []
    real = native.softmax_taps

    def counting(scores, taps):
        done = real(scores, taps)
        filled.append(done)
        return done

    import vitlens.core.attention as attention

    monkeypatch.setattr(attention, "softmax_taps", counting)
    results, asked = {}, {}
    for choice in ("1", "0"):
        monkeypatch.setenv(native.COMPILE_ENV, choice)
        filled.clear()
        results[choice] = (vl.analyze(small_vit, x, views=("distance", "rollout"), memory_budget_mb=0.01),
                           vl.attention_distance(small_vit, x, renormalize=False))
        asked[choice] = list(filled)
    assert len(asked["1"]) > 2 * small_vit.spec.num_layers and all(asked["1"])  # by rows, every block filled
    assert asked["0"] == []  # the kernels off: the consumers ask nothing
    (a1, raw1), (a0, raw0) = results["1"], results["0"]
    np.testing.assert_allclose(a1.distance.mean_px, a0.distance.mean_px, rtol=2 * dist.FLOAT32_RTOL)
    np.testing.assert_allclose(raw1.mean_px, raw0.mean_px, rtol=2 * dist.FLOAT32_RTOL)
    np.testing.assert_allclose(a1.rollout.maps, a0.rollout.maps, rtol=1e-5, atol=1e-6)


@needs_compiler
def test_two_consumers_of_one_kind_share_a_pass(monkeypatch, small_vit):
    """Two distance accumulators on one stream: the first's sums come from the softmax pass, the second's from
    the probabilities; the same numbers within the bound."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    from vitlens.engine import stream_attention

    x = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    accs = [dist.AttentionDistanceAccumulator.for_model(small_vit.spec) for _ in range(2)]
    stream_attention(small_vit, x, accs, capture_mode=None, memory_budget_mb=0.01)
    np.testing.assert_allclose(accs[0].result().mean_px, accs[1].result().mean_px, rtol=2 * dist.FLOAT32_RTOL)


@needs_compiler
def test_two_threads_share_one_build(monkeypatch, fresh_library, tmp_path):
    """Two threads reach the library before it exists (an empty cache): one builds while the other waits; each gets
    its own maps' numbers."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    d = dist.token_distance_matrix((8, 16), (16, 16), queries=slice(0, 16)).float()
    maps = [torch.softmax(_scores(2, 3, 16, 129, seed=s), -1) for s in (1, 2)]
    got: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        got[i] = dist.per_query_distance(maps[i], d, 1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(list(tmp_path.glob("vitlens_native_*.so"))) == 1 and native.compile_failure() is None
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    for i in range(2):
        np.testing.assert_allclose(got[i].numpy(), dist.per_query_distance(maps[i], d, 1).numpy(),
                                   rtol=2 * dist.FLOAT32_RTOL)
    assert not np.allclose(got[0].numpy(), got[1].numpy())


def test_a_failed_build_warns_once_and_the_eager_code_takes_over(monkeypatch, fresh_library, tmp_path):
    """No C++ compiler: one warning that says so and how to stop trying, then the eager numbers, no second try."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    attn = torch.softmax(_scores(2, 3, 8, 129), -1)
    d = dist.token_distance_matrix((8, 16), (16, 16), queries=slice(0, 8)).float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dist.per_query_distance(attn, d, 1)
        dist.per_query_distance(attn, d, 1)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert re.search(r"native kernels are not available .*no C\+\+ compiler \(no-such-compiler-here\).*"
                     r"VITLENS_COMPILE=0", str(caught[0].message))
    monkeypatch.delenv("CXX")
    again = dist.per_query_distance(attn, d, 1)  # not retried, even with a compiler back
    assert native.compile_failure() is not None and not native.compiled_wanted(torch.device("cpu"), 10**6)
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    eager = dist.per_query_distance(attn, d, 1)
    assert torch.equal(got, eager) and torch.equal(again, eager)
    assert not list(tmp_path.glob("*.so"))


def test_large_buffers_are_plain_tensors_with_huge_pages_advised():
    """``large_empty``: the shape, dtype and device asked, writable and readable as any tensor, small ones untouched
    (the advice changes where the memory comes from, never the numbers)."""
    from vitlens.core.pages import HUGE_PAGE, large_empty

    big = large_empty(3, HUGE_PAGE, dtype=torch.float32)
    assert big.shape == (3, HUGE_PAGE) and big.dtype == torch.float32 and big.is_contiguous()
    big.fill_(1.5)
    assert float(big.sum()) == 1.5 * big.numel()
    small = large_empty(4, 5, dtype=torch.float64)
    assert small.shape == (4, 5) and small.dtype == torch.float64


def _one_distance_call() -> tuple[torch.Tensor, list]:
    """A forced native distance call: its result and the warnings it gave."""
    attn = torch.softmax(_scores(2, 3, 8, 129), -1)
    d = dist.token_distance_matrix((8, 16), (16, 16), queries=slice(0, 8)).float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dist.per_query_distance(attn, d, 1)
    return got, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_no_compiler_on_path_falls_back_with_exactly_one_warning(monkeypatch, fresh_library, tmp_path):
    """No ``g++`` anywhere on PATH (an empty PATH folder, CXX unset): exactly one warning over two calls, and the
    eager numbers."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    first, said = _one_distance_call()
    second, again = _one_distance_call()
    assert len(said) == 1 and not again and "no C++ compiler (g++) on PATH" in str(said[0].message)
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    assert torch.equal(first, _one_distance_call()[0]) and torch.equal(second, first)


PLANTED = r"""
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
    const char *marker = std::getenv("VITLENS_PLANTED_MARKER");
    if (marker) { FILE *f = std::fopen(marker, "w"); if (f) { std::fputs("ran", f); std::fclose(f); } }
}
extern "C" int vitlens_softmax_taps() { return 0; }
extern "C" int vitlens_key_block_sums() { return 0; }
extern "C" int vitlens_rollout_step() { return 0; }
"""


def _put(target, data: bytes) -> None:
    """``data`` under ``target``'s name as a new file (a library this process loaded stays mapped: writing into
    its file would crash this process, not test the cache)."""
    new = target.with_name(target.name + ".new")
    new.write_bytes(data)
    os.replace(new, target)


def _expected_library(cache) -> "os.PathLike":
    native.private_dir(cache)
    return native.library_path(shutil.which("g++"))


@needs_compiler
def test_a_planted_library_is_never_loaded(monkeypatch, fresh_library, tmp_path, cache):
    """A real library whose constructor writes a marker file, planted under the expected name (as another user
    would in a shared cache): it is never loaded (no marker), the kernels are built again, recorded, and give the
    eager numbers."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    marker = tmp_path / "planted-ran"
    monkeypatch.setenv("VITLENS_PLANTED_MARKER", str(marker))
    source = tmp_path / "planted.cpp"
    source.write_text(PLANTED)
    target = _expected_library(cache)
    planted = tmp_path / "planted.so"
    subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(planted)], check=True, timeout=120)
    record = target.parent / (target.name + ".sha256")
    for forged in (False, True):  # no build record; a record of the right size and another hash
        native.reset_for_tests()
        _put(target, planted.read_bytes())
        if forged:
            record.write_text('{"sha256": "%s", "size": %d}' % ("0" * 64, target.stat().st_size))
        assert native.verified(target) is not None
        got, said = _one_distance_call()
        assert not marker.exists() and not said and native.compile_failure() is None
        assert native.verified(target) is None  # built again and recorded
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    np.testing.assert_allclose(got.numpy(), _one_distance_call()[0].numpy(), rtol=2 * dist.FLOAT32_RTOL)


@needs_compiler
@pytest.mark.parametrize("damage", ["truncated", "fifo", "link"])
def test_a_damaged_library_is_found_before_loading_and_built_again(monkeypatch, fresh_library, cache, tmp_path,
                                                                   damage):
    """A truncated library (SIGBUS when loaded), a FIFO (a read would block for ever) or a link to /dev/zero
    under the library's name: ``verified`` says what it is from ``lstat`` alone (nothing opened, no hang), and the
    next use builds it again."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    target = _expected_library(cache)
    _one_distance_call()  # a good build first, with its record
    assert native.verified(target) is None
    native.reset_for_tests()
    size = target.stat().st_size
    if damage == "truncated":
        _put(target, target.read_bytes()[:size // 3])
    else:
        target.unlink()
        os.mkfifo(target) if damage == "fifo" else os.symlink("/dev/zero", target)
    said_before = native.verified(target)
    assert said_before == (f"{size // 3} bytes, {size} recorded" if damage == "truncated" else "not a regular file")
    got, said = _one_distance_call()
    assert not said and native.compile_failure() is None and native.verified(target) is None
    assert stat.S_ISREG(os.lstat(target).st_mode)
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    np.testing.assert_allclose(got.numpy(), _one_distance_call()[0].numpy(), rtol=2 * dist.FLOAT32_RTOL)


@pytest.mark.parametrize("why", ["others-write", "other-owner"])
def test_a_cache_folder_others_control_is_refused_with_one_warning(monkeypatch, fresh_library, tmp_path, why):
    """A cache folder others may write to (mode 0777), or one another user owns: nothing is built or loaded there;
    one warning that names the folder, and the eager numbers."""
    monkeypatch.setenv(native.COMPILE_ENV, "1")
    shared = tmp_path / "shared"
    shared.mkdir()
    if why == "others-write":
        shared.chmod(0o777)
    else:
        monkeypatch.setattr(native, "_uid", lambda: os.geteuid() + 1)  # the folder is then someone else's
    monkeypatch.setenv(native.CACHE_ENV, str(shared))
    got, said = _one_distance_call()
    _again, more = _one_distance_call()
    assert len(said) == 1 and not more and str(shared) in str(said[0].message)
    assert ("written by others" if why == "others-write" else "belongs to another user") in str(said[0].message)
    assert not list(shared.iterdir())
    monkeypatch.setenv(native.COMPILE_ENV, "0")
    assert torch.equal(got, _one_distance_call()[0])


def test_the_cache_folder_is_made_private(tmp_path):
    """A new cache folder is made mode 0700; one of the user's that others may read is made 0700."""
    made = native.private_dir(tmp_path / "a" / "native")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    assert stat.S_IMODE(native.private_dir(readable).stat().st_mode) == 0o700
