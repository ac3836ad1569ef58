"""Packages whose public names are imported on first use, so that ``import vitlens`` (and the command line, which
checks its arguments before any work) does not import torch.

A lazy package writes its public imports, as usual, inside ``if TYPE_CHECKING:``: type checkers and the docs
(griffe) read them there, and that block is the one list of what the package exports. ``lazy_names`` reads the
block back from the package's source (``ast``) and gives the package the module-level ``__getattr__`` and
``__dir__`` of PEP 562: the first ``vitlens.load_model`` imports ``vitlens.loading`` and keeps the value.
"""
from __future__ import annotations

import ast
import importlib
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Callable


def exported(source: str | Path) -> dict[str, tuple[str, str]]:
    """name -> (relative module, attribute) of every ``from ... import`` in the source's ``if TYPE_CHECKING:`` block.

    Args:
        source: the package's ``__init__.py``.

    Returns:
        The exports, e.g. ``{"load_model": (".loading", "load_model"), "ATTRIBUTION_METHODS": (".attribution",
            "METHODS")}``.
    """
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    blocks = [node for node in tree.body if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
              and node.test.id == "TYPE_CHECKING"]
    return {alias.asname or alias.name: ("." * node.level + (node.module or ""), alias.name)
            for block in blocks for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}


def exported_names(source: str | Path) -> list[str]:
    """The exported names of a lazy package (its ``__all__``), sorted: written once, in its ``TYPE_CHECKING`` block."""
    return sorted(exported(source))


class LazyPackage(types.ModuleType):
    """The class of a lazy package's module. An exported name may also be a submodule's (``vitlens.survey``: the
    function, beside the subpackage ``vitlens.survey``); importing that submodule makes the import system set the
    package's attribute to the module, which would replace the export. Here the export is kept, as the eager
    ``from .survey import survey`` kept it."""

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if isinstance(value, types.ModuleType) and name in exports and value.__name__ == f"{self.__name__}.{name}":
            module, attribute = exports[name]
            value = getattr(importlib.import_module(module, self.__name__), attribute)
        super().__setattr__(name, value)


def moved_message(package: str, name: str, module: str, attribute: str) -> str:
    """The one line a name that left a package's top level answers with: where it is now."""
    where = f"{package}{module}"
    return (f"{package}.{name} is no longer a top-level name of {package}: import it from {where} "
            f"(from {where} import {attribute}).")


def lazy_names(package: str, source: str | Path, namespace: dict[str, Any], moved: dict[str, str] | None = None,
               renamed: dict[str, str] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562's ``__getattr__`` and ``__dir__`` for a package that exports the names of its ``TYPE_CHECKING`` block.

    Args:
        package: the package's ``__name__``.
        source: its ``__init__.py`` (``__file__``).
        namespace: its ``globals()``, where each value is kept once imported.
        moved: names the package exported before, by the (relative) module that holds each now: each still resolves,
            with a ``FutureWarning`` that names the module (``moved_message``); never kept, so every use says it.
        renamed: a moved name's attribute in its module, where it differs from the name.

    Returns:
        ``(__getattr__, __dir__)``: an exported name is imported from its module on first use; a moved name as said
            above; a subpackage or module of the package (``vitlens.figures``) is imported when asked for; anything
            else is an ``AttributeError``.
    """
    names = exported(source)
    moved, renamed = dict(moved or {}), dict(renamed or {})
    namespace["_lazy_exports"] = names
    namespace["_lazy_moved"] = {name: (module, renamed.get(name, name)) for name, module in moved.items()}
    sys.modules[package].__class__ = LazyPackage

    def getattr_(name: str) -> Any:
        if name in names:
            module, attribute = names[name]
            value = getattr(importlib.import_module(module, package), attribute)
            namespace[name] = value
            return value
        if name in moved:
            module, attribute = namespace["_lazy_moved"][name]
            warnings.warn(moved_message(package, name, module, attribute), FutureWarning, stacklevel=2)
            return getattr(importlib.import_module(module, package), attribute)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(names))

    return getattr_, dir_


def import_everything(package: types.ModuleType) -> None:
    """Import every module a lazy package's names come from, its exported and its moved names' (without a warning):
    what ``vitlens.results`` does before it reads a file whose kind no module imported yet has registered."""
    for module, _attribute in [*package.__dict__.get("_lazy_exports", {}).values(),
                               *package.__dict__.get("_lazy_moved", {}).values()]:
        importlib.import_module(module, package.__name__)
