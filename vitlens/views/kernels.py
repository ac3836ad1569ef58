"""Compiled reductions for attention distance (Fig. 7 right, Fig. 11) on large maps.

The eager reduction (``distance._key_block_sums`` after a product into a scratch buffer) reads each block of
probabilities twice and the scratch once more. Here ``torch.compile`` makes one kernel that reads each
probability once and sums, per query, both the distance-weighted mass and the mass over patch keys, over blocks
of ``KEY_BLOCK`` keys in float32; the block sums are added in float64 outside it. That is the summation the
derivation of ``FLOAT32_RTOL`` allows (any order inside a block, float64 across blocks), so the numbers are the
eager kernel's to that bound.

When it is used (``compiled_wanted``): the environment variable ``VITLENS_COMPILE`` says ``0`` (never), ``1``
(on any device, wherever the maps are big enough to be split in key blocks) or ``auto`` (the default: on the CPU
for maps of at least ``COMPILE_MIN_TOKENS`` tokens, where the reduction is a measurable part of the forward). The
kernel is compiled once per process (shapes are dynamic: one compile serves every batch, grid and block of
rows); a compile that fails (no C++ compiler for inductor's CPU code, no Triton on a GPU) is said once in a
warning and the eager kernel is used from then on.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable

import torch

COMPILE_ENV = "VITLENS_COMPILE"
COMPILE_CHOICES = ("auto", "0", "1")

COMPILE_MIN_TOKENS = 1024
"""``auto`` compiles for maps of at least this many tokens (above 512 px for a /16 ViT): below it the reduction is
a small part of the forward and the compile (seconds with inductor's cache warm) would not pay back."""

_lock = threading.Lock()
_state: dict[str, object] = {"kernel": None, "key_block": None, "failed": None}


def compile_choice() -> str:
    """``VITLENS_COMPILE`` as one of ``COMPILE_CHOICES`` (unset: ``auto``)."""
    value = os.environ.get(COMPILE_ENV, "auto").strip().lower() or "auto"
    if value not in COMPILE_CHOICES:
        from ..errors import InvalidParameterError

        raise InvalidParameterError(f"{COMPILE_ENV} must be one of {', '.join(COMPILE_CHOICES)}; got {value!r}.")
    return value


def compiled_wanted(device: torch.device, tokens: int) -> bool:
    """Whether the distance reduction of maps over ``tokens`` keys on ``device`` runs compiled (the rule above;
    False once a compile has failed in this process)."""
    if _state["failed"] is not None:
        return False
    choice = compile_choice()
    if choice == "0":
        return False
    if choice == "1":
        return True
    return device.type == "cpu" and tokens >= COMPILE_MIN_TOKENS


def _block_sums_of(key_block: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The function compiled: ``(rows [BH, q, NB * key_block], distances [q, NB * key_block]) -> [BH, q, NB, 2]``
    float32, per block of ``key_block`` keys sum_k A d and sum_k A. Written so that inductor makes one loop that reads
    each probability once and builds the ones beside the distances on the fly (``key_block`` is a constant of it)."""
    def block_sums(rows: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
        x = rows.unflatten(-1, (rows.shape[-1] // key_block, key_block))
        d = distances.unflatten(-1, (distances.shape[-1] // key_block, key_block))
        weights = torch.where(torch.arange(2, device=d.device).view(2, 1) == 0, d[..., None, :], 1.0)
        return (x[..., None, :] * weights).sum(-1)

    return block_sums


def _kernel(key_block: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    kernel = _state["kernel"]
    return kernel if callable(kernel) and _state["key_block"] == key_block else None


def _fail(error: BaseException) -> None:
    _state["failed"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    warnings.warn(f"vitlens: the compiled attention-distance kernel is not available ({_state['failed']}); the eager "
                  f"kernel is used (the same numbers, slower on large maps). Set {COMPILE_ENV}=0 to skip trying.",
                  RuntimeWarning, stacklevel=3)


def key_block_sums_compiled(rows: torch.Tensor, distances: torch.Tensor, key_block: int, out: torch.Tensor) -> bool:
    """``out`` [2, BH, q] float64 = (sum_k A d, sum_k A) over the last axis of ``rows`` [BH, q, N] with
    ``distances`` [q, N] (same dtype), by the compiled kernel: float32 sums over blocks of ``key_block`` keys, added
    in float64 (a last shorter block summed as the eager kernel does). Returns False, writing nothing, when the
    kernel cannot be compiled here (the caller then runs the eager kernel)."""
    n = rows.shape[-1]
    whole = n - n % key_block
    if whole == 0 or rows.dtype != torch.float32 or min(rows.shape[:2]) < 2:  # size 1 would recompile (specialised)
        return False
    part = None
    with torch.no_grad():
        kernel = _kernel(key_block)
        if kernel is None:
            with _lock:  # one thread compiles; the others wait for it
                if _state["failed"] is not None:
                    return False
                kernel = _kernel(key_block)
                if kernel is None:
                    candidate = torch.compile(_block_sums_of(key_block), dynamic=True, fullgraph=True)
                    quiet = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found" on a CPU box
                    level = quiet.level
                    quiet.setLevel(logging.ERROR)
                    try:
                        part = candidate(rows[..., :whole], distances[:, :whole])  # the first call compiles
                    except Exception as error:  # noqa: BLE001 - any compile failure means: use the eager kernel
                        _fail(error)
                        return False
                    finally:
                        quiet.setLevel(level)
                    _state["kernel"], _state["key_block"] = candidate, key_block
                    kernel = candidate
        if part is None:
            part = kernel(rows[..., :whole], distances[:, :whole])
        out.copy_(part.sum(-2, dtype=torch.float64).permute(2, 0, 1))
        if whole < n:
            tail, d = rows[..., whole:], distances[:, whole:]
            out[0] += (tail * d).sum(-1, dtype=torch.float64)
            out[1] += tail.sum(-1, dtype=torch.float64)
    return True


def compile_failure() -> str | None:
    """Why the kernel could not be compiled in this process (None: it compiled, or was not tried)."""
    failed = _state["failed"]
    return str(failed) if failed is not None else None


def reset_for_tests() -> None:
    """Forget the compiled kernel and any failure (tests that force a failure, then a compile)."""
    _state["kernel"], _state["key_block"], _state["failed"] = None, None, None


__all__ = ["COMPILE_CHOICES", "COMPILE_ENV", "COMPILE_MIN_TOKENS", "compile_choice", "compile_failure",
           "compiled_wanted", "key_block_sums_compiled", "reset_for_tests"]
