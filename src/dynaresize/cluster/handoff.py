"""The optimizer moments' hand-off after a resize, as an explicit state with events.

A resize moves parameter shards on its critical path and leaves the Adam moments for later
(`reshard.background_moments`): the old trainers keep their moment shards until they have sent
them to their new owners. This object holds what that later move needs and says where it is:

    idle --arm--> pending --run--> moving --> done
                                         \\--> failed (the error is kept and raised again)

- `arm` (in `reshard_params`): the old pieces, the old layout and the new training ranks.
- `run(move)` (in `reshard_moments`, on the worker's issuing thread: cluster/worker.py): runs
  the move once; a second call, or a call with nothing armed, does nothing.
- `require_done()` (before a trainer's optimizer step): returns when done, raises the move's
  error when failed, and raises when the hand-off is still pending: the driver queues
  `reshard_moments` before the next training call on every device of the resize, so pending
  here means an ordering bug, which must stop the step rather than train on missing moments.
- `done` / `armed` are `threading.Event`s, for code on another thread that only watches (a
  liveness ping, tests); no other thread ever runs the move.

Pure Python (threading only): the move itself is a callable the worker passes in.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

IDLE, PENDING, MOVING, DONE, FAILED = "idle", "pending", "moving", "done", "failed"


class MomentHandoff:
    """Where the moments of the last resize are (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields; never held while the move runs
        self.state = IDLE
        self.armed = threading.Event()
        self.done = threading.Event()
        self.done.set()  # nothing to wait for until a resize arms it
        self.old_pieces: dict[str, list[Any]] | None = None
        self.old_layout: Any = None
        self.new_ranks: tuple[int, ...] = ()
        self.error: BaseException | None = None

    def arm(self, old_pieces: dict[str, list[Any]] | None, old_layout: Any, new_ranks: Sequence[int]) -> None:
        """A resize moved the parameters; its moments (`old_pieces`, None on a device that held
        none) are to move to the layout over `new_ranks`."""
        with self._lock:
            if self.state in (PENDING, MOVING):
                raise RuntimeError(f"moment hand-off: a resize armed it while it is {self.state}; the "
                                   "previous resize's moments must move first")
            self.state, self.error = PENDING, None
            self.old_pieces, self.old_layout, self.new_ranks = old_pieces, old_layout, tuple(sorted(new_ranks))
            self.done.clear()
            self.armed.set()

    def run(self, move: Callable[["MomentHandoff"], dict]) -> dict | None:
        """Run `move(self)` if armed (once); its result, or None when there was nothing to move."""
        with self._lock:
            if self.state != PENDING:
                return None
            self.state = MOVING
        try:
            result = move(self)
        except BaseException as exc:
            with self._lock:
                self.state, self.error = FAILED, exc
            raise
        else:
            with self._lock:
                self.state = DONE
        finally:  # the state is final before a watcher sees `done`
            with self._lock:
                self.old_pieces = None  # the old shards are sent (or lost with the move): free them
                self.armed.clear()
            self.done.set()
        return result

    def require_done(self) -> None:
        """Raise unless the last armed move is done (see the module docstring)."""
        with self._lock:
            state, error = self.state, self.error
        if state == FAILED:
            raise RuntimeError(f"moment hand-off failed: {error!r}") from error
        if state in (PENDING, MOVING):
            raise RuntimeError(f"moment hand-off is {state} at an optimizer step: the driver must queue "
                               "reshard_moments before the next training call (cluster/handoff.py)")

    def reset(self) -> None:
        """Forget everything (recovery: the world the moments lived in is gone)."""
        with self._lock:
            self.state, self.error, self.old_pieces, self.old_layout, self.new_ranks = IDLE, None, None, None, ()
            self.armed.clear()
            self.done.set()
