"""vitlens's native CPU kernels for the attention views (Fig. 6/14 rollout, Fig. 7 right and Fig. 11 attention
distance): ``native_kernels.cpp``, built on the user's machine and called through ``ctypes``.

Three kernels, each one pass over the numbers it reads, each with the numbers of the eager code it replaces to
float rounding (the same terms, summed by the same rules; the softmax's exp is ATen's ``exp_u20``, within
``EXP_ULPS`` ulps):

- ``softmax_taps``: a block of query rows' softmax, in place, and in the same pass what the views read of it
  (``SoftmaxTaps``): attention distance's per-query sums (float32 over blocks of ``key_block`` keys, added in
  float64: the rule ``FLOAT32_RTOL`` is derived from) and rollout's mean over heads, in float32 or straight into
  rollout's float16 store (scaled, rounded to nearest even: ``store_half``'s numbers to the bit). The eager path
  makes the probabilities, then reads them again for each view.
- ``key_block_sums``: attention distance's sums on given maps (the same rule), one read of each probability.
- ``rollout_step``: one float64 step of rollout's chain (``rollout_row``) straight from the float32 map, or from
  one stored in float16 (scaled; ``vitlens.views.rollout_store``).

When they are used (``compiled_wanted``): ``VITLENS_COMPILE`` says ``0`` (never), ``1`` (on the CPU at any size)
or ``auto`` (the default: on the CPU for maps of at least ``COMPILE_MIN_TOKENS`` tokens). The first use in a
process loads the library, building it first if this machine has not (the C++ compiler ``$CXX``, else ``g++``,
against the installed torch's headers: ATen's vector types for the CPU capability torch runs with, ATen's thread
pool; a few seconds, once). Built libraries are kept in ``$VITLENS_CACHE_DIR``, else ``~/.cache/vitlens/native``,
named by a hash of the source, torch's version, the capability and the compiler. A build or load that fails (no
compiler) is said once in a warning and the eager code runs from then on.

The cache is trusted only as far as it is private (``private_dir``, ``verified``): the folder is made mode 0700 and
refused (one warning, the eager code) when another user owns it or others may write to it; each library's sha256
and size are recorded when it is built (``NAME.so.sha256``, written atomically, in the same folder), and a library
is loaded only after it was checked, by ``lstat`` before anything opens it, to be a regular file of the user's,
writable by no one else, of the recorded size and hash. Anything else under its name (planted, truncated, a FIFO,
a link, no record) is removed and built again; builds and checks hold ``.lock`` (``flock``), so two processes never
build over each other.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import math
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from ..errors import InvalidParameterError

COMPILE_ENV = "VITLENS_COMPILE"
COMPILE_CHOICES = ("auto", "0", "1")
CACHE_ENV = "VITLENS_CACHE_DIR"

EXP_ULPS = 20
"""The accuracy of the softmax kernel's exp, in float32 ulps: ATen's ``exp_u20`` (the exp of ATen's own fused attention
kernel, which the plain forward runs), as its source documents it (about 2 ulps measured here); an exp below about
sqrt(2) times float32's smallest normal number (2^-126) is flushed to 0. The tests' bounds on the probabilities count
both (``tests/test_native.py``)."""

COMPILE_MIN_TOKENS = 192
"""``auto`` uses the kernels for maps of at least this many tokens: from the paper's 224 px input of a /16 ViT (197
tokens) up. Rule: the smallest standard grid where the kernels measured faster end to end (224 px, ViT-B, batch 16:
the views' call 1.028x the plain forward with its MLP buffers against 1.048x with the eager passes, eight interleaved
repetitions in one process, docs/performance.md); the tiny grids below it (a /16 model at 112 px and less) keep the
eager passes, where the views are a small part of the forward either way."""

SOURCE = Path(__file__).with_name("native_kernels.cpp")

_lock = threading.Lock()
_state: dict[str, object] = {"lib": None, "failed": None}


@dataclass
class SoftmaxTaps:
    """What a block of query rows' softmax pass computes besides the probabilities, for the views (``softmax_taps``).

    A consumer asks for its part (``AttentionConsumer.softmax_tap``); the engine fills what it can and sets
    ``filled``; a tap not filled (side capture of another family, no kernel) is computed by the consumer from the
    probabilities as before, with the same numbers to float rounding.

    Attributes:
        distances: [q, N] float32 pixel distances of the block's patch queries (its rows ``first`` on) to the N patch
            keys (the keys after ``prefix``), or None.
        first: the block's first row that is a patch query.
        prefix: prefix tokens (keys before the patch keys).
        key_block: keys per float32 partial sum.
        sums: [2, B * heads, q] float64 out: per query, sum_k A d and sum_k A over the patch keys.
        mean: [B, rows, T] float32 out (rows contiguous): the block's mean over heads, or None.
        half_mean: [B, rows, T] float16 out (rows contiguous; any image stride): that mean times ``half_scale``,
            rounded to nearest even (rollout's float16 store, ``vitlens.views.rollout_store.store_half``, the same
            numbers to the bit), or None; without ``mean`` the float32 mean is never written anywhere.
        half_scale: the power of two ``half_mean`` is scaled by.
        filled: whether the engine computed them.
    """

    distances: torch.Tensor | None = None
    first: int = 0
    prefix: int = 0
    key_block: int = 64
    sums: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    half_mean: torch.Tensor | None = None
    half_scale: float = 1.0
    filled: bool = False


def compile_choice() -> str:
    """``VITLENS_COMPILE`` as one of ``COMPILE_CHOICES`` (unset: ``auto``)."""
    value = os.environ.get(COMPILE_ENV, "auto").strip().lower() or "auto"
    if value not in COMPILE_CHOICES:
        raise InvalidParameterError(f"{COMPILE_ENV} must be one of {', '.join(COMPILE_CHOICES)}; got {value!r}.")
    return value


def compiled_wanted(device: torch.device, tokens: int) -> bool:
    """Whether maps over ``tokens`` keys on ``device`` go through the native kernels (the rule above; False on
    other devices than the CPU, and once a build has failed in this process)."""
    if _state["failed"] is not None or torch.device(device).type != "cpu":
        return False
    choice = compile_choice()
    return choice == "1" or (choice == "auto" and tokens >= COMPILE_MIN_TOKENS)


def _capability_flags() -> list[str]:
    """Compiler flags for ATen's vector types at the CPU capability torch itself runs with."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512",
                "-DCPU_CAPABILITY=AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []  # ATen's portable vectors (other capabilities, other architectures)


