"""The one record of where numbers were computed: package versions (and the device), written
into every report's data file and every survey's manifest so a result says what made it."""
from __future__ import annotations

import platform
from ._version import __version__


def versions(device: str | None = None) -> dict[str, str]:
    """vitlens, timm, torch, python (and ray when it is installed), plus ``device`` when given."""
    import timm
    import torch


    out = {"vitlens": __version__, "timm": timm.__version__, "torch": torch.__version__,
           "python": platform.python_version()}
    try:
        import ray

        out["ray"] = ray.__version__
    except ImportError:
        pass
    if device is not None:
        out["device"] = device
    return out


__all__ = ["versions"]
