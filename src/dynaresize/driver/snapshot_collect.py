"""The driver's snapshot collector (driver/snapshots.py): two daemon threads that issue a
started snapshot's `snapshot_take` calls and wait for their meta results, off the main thread.

Invariants: the main thread's hand-over is a C queue put and two lock-based flags (well under a
microsecond each here); the issue thread never waits for a trainer, so `issued` is set promptly
for every snapshot handed over; `done` is set once the metas are in (`result`, with the
`snapshot.Snapshot` built here) or the wait failed (`error`: the main thread then waits with the
watchdog, which names the lost trainer); `close` ends both threads after what was handed over.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import ray

from dynaresize.cluster import snapshot


class Flag:
    """A one-shot event on a bare lock: made and checked on the main thread in well under a
    microsecond (a `threading.Event` costs ~8 us to make here, most of the hand-over)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True


class Collector:
    """A driver thread that issues a started snapshot's `snapshot_take` calls (results owned by
    the driver process, like any call it makes) and a second that waits for their small meta
    results, so neither the issue nor the wait sits on the main thread. Two threads: a wait that
    hangs (a trainer that stopped answering, until the recovery kills it) never holds up the
    issue of the next snapshot's calls. Daemon threads: a wait left at exit ends with the process."""

    def __init__(self) -> None:
        self._issue: queue.SimpleQueue = queue.SimpleQueue()  # a C queue: put costs ~0.04 us, not ~9
        self._wait: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = (threading.Thread(target=self._issuer, name="snapshot-issue", daemon=True),
                        threading.Thread(target=self._waiter, name="snapshot-wait", daemon=True))
        for t in self.threads:
            t.start()

    def submit(self, p: Any, workers: list) -> None:
        p.issued, p.done = Flag(), Flag()
        self._issue.put((p, list(workers)))

    def close(self) -> None:
        """Let both threads end (once what was handed over is done)."""
        self._issue.put(None)

    @staticmethod
    def _lower_priority() -> None:
        """Nice 19 for this thread (Linux: per thread): when the main thread hands a version over,
        the woken collector must not preempt it (the scheduler's wake-up preemption), on a busy
        host that switch was the largest part left of the hand-over."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: the same, unniced

    def _issuer(self) -> None:
        self._lower_priority()
        while True:
            item = self._issue.get()
            if item is None:
                self._wait.put(None)
                return
            p, workers = item
            t0 = time.perf_counter()
            try:
                calls = [workers[d].snapshot_take.remote(p.version) for d in p.devices]
                p.metas, p.params, p.others = [c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls]
            except BaseException as exc:  # noqa: BLE001 - the main thread's complete() raises it
                p.error = exc
                p.done.set()
            p.collector_s = time.perf_counter() - t0
            p.issued.set()
            if p.error is None:
                self._wait.put(p)

    def _waiter(self) -> None:
        self._lower_priority()
        while True:
            p = self._wait.get()
            if p is None:
                return
            try:
                p.result = ray.get(p.metas)
                p.snap = snapshot.Snapshot(version=p.version, metas=p.result, params=p.params,
                                           others=p.others if p.kind == "full" else None)
            except BaseException as exc:  # noqa: BLE001 - a lost trainer: complete() waits with the watchdog
                p.error = exc
            p.done.set()