def _build_command(compiler: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    gomp = sorted(lib.glob("libgomp*.so*"))  # torch's own OpenMP runtime: one thread pool in the process
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [compiler, "-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", *_capability_flags(),
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(torch_dir / "include"), str(SOURCE), "-o", str(output),
            "-L", str(lib), f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", *([str(gomp[0])] if gomp else [])]


def cache_dir() -> Path:
    """Where built libraries are kept (``$VITLENS_CACHE_DIR``, else ``~/.cache/vitlens/native``)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "vitlens" / "native"


def _uid() -> int:
    return os.geteuid()


def private_dir(path: Path) -> Path:
    """``path`` made (mode 0700) or checked as a folder of this user's that no one else may write to; one that
    group or others may only read is made 0700.

    Raises:
        RuntimeError: another user owns it, or group or others may write to it (what they put there would run in
            this process): the caller falls back to the eager code.
    """
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"the cache {path} is not a folder")
    if st.st_uid != _uid():
        raise RuntimeError(f"the cache folder {path} belongs to another user (uid {st.st_uid}); set {CACHE_ENV} "
                           "to a folder of your own")
    if st.st_mode & 0o022:
        raise RuntimeError(f"the cache folder {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}); "
                           f"set {CACHE_ENV} to a private folder of your own, or chmod 700 it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _sha256_of(fd: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def verified(library: Path) -> str | None:
    """None when ``library`` is the library that was built under its name: a regular file (``lstat``: never a
    link, never opened when it is a FIFO or a device) of this user's, writable by no one else, whose size and
    sha256 are those recorded at build time; else what is wrong with it, in words."""
    try:
        st = os.lstat(library)
    except FileNotFoundError:
        return "not built"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != _uid() or st.st_mode & 0o022:
        return "not the user's own, or writable by others"
    try:
        record = json.loads(_record_path(library).read_text()[:4096])
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no record of its build"
    if st.st_size != size:
        return f"{st.st_size} bytes, {size} recorded"
    fd = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between lstat and open
            return "not a regular file"
        if _sha256_of(fd) != digest:
            return "its sha256 differs from the one recorded"
    finally:
        os.close(fd)
    return None


def _write_record(library: Path, digest: str, size: int) -> None:
    """The build record of ``library`` (sha256, size), replaced atomically, mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=library.parent, prefix=".record-")
    with os.fdopen(fd, "w") as f:
        json.dump({"sha256": digest, "size": size}, f)
    os.replace(tmp, _record_path(library))


def _remove(path: Path) -> None:
    try:
        os.unlink(path)  # a file, a link or a FIFO: unlinked, never opened
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path)


