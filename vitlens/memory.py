"""Peak memory of this process, as the benchmark and the survey's shard records report it, and the memory there is
for a new model (``available_bytes``)."""
from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB.

    On Linux, VmHWM of ``/proc/self/status``: it starts afresh when a process execs, whereas
    ``ru_maxrss`` keeps the parent's high-water mark (a child started by a 3 GB parent reports
    at least 3 GB). Elsewhere, ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def available_bytes() -> int | None:
    """Memory a new allocation can have now: ``MemAvailable`` of ``/proc/meminfo``, lowered to what a cgroup
    (v2 ``memory.max`` less ``memory.current``) leaves; elsewhere the free physical pages; None when unknown."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    if not found:
        import os

        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, min(found))


__all__ = ["available_bytes", "peak_rss_mb"]
