"""Peak memory of this process, as the benchmark and the survey's shard records report it."""
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


__all__ = ["peak_rss_mb"]