def library_path(compiler: str) -> Path:
    """The cache's name for the library built with ``compiler`` (a hash of the source, torch's version, the CPU
    capability, the compiler's version and the build command)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
                                    version, " ".join(_build_command(compiler, Path("x")))]).encode()).hexdigest()
    return cache_dir() / f"vitlens_native_{key[:16]}.so"


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    return compiler


def _build(compiler: str, target: Path) -> None:
    """Build the library into ``target`` (atomically: another process sees the whole library or none) and record
    its hash."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(_build_command(compiler, built), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.chmod(built, 0o700)
        fd = os.open(built, os.O_RDONLY)
        try:
            digest = _sha256_of(fd)
        finally:
            os.close(fd)
        _write_record(target, digest, built.stat().st_size)
        os.replace(built, target)


def _checked_library(compiler: str) -> Path:
    """The verified library's path, built (again) where there is none or it fails ``verified``."""
    target = library_path(compiler)
    private_dir(target.parent)
    fd = os.open(target.parent / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if verified(target) is not None:
            _remove(target)
            _build(compiler, target)
            problem = verified(target)
            if problem is not None:
                raise RuntimeError(f"the library built in {target.parent} does not check ({problem})")
    finally:
        os.close(fd)
    return target


def _load() -> ctypes.CDLL:
    target = _checked_library(_compiler())
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.vitlens_softmax_taps.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64,
                                         ctypes.c_float]
    lib.vitlens_key_block_sums.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64, ptr]
    lib.vitlens_rollout_step.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.vitlens_rollout_step_half.argtypes = [ptr, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr]
    for fn in (lib.vitlens_softmax_taps, lib.vitlens_key_block_sums, lib.vitlens_rollout_step,
               lib.vitlens_rollout_step_half):
        fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library (built first where needed; one thread builds while the others wait), or None once a build
    has failed in this process (said once in a warning)."""
    lib = _state["lib"]
    if lib is not None:
        return lib  # type: ignore[return-value]  # _state holds the CDLL once it is loaded (a dict of object values)
    with _lock:
        if _state["failed"] is not None:
            return None
        if _state["lib"] is None:
            try:
                _state["lib"] = _load()
            except Exception as error:  # noqa: BLE001 - any failure means: the eager code runs
                text = str(error).strip()
                _state["failed"] = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
                warnings.warn(f"vitlens: the native kernels are not available ({_state['failed']}); the eager code "
                              f"runs (the same numbers, slower on large maps). Set {COMPILE_ENV}=0 to skip trying.",
                              RuntimeWarning, stacklevel=3)
                return None
    # the ignore below: _state holds the CDLL once it is loaded (a dict of object values)
    return _state["lib"]  # type: ignore[return-value]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _power_of_two(x: float) -> bool:
    """Whether ``x`` is a positive power of two that float32 holds (scaling by it is exact)."""
    return isinstance(x, (int, float)) and x > 0 and math.frexp(x)[0] == 0.5 and 2.0 ** -126 <= x <= 2.0 ** 127


def softmax_taps(scores: torch.Tensor, taps: SoftmaxTaps) -> bool:
    """``scores`` [B, H, R, T] (float32, CPU) replaced by their softmax over the last axis, and ``taps`` filled in the
    same pass (``taps.filled`` set). ``scores`` is contiguous, or a block of a buffer whose rows are padded to a
    longer stride (``stride(-2) >= T``, the other axes packed on it: ``vitlens.core.attention.padded_row_stride``).
    Returns False, changing nothing, where the kernel does not apply (``compiled_wanted`` says no, another dtype or
    layout, gradients, a tap of another shape, dtype or row layout, a ``half_scale`` that is no power of two, no
    library): the caller then runs ``torch.softmax`` and the consumers compute their taps from the probabilities."""
    b, h, r, t = scores.shape
    ld = scores.stride(-2)
    packed = all(st == want for n, st, want in zip(scores.shape[:2], scores.stride()[:2], (h * r * ld, r * ld))
                 if n > 1)
    if (scores.dtype != torch.float32 or scores.requires_grad or scores.stride(-1) != 1 or ld < t or not packed
            or not compiled_wanted(scores.device, t)):
        return False
    d, sums, mean = taps.distances, taps.sums, taps.mean
    if d is not None:
        q, n = r - taps.first, t - taps.prefix
        if (sums is None or d.shape != (q, n) or d.dtype != torch.float32 or not d.is_contiguous()
                or sums.shape != (2, b * h, q) or sums.dtype != torch.float64 or not sums.is_contiguous()):
            return False
    half = taps.half_mean
    for out, dtype in ((mean, torch.float32), (half, torch.float16)):
        if out is not None and (out.shape != (b, r, t) or out.dtype != dtype or out.device != scores.device
                                or out.stride(-1) != 1 or out.stride(-2) != t):
            return False
    if half is not None and not _power_of_two(taps.half_scale):
        return False
    lib = library()
    if lib is None:
        return False
    status = lib.vitlens_softmax_taps(scores.data_ptr(), b, h, r, t, ld, _ptr(d), taps.first, taps.prefix,
                                      taps.key_block, _ptr(sums) if d is not None else None, _ptr(mean),
                                      mean.stride(0) if mean is not None else 0, _ptr(half),
                                      half.stride(0) if half is not None else 0, float(taps.half_scale))
    if status != 0:
        raise RuntimeError("vitlens's native softmax kernel failed.")
    taps.filled = True
    return True


def key_block_sums(rows: torch.Tensor, distances: torch.Tensor, key_block: int, out: torch.Tensor) -> bool:
    """``out`` [2, M, Q] float64 = (sum_k A d, sum_k A) over the last axis of ``rows`` [M, Q, N] (float32, keys
    contiguous) with ``distances`` [Q, N] float32: float32 sums over blocks of ``key_block`` keys, added in float64.
    Returns False, writing nothing, where the kernel does not apply (as ``softmax_taps``)."""
    m, q, n = rows.shape
    if (rows.dtype != torch.float32 or rows.stride(-1) != 1 or distances.dtype != torch.float32
            or not compiled_wanted(rows.device, n) or out.dtype != torch.float64 or not out.is_contiguous()
            or out.shape != (2, m, q)):
        return False
    lib = library()
    if lib is None:
        return False
    d = distances.contiguous()
    if lib.vitlens_key_block_sums(rows.data_ptr(), m, q, n, rows.stride(0), rows.stride(1), d.data_ptr(),
                                  key_block, out.data_ptr()) != 0:
        raise RuntimeError("vitlens's native distance kernel failed.")
    return True


def window_block_sums(p: torch.Tensor, distances: torch.Tensor, key_block: int, out: torch.Tensor) -> bool:
    """``out`` [B, windows, 2, heads, q] float64 = (sum_k A d, sum_k A) over each window's keys, for window maps
    ``p`` [B, windows, heads, q, Nk] (float32, keys contiguous) and ``distances`` [windows, q, Nk] float32: the rule of
    ``key_block_sums``, one (image, window) at a time, one read of each probability (the windowed distance,
    ``vitlens.views.windowed``). Returns False, writing nothing, where the kernel does not apply (``compiled_wanted``
    for the block's windows x q tokens)."""
    b, w, h, q, n = p.shape
    if (p.dtype != torch.float32 or p.stride(-1) != 1 or distances.dtype != torch.float32
            or distances.shape != (w, q, n) or out.dtype != torch.float64 or not out.is_contiguous()
            or out.shape != (b, w, 2, h, q) or not compiled_wanted(p.device, w * q)):
        return False
    lib = library()
    if lib is None:
        return False
    d = distances.contiguous()
    sb, sw, sh, sq = p.stride()[:4]
    base, size = p.data_ptr(), p.element_size()
    for i in range(b):
        for j in range(w):
            if lib.vitlens_key_block_sums(base + (i * sb + j * sw) * size, h, q, n, sh, sq, d[j].data_ptr(), key_block,
                                          out[i, j].data_ptr()) != 0:
                raise RuntimeError("vitlens's native distance kernel failed.")
    return True


def rollout_step(a: torch.Tensor, v: torch.Tensor, inv_scale: float = 1.0) -> torch.Tensor | None:
    """One step of rollout's chain, v A' = w (A + I) with w = v / (rowsum(A) + 1), in float64 from a head-fused map
    ``a`` [B, T, T] (rows contiguous) and ``v`` [B, T] float64; None where the kernel does not apply. ``a`` is
    float32, or float16 holding the map divided by ``inv_scale`` (a power of two; ``vitlens.views.rollout_store``):
    its rows are made float32 and unscaled (exactly) before the same float64 sums."""
    b, t, _ = a.shape
    if (a.dtype not in (torch.float32, torch.float16) or a.stride(-1) != 1 or a.stride(-2) != t
            or v.dtype != torch.float64 or not compiled_wanted(a.device, t)):
        return None
    lib = library()
    if lib is None:
        return None
    v = v.contiguous()
    w, out = torch.empty_like(v), torch.empty_like(v)
    if a.dtype == torch.float16:
        status = lib.vitlens_rollout_step_half(a.data_ptr(), b, t, a.stride(0), inv_scale, v.data_ptr(), w.data_ptr(),
                                               out.data_ptr())
    else:
        status = lib.vitlens_rollout_step(a.data_ptr(), b, t, a.stride(0), v.data_ptr(), w.data_ptr(), out.data_ptr())
    if status != 0:
        raise RuntimeError("vitlens's native rollout kernel failed.")
    return out


def compile_failure() -> str | None:
    """Why the library could not be built or loaded in this process (None: it loaded, or was not tried)."""
    failed = _state["failed"]
    return str(failed) if failed is not None else None


def reset_for_tests() -> None:
    """Forget the loaded library and any failure (tests that force a failure, then a build)."""
    _state["lib"], _state["failed"] = None, None


__all__ = ["CACHE_ENV", "COMPILE_CHOICES", "COMPILE_ENV", "COMPILE_MIN_TOKENS", "SoftmaxTaps", "cache_dir",
           "compile_choice", "compile_failure", "compiled_wanted", "key_block_sums", "library", "library_path",
           "private_dir", "reset_for_tests", "rollout_step", "softmax_taps", "verified", "window_block_sums"]
