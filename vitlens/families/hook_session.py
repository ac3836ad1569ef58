"""The one managed hook mechanism: ``HookSession`` (installed on ``with``, removed on exit, by an exception too) and
the ``Handles`` it installs through, whose hooks act only on the owning thread's forwards; each session holds its
model's lock (``vitlens.families.locks``) while active (``vitlens.families.base`` re-exports them)."""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

from torch import nn

from .locks import model_lock


class Handles:
    """Hooks and attribute changes a capture installed, undone in reverse order by ``remove``.

    Made by a ``HookSession`` with its thread (``owner``) and the forward-hook tables of its model's modules
    (``forward_tables``): a forward hook or pre-hook put in one of those tables, and a ``forward`` replaced with
    ``set_attr``, then act only on the owner's forwards. A forward another thread runs meanwhile (a plain
    ``module(x)`` that does not wait for the model's lock) runs as without the session: its hooks return at once
    and the replaced ``forward`` calls the one it replaced, so it is never counted in the session's maps or
    statistics and never meets the session's per-forward state."""

    def __init__(self, owner: int | None = None, forward_tables: frozenset[int] = frozenset()) -> None:
        self._undo: list[Callable[[], None]] = []
        self._owner = owner
        self._tables = forward_tables

    def _mine(self) -> bool:
        return self._owner is None or threading.get_ident() == self._owner

    def hook(self, handle: Any) -> None:
        table = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
        if self._owner is not None and table is not None and id(table) in self._tables and handle.id in table:
            fn = table[handle.id]

            def owners_only(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if self._mine() else None

            table[handle.id] = owners_only
        self._undo.append(handle.remove)

    def on_remove(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)`` now, the previous value put back by ``remove`` (an attribute the
        object had from its class, e.g. a module's ``forward``, is deleted again, so the class's is seen).
        A module's ``forward`` is replaced for the owner's thread only (the others call the previous one)."""
        # an attribute the class provides and setattr shadows (a method) is deleted again; an instance
        # attribute, or one a descriptor of the class stores (a property), is set back
        shadowed = name not in getattr(obj, "__dict__", {}) and \
            not hasattr(inspect.getattr_static(type(obj), name, None), "__set__")
        previous = getattr(obj, name)
        if name == "forward" and self._owner is not None and isinstance(obj, nn.Module) and callable(value):
            replacement = value

            @functools.wraps(replacement)
            def value(*args: Any, **kwargs: Any) -> Any:  # the owner's replacement, or the previous forward
                return (replacement if self._mine() else previous)(*args, **kwargs)

        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name) if shadowed else setattr(obj, name, previous))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _forward_tables(module: nn.Module) -> frozenset[int]:
    return frozenset(id(t) for mod in module.modules() for t in (mod._forward_hooks, mod._forward_pre_hooks))


class HookSession:
    """The one managed hook mechanism: a context manager whose ``install(handles)`` puts its hooks
    (and attribute changes) on a model when the ``with`` block starts; every one is removed when
    it ends, by an exception too, and by a failure half-way through installing. Attention
    capture, pool attention and AttnLRP's mode are sessions, and every analysis that reads or edits
    named sites (the component analyses, token norms, CKA features, head ablation: ``SiteSession`` in
    ``vitlens.engine.sites``) is one; each holds its model's lock (``model_lock``) while it is active:
    two threads' sessions on one model run one after the other, never mixed."""

    _handles: Handles | None = None
    _lock: Any = None

    def install(self, handles: Handles) -> None:
        raise NotImplementedError

    def locked_module(self) -> nn.Module | None:
        """The model whose lock the session holds: its ``model`` (or its LoadedModel ``m``'s) by default."""
        model = getattr(self, "model", None)
        loaded = getattr(self, "m", None)
        if model is None and loaded is not None:
            model = getattr(loaded, "model", None)
        return model if isinstance(model, nn.Module) else None

    def __enter__(self):  # noqa: ANN204 (returns the session itself, whatever its subclass)
        if self._handles is not None:
            raise RuntimeError(f"This {type(self).__name__} is already active; nest a new one instead.")
        module = self.locked_module()
        lock = model_lock(module) if module is not None else None
        if lock is not None:
            lock.acquire()
        self._lock = lock
        self._handles = Handles(threading.get_ident(), _forward_tables(module) if module is not None else frozenset())
        try:
            self.install(self._handles)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._handles is not None:
                self._handles.remove()
        finally:
            self._handles = None
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.release()
