"""The reward pool: reward calls in worker processes, each with a deadline.

`RewardPool(spec, style, workers, timeout_s).run(calls)` runs each call (`rl.rewards.invoke`:
one sample, or a TRL prompt group) in one of `workers` processes and returns one outcome per
call, in order. A worker is a fresh interpreter (`python -c`, talking over a socket pair, with
the driver's `sys.path`): it holds no copy of the driver's threads, Ray connections or locks,
and, unlike multiprocessing's `spawn`, never re-runs the driver's `__main__` script.

- `("ok", {"values", "problems", "metrics"})`: the call returned (its values checked);
- `("error", reason)`: the function raised (reason: `raised TYPE: message`), or its worker
  died (a crash, `os._exit`);
- `("timeout", reason)`: the call ran past `timeout_s` seconds from the moment it was handed
  to its worker; that worker is killed (SIGKILL) and a new one started in its place, so a
  hung reward costs one deadline and never stalls the driver.

Invariants: a worker runs one call at a time, and calls go to workers in order, so with one
worker the function sees the samples one by one in sample-id order, in one process, as an
in-process loop would (module state persists across steps until a worker is replaced); each
worker has its own pipe, so a killed worker's late answer can never be taken for another
call's. A worker that cannot start (its module fails to import there, or it takes longer than
`start_s`) raises `RewardError`: no call could be scored. Workers ignore SIGINT, exit when
the driver's end of their socket closes, and (a call may hang) when the driver process is
gone, so none outlives the driver.

No Ray, no torch: processes and pipes from the standard library.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from dynaresize.errors import RewardError

START_S = 120.0  # the longest a worker may take to import the reward's module


def _serve(fd: int, parent: int) -> None:
    """A worker's loop (`python -c ...`): take (sys.path, spec, style), load the function once,
    then answer each (index, call) with (index, outcome)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    conn = Connection(fd)

    def orphaned() -> None:  # the driver is gone (killed): a call may be hung, so do not wait for EOF
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    path, spec, style = conn.recv()
    sys.path[:] = path  # what the driver imports from (a module:function spec resolves the same)
    from dynaresize.rl.rewards import invoke, load_reward

    try:
        fn = load_reward(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, call = msg
        try:
            outcome: tuple[str, Any] = ("ok", invoke(fn, style, call))
        except BaseException as exc:  # noqa: BLE001 - the user's function: any exception is its outcome
            outcome = ("error", f"raised {type(exc).__name__}: {exc}")
        try:
            conn.send((index, outcome))
        except Exception as exc:  # noqa: BLE001 - an unpicklable value
            conn.send((index, ("error", f"gave a result that cannot be sent back ({type(exc).__name__}: {exc})")))


class _Worker:
    """One worker process and the driver's end of its socket."""

    def __init__(self, spec: str, style: str) -> None:
        mine, theirs = socket.socketpair()
        code = f"from dynaresize.rl.reward_pool import _serve; _serve({theirs.fileno()}, {os.getpid()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send((list(sys.path), spec, style))
        self.started = time.monotonic()
        self.ready = False
        self.call: int | None = None  # the index of the call it runs
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class RewardPool:
    """See the module docstring."""

    def __init__(self, spec: str, style: str, workers: int, timeout_s: float, start_s: float = START_S) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"workers {workers} must be >= 1 and timeout_s {timeout_s} > 0")
        self.spec, self.style, self.size, self.timeout_s, self.start_s = spec, style, workers, timeout_s, start_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.replaced = 0  # workers killed at a deadline or found dead, and started again

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def start(self) -> None:
        """Start the workers and wait until each has loaded the function (`run` starts them too)."""
        self.run([], wait_ready=True)

    def run(self, calls: list[dict], *, wait_ready: bool = False) -> list[tuple[str, Any]]:
        """One outcome per call, in order (see the module docstring)."""
        with self._lock:
            while len(self._workers) < self.size:
                self._workers.append(_Worker(self.spec, self.style))
            out: list[tuple[str, Any] | None] = [None] * len(calls)
            pending = deque(range(len(calls)))
            while pending or any(w.call is not None or (wait_ready and not w.ready) for w in self._workers):
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.call is None and pending:
                        w.call, w.deadline = pending.popleft(), now + self.timeout_s
                        try:
                            w.conn.send((w.call, calls[w.call]))
                        except OSError:  # it died: its end of the pipe reads as closed next
                            pass
                ends = [w.deadline if w.ready else w.started + self.start_s
                        for w in self._workers if w.call is not None or not w.ready]
                for conn in wait([w.conn for w in self._workers], timeout=max(0.0, min(ends, default=now) - now)):
                    self._receive(next(w for w in self._workers if w.conn is conn), out)
                now = time.monotonic()
                for i, w in enumerate(list(self._workers)):
                    if w.call is not None and now > w.deadline:
                        out[w.call] = ("timeout", f"timed out after {self.timeout_s:g} s (its reward worker was "
                                                  "killed and replaced)")
                        self._replace(w)
                    elif not w.ready and now > w.started + self.start_s:
                        self.close()
                        raise RewardError(f"reward worker for {self.spec} did not start within {self.start_s:g} s")
            return [o if o is not None else ("error", "no outcome") for o in out]

    def _receive(self, w: _Worker, out: list) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died
            try:
                code = w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            if w.call is not None:
                out[w.call] = ("error", f"its reward worker died (exit code {code}) during the call")
            elif not w.ready:
                self.close()
                raise RewardError(f"reward worker for {self.spec} died while starting (exit code {code})") from None
            self._replace(w)
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "failed":
            self.close()
            raise RewardError(f"reward worker could not load {self.spec}: {msg[1]}")
        else:
            index, outcome = msg
            if index == w.call:
                out[index] = outcome
                w.call = None

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.replaced += 1
        self._workers[self._workers.index(w)] = _Worker(self.spec, self.style)

    def close(self) -> None:
        """Stop every worker (asked first, killed if it does not stop within a second)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        t_end = time.monotonic() + 1.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers = []
