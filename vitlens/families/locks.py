"""The lock of a model and of what it shares with other models (``SharedLock``, ``model_lock``): what keeps two
threads' hook sessions on one model apart (``vitlens.families.base`` re-exports them)."""
from __future__ import annotations

import threading
import weakref

from torch import nn

_OBJECT_LOCKS: dict[int, "threading.RLock"] = {}
_LOCKS_GUARD = threading.Lock()


def _object_lock(obj: object) -> "threading.RLock | None":
    """The re-entrant lock of one object (by identity; forgotten when the object is), or None for an object that
    takes no weak reference."""
    key = id(obj)
    with _LOCKS_GUARD:
        lock = _OBJECT_LOCKS.get(key)
        if lock is None:
            try:
                weakref.finalize(obj, _OBJECT_LOCKS.pop, key, None)
            except TypeError:
                return None
            lock = _OBJECT_LOCKS[key] = threading.RLock()
        return lock


def shared_parts(module: nn.Module) -> list[object]:
    """What a hook session on ``module`` may change, and other models may share: the module, every module inside it
    (a model and its ``.vit`` tower share theirs) and the configuration objects they carry (transformers gives every
    model built from one config the same object, whose ``_attn_implementation`` a capture switches)."""
    parts: dict[int, object] = {}
    for mod in module.modules():
        parts[id(mod)] = mod
        config = getattr(mod, "config", None)
        if config is not None and not isinstance(config, (nn.Module, dict, str, int, float, bool, tuple, list)):
            parts[id(config)] = config
    return list(parts.values())


class SharedLock:
    """The lock of a model module and of everything it shares (``shared_parts``): ``acquire`` takes the lock of each
    part, always in one global order (by the locks' identities), so two sessions on models that share a part (two
    models of one config, a model and its tower) run one after the other and never deadlock on each other.
    Re-entrant on the holding thread, as ``threading.RLock``; usable as ``with lock:``."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self._held = threading.local()

    def _locks(self) -> list["threading.RLock"]:
        module = self._module()
        found = {} if module is None else {id(lock): lock for lock in map(_object_lock, shared_parts(module))
                                           if lock is not None}
        return [found[k] for k in sorted(found)]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take every part's lock (waiting at most ``timeout`` seconds in all; none taken when it runs out)."""
        import time

        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        taken: list[threading.RLock] = []
        try:
            for lock in self._locks():
                left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
                if not lock.acquire(blocking, left if blocking else -1):
                    break
                taken.append(lock)
            else:
                self._stack().append(taken)
                return True
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        for lock in reversed(taken):
            lock.release()
        return False

    def release(self) -> None:
        for lock in reversed(self._stack().pop()):
            lock.release()

    def _stack(self) -> list[list["threading.RLock"]]:
        stack = getattr(self._held, "stack", None)
        if stack is None:
            stack = self._held.stack = []
        return stack

    def __enter__(self) -> "SharedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, SharedLock]" = weakref.WeakKeyDictionary()


def model_lock(module: nn.Module) -> SharedLock:
    """The lock of a model module (``LoadedModel.lock``, a ``SharedLock``): every hook session on it holds it from
    install to removal, and ``LoadedModel.forward`` holds it for the forward, so a second thread waits until the
    first thread's session is over and its hooks never see the other thread's forwards. It covers what the model
    shares with others (``shared_parts``): a session on another model built from the same config, or on the
    model's tower, waits too. Re-entrant: the sessions one capture nests (a view's pool or token-norm hooks) and
    their forwards run on the holding thread. A plain ``module(x)`` from user code in another thread does not take
    it: it runs as if no session were on (``Handles``), and is never counted in a view."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = SharedLock(module)
        return lock
