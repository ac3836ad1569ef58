"""Module paths of earlier versions, kept working: ``import vitlens.shapes``,
``from vitlens.model import load_model``, ``from vitlens.faithfulness import compare_methods``, ...

Each old path is a small proxy module whose attributes are those of the module that now holds
the code, imported on first use (so ``import vitlens`` stays light).
"""
from __future__ import annotations

import importlib
import sys
import types

#: old module path -> where its contents live now
MOVED = {
    "vitlens.model": "vitlens.loading",
    "vitlens.hub": "vitlens.loading.hub",
    "vitlens.checkpoint": "vitlens.loading.checkpoint",
    "vitlens.presets": "vitlens.loading.presets",
    "vitlens.capture": "vitlens.views.capture",
    "vitlens.analyze": "vitlens.views.analyze",
    "vitlens.shapes": "vitlens.reference.shapes",
    "vitlens.metrics": "vitlens.attribution.masks",
    "vitlens.evaluation": "vitlens.attribution.evaluation",
    "vitlens.faithfulness": "vitlens.attribution.faithfulness",
    "vitlens.cli": "vitlens.report.cli",
}
#: old paths that are not set as attributes of the package (``vitlens.analyze`` is the function)
_NOT_ATTRIBUTES = {"vitlens.analyze"}


class _Moved(types.ModuleType):
    """A module that forwards every attribute to the module that now holds the code."""

    def __init__(self, name: str, target: str) -> None:
        super().__init__(name, f"Moved to {target}; this path keeps working.")
        self.__dict__["_target"] = target

    def _module(self) -> types.ModuleType:
        return importlib.import_module(self.__dict__["_target"])

    def __getattr__(self, name: str) -> object:
        return getattr(self._module(), name)

    def __dir__(self) -> list[str]:
        return dir(self._module())


def install(package: types.ModuleType) -> None:
    """Register every old path in ``sys.modules`` (and as a package attribute, where free)."""
    for old, new in MOVED.items():
        if old in sys.modules:
            continue
        proxy = _Moved(old, new)
        sys.modules[old] = proxy
        if old not in _NOT_ATTRIBUTES:
            setattr(package, old.rsplit(".", 1)[-1], proxy)
