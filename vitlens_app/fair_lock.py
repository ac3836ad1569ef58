"""A lock granted in the order it was asked for, and what its log says about fairness.

The app runs one heavy computation at a time across all its sessions (two browser tabs must not
thrash two cores). ``threading.Lock`` promises no order: a session that releases and at once asks
again (the Attributions view computes one method after another) may take it back ahead of a session
that has been waiting, again and again. ``FairLock`` is a ticket lock: each ``acquire`` draws the
next ticket and waits until that ticket is served, so a waiter waits for at most one computation of
each session queued ahead of it (each session's script runs on one thread, so it has at most one
request outstanding).

With ``VITLENS_LOCK_LOG=PATH`` (``FairLock.from_env``) every hold appends one JSON line to PATH:
who held it, what it computed, and when it was requested, granted and released (``time.time()``).
``lock_fairness`` reads those records back per owner.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

from vitlens import InvalidParameterError

LOG_ENV = "VITLENS_LOCK_LOG"


class FairLock:
    """A non-reentrant mutual-exclusion lock served first come, first served (a ticket lock).

    Args:
        log: a file to append one JSON line per hold to (``owner``, ``what``, ``ticket``,
            ``requested``, ``granted``, ``released``); None logs nothing.
        owner: names who holds the lock in the log (the app passes its session id); default the
            thread's name.
    """

    def __init__(self, log: str | Path | None = None, owner: Callable[[], str] | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket that may hold the lock now
        self._abandoned: set[int] = set()  # tickets whose waiter left (an exception while waiting)
        self._holder: int | None = None  # the holding thread's ident
        self._log = Path(log) if log else None
        self._owner = owner or (lambda: threading.current_thread().name)
        self._held: dict[str, Any] = {}
        self._write = threading.Lock()

    @classmethod
    def from_env(cls, owner: Callable[[], str] | None = None) -> "FairLock":
        """A lock that logs to the file named by ``VITLENS_LOCK_LOG`` when it is set (off by default)."""
        return cls(log=os.environ.get(LOG_ENV) or None, owner=owner)

    def acquire(self, what: str = "") -> None:
        """Wait for this thread's turn (after every thread that asked before it), then hold the lock.

        Raises:
            RuntimeError: this thread holds the lock already (it would wait for itself forever).
        """
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                raise RuntimeError("FairLock is not reentrant: this thread holds it already; release it "
                                   "before asking again, or compute without the lock.")
            ticket = self._next
            self._next += 1
            requested = time.time()  # with the ticket: the log's order of requests is the order served
            try:
                while self._serving != ticket:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: never leave the queue stuck on this ticket
                if self._serving == ticket:
                    self._advance()
                else:
                    self._abandoned.add(ticket)
                raise
            self._holder = me
        if self._log is not None:
            self._held = {"owner": str(self._owner()), "what": what, "ticket": ticket, "requested": requested,
                          "granted": time.time()}

    def release(self) -> None:
        """Let the next ticket in.

        Raises:
            RuntimeError: this thread does not hold the lock.
        """
        record = {**self._held, "released": time.time()} if self._log is not None else None
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it.")
            self._holder = None
            self._advance()
        if record is not None:
            with self._write, open(self._log, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _advance(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def locked(self) -> bool:
        """Whether some thread holds the lock now."""
        with self._cond:
            return self._holder is not None

    def __enter__(self) -> "FairLock":
        # the log names the computation by the function whose ``with`` took the lock
        self.acquire(sys._getframe(1).f_code.co_name if self._log is not None else "")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lock_log(path: str | Path) -> list[dict]:
    """The records a ``FairLock`` wrote to ``path`` (one JSON object a line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def lock_fairness(records: Iterable[dict]) -> dict[str, dict]:
    """Per owner: its holds, its longest wait, and who was served while it waited.

    For each of an owner's waits (requested -> granted), the holds granted to other owners inside
    that interval are counted; ``max_bypass`` is the most holds any single other owner was granted
    during one wait. First come, first served means ``max_bypass <= 1``: no session is served twice
    while another waits, so a wait lasts at most one computation of each other session.
    ``wait_bound_s`` is that bound for this owner's longest wait: the sum over the other owners of
    their longest hold.

    Args:
        records: dicts with ``owner``, ``requested``, ``granted``, ``released`` (as ``FairLock`` logs).

    Returns:
        {owner: {"holds", "hold_s" (total), "max_hold_s", "max_wait_s", "max_other_hold_s",
            "wait_bound_s", "max_bypass", "fair"}}.
    """
    recs = list(records)
    for r in recs:
        missing = [k for k in ("owner", "requested", "granted", "released") if k not in r]
        if missing:
            raise InvalidParameterError(f"A lock record lacks {', '.join(missing)}: {r}. Pass the records "
                                        "FairLock logs (read_lock_log).")
        if not r["requested"] <= r["granted"] <= r["released"]:
            raise InvalidParameterError(f"A lock record is out of order (requested <= granted <= released): {r}.")
    owners = sorted({str(r["owner"]) for r in recs})
    max_hold = {o: max(r["released"] - r["granted"] for r in recs if str(r["owner"]) == o) for o in owners}
    out: dict[str, dict] = {}
    for o in owners:
        mine = [r for r in recs if str(r["owner"]) == o]
        others = [r for r in recs if str(r["owner"]) != o]
        bypass = 0
        for r in mine:
            served = Counter(str(x["owner"]) for x in others if r["requested"] < x["granted"] < r["granted"])
            bypass = max(bypass, max(served.values(), default=0))
        max_wait = max(r["granted"] - r["requested"] for r in mine)
        bound = sum(max_hold[p] for p in owners if p != o)
        out[o] = {"holds": len(mine), "hold_s": sum(r["released"] - r["granted"] for r in mine),
                  "max_hold_s": max_hold[o], "max_wait_s": max_wait,
                  "max_other_hold_s": max((max_hold[p] for p in owners if p != o), default=0.0),
                  "wait_bound_s": bound, "max_bypass": bypass, "fair": bypass <= 1}
    return out
