"""Large fresh buffers on huge pages where Linux offers them (rollout's per-block maps, Fig. 6: L x B x T x T float32
made anew for every batch, 85 MB a block at 768 px batch 4).

A fresh tensor's memory is mapped page by page as it is first written: 4 KB pages cost one fault each (21,000 for
one such block, paid inside the kernel that fills it). ``large_empty`` asks the kernel for 2 MB pages on the tensor's
own memory (``madvise(MADV_HUGEPAGE)``, the advice transparent huge pages follow when set to ``madvise``; the
numbers are the same either way). Where the advice is not available (not Linux, THP off, another device) it is an
ordinary ``torch.empty``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable

import torch

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14

_libc: list = []


def _madvise() -> Callable[..., int] | None:
    if not _libc:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _libc.append(fn)
    return _libc[0]


def large_empty(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape)`` with huge pages advised for its whole 2 MB pages (CPU tensors of at least two of them,
    on Linux); otherwise, or where the advice fails, the plain tensor (the same memory, the same numbers)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    madvise = _madvise() if t.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE else None
    if madvise is not None:
        start = (t.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        stop = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if stop > start:
            madvise(start, stop - start, MADV_HUGEPAGE)  # advice only: a refusal leaves 4 KB pages
    return t


__all__ = ["HUGE_PAGE", "large_empty"]
