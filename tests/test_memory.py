"""Peak memory as the benchmark and the survey report it: it grows with what a process touches,
and a child process starts afresh instead of inheriting its parent's high-water mark."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vitlens.memory import peak_rss_mb

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_peak_grows_with_an_allocation_and_a_child_starts_afresh():
    hold = np.ones(512 * 2**20 // 8)  # 512 MiB touched here: this process's peak is at least that
    parent = peak_rss_mb()
    assert parent >= 512
    code = ("from vitlens.memory import peak_rss_mb as p; import numpy as np; a = p(); "
            "x = np.ones(256 * 2**20 // 8); print(a, p())")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    start, end = map(float, out.stdout.split())
    assert start < parent - 256  # ru_maxrss would report at least the parent's peak here
    assert 240 <= end - start <= 300  # the child's own 256 MiB
    del hold
