"""FairLock serves threads in the order they asked; lock_fairness reads its log (issue 23 section 4)."""
from __future__ import annotations

import threading
import time

import pytest

from vitlens.errors import InvalidParameterError
from vitlens_app.fair_lock import FairLock, lock_fairness, read_lock_log


def queue_up(lock: FairLock, n: int, hold_s: float = 0.0) -> list[int]:
    """Hold the lock in the main thread, start n threads one after another (each queued before the next
    starts), release, and return the order in which the threads got the lock."""
    order: list[int] = []

    def worker(i: int) -> None:
        with lock:
            order.append(i)
            time.sleep(hold_s)

    lock.acquire()
    threads = []
    for i in range(n):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        deadline = time.time() + 10
        while lock._next != i + 2 and time.time() < deadline:  # thread i holds ticket i + 1 (main holds 0)
            time.sleep(0.001)
        assert lock._next == i + 2, f"thread {i} never asked for the lock"
        threads.append(t)
    lock.release()
    for t in threads:
        t.join(timeout=10)
    return order


def test_threads_get_the_lock_in_the_order_they_asked():
    assert queue_up(FairLock(), 12) == list(range(12))


def test_a_thread_that_asks_again_at_once_goes_behind_the_waiters():
    """Two workers, each computing three times in a row (as one run of the Attributions view does): with
    first come, first served they alternate, where a plain lock lets a releasing thread take it back."""
    lock = FairLock()
    order: list[str] = []
    start = threading.Barrier(2)

    def worker(name: str) -> None:
        start.wait()
        for _ in range(3):
            with lock:
                order.append(name)
                time.sleep(0.02)

    lock.acquire()
    a = threading.Thread(target=worker, args=("a",))
    b = threading.Thread(target=worker, args=("b",))
    a.start(), b.start()
    deadline = time.time() + 10
    while lock._next < 3 and time.time() < deadline:  # both queued behind the main thread
        time.sleep(0.001)
    lock.release()
    a.join(timeout=10), b.join(timeout=10)
    assert sorted(order) == ["a"] * 3 + ["b"] * 3
    assert all(x != y for x, y in zip(order, order[1:])), order  # never the same thread twice in a row


def test_mutual_exclusion_under_contention():
    lock, inside, most = FairLock(), [0], [0]

    def worker() -> None:
        for _ in range(50):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] == 1 and lock._next == lock._serving == 300 and not lock.locked()


def test_reentry_and_a_foreign_release_are_refused():
    lock = FairLock()
    with lock:
        with pytest.raises(RuntimeError, match="not reentrant"):
            lock.acquire()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
    with lock:  # still usable: the refused acquire took no ticket that blocks the queue
        assert lock.locked()


def test_a_waiter_interrupted_in_the_queue_does_not_block_the_ones_behind_it():
    lock = FairLock()
    lock.acquire()
    with lock._cond:  # stand in for a waiter that drew ticket 1 and left (an exception while waiting)
        lock._next += 1
        lock._abandoned.add(1)
    order = []
    t = threading.Thread(target=lambda: (lock.acquire(), order.append("next"), lock.release()))
    t.start()
    time.sleep(0.05)
    assert order == []
    lock.release()
    t.join(timeout=5)
    assert order == ["next"] and lock._serving == 3


def test_the_log_records_each_hold_with_its_owner_and_the_function_that_took_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLENS_LOCK_LOG", str(tmp_path / "lock.jsonl"))
    lock = FairLock.from_env(owner=lambda: "session-1")

    def rollout_result() -> None:
        with lock:
            time.sleep(0.01)

    rollout_result()
    rollout_result()
    recs = read_lock_log(tmp_path / "lock.jsonl")
    assert [(r["owner"], r["what"], r["ticket"]) for r in recs] == [("session-1", "rollout_result", 0),
                                                                   ("session-1", "rollout_result", 1)]
    assert all(r["requested"] <= r["granted"] < r["released"] for r in recs)
    assert recs[0]["released"] - recs[0]["granted"] >= 0.01
    assert not FairLock()._log  # off unless asked for


def rec(owner: str, requested: float, granted: float, released: float) -> dict:
    return {"owner": owner, "requested": requested, "granted": granted, "released": released}


def test_lock_fairness_on_hand_built_logs():
    # first come, first served: a asks at 0 and holds 0-2; b and c ask at 1, are served 2-5 and 5-6
    fifo = [rec("a", 0, 0, 2), rec("b", 1, 2, 5), rec("c", 1.5, 5, 6)]
    got = lock_fairness(fifo)
    assert got["c"]["max_wait_s"] == pytest.approx(3.5) and got["c"]["max_bypass"] == 1  # behind b's one hold
    assert got["c"]["wait_bound_s"] == pytest.approx(2 + 3) and got["c"]["max_other_hold_s"] == pytest.approx(3)
    assert got["a"] == {"holds": 1, "hold_s": 2, "max_hold_s": 2, "max_wait_s": 0, "max_other_hold_s": 3,
                        "wait_bound_s": 4, "max_bypass": 0, "fair": True}
    assert all(v["fair"] for v in got.values())
    # starvation: b waits from 1 to 7 while a is served three times
    unfair = [rec("a", 0, 0, 2), rec("b", 1, 7, 8), rec("a", 2, 2, 4), rec("a", 4, 4, 7)]
    got = lock_fairness(unfair)
    assert got["b"]["max_bypass"] == 2 and not got["b"]["fair"]  # a's holds at 2 and 4 (0 came before b asked)
    assert got["a"]["holds"] == 3 and got["a"]["hold_s"] == pytest.approx(7) and got["a"]["fair"]


def test_lock_fairness_refuses_records_it_cannot_read():
    with pytest.raises(InvalidParameterError, match="lacks released"):
        lock_fairness([{"owner": "a", "requested": 0, "granted": 1}])
    with pytest.raises(InvalidParameterError, match="out of order"):
        lock_fairness([rec("a", 2, 1, 3)])
