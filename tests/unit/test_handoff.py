"""The moments' hand-off as an explicit state (cluster/handoff.py): transitions, events, errors.

Before: two loose fields (`_moments_done`, an Event, and `_inline_moments`, a callable) written
by one thread and read by another without synchronisation; a trainer whose moments were never
moved waited at `_moments_done.wait()` forever, and nothing told a pending hand-off from a lost
one. Now a step on a pending hand-off raises at once (`test_an_optimizer_step_refuses...`).
"""

from __future__ import annotations

import threading

import pytest

from dynaresize.cluster.handoff import DONE, FAILED, IDLE, MOVING, PENDING, MomentHandoff


def test_a_hand_off_moves_once_and_frees_the_old_pieces():
    h = MomentHandoff()
    assert h.state == IDLE and h.done.is_set() and not h.armed.is_set()
    h.require_done()  # nothing armed: an optimizer step may run
    assert h.run(lambda _h: {"bytes_received": 1}) is None  # nothing to move
    h.arm({"exp_avg": [1, 2]}, "layout", (3, 1))
    assert h.state == PENDING and h.armed.is_set() and not h.done.is_set() and h.new_ranks == (1, 3)
    seen = []

    def move(handoff):
        seen.append((handoff.state, handoff.old_pieces, handoff.old_layout))
        return {"bytes_received": 8}

    assert h.run(move) == {"bytes_received": 8}
    assert seen == [(MOVING, {"exp_avg": [1, 2]}, "layout")]
    assert h.state == DONE and h.done.is_set() and not h.armed.is_set() and h.old_pieces is None
    assert h.run(move) is None and len(seen) == 1  # a second call does nothing
    h.require_done()


def test_an_optimizer_step_refuses_a_pending_hand_off():
    h = MomentHandoff()
    h.arm(None, "layout", (0,))
    with pytest.raises(RuntimeError, match="pending at an optimizer step"):
        h.require_done()


def test_a_failed_move_is_raised_again_at_the_optimizer_step():
    h = MomentHandoff()
    h.arm({"exp_avg": []}, "layout", (0, 1))

    def broken(_h):
        raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError):
        h.run(broken)
    assert h.state == FAILED and h.done.is_set() and h.old_pieces is None
    with pytest.raises(RuntimeError, match="failed: ConnectionError") as info:
        h.require_done()
    assert isinstance(info.value.__cause__, ConnectionError)
    h.arm(None, "layout", (0,))  # the next resize may arm it again
    assert h.state == PENDING and h.error is None


def test_arming_twice_before_the_move_is_refused():
    h = MomentHandoff()
    h.arm(None, "a", (0,))
    with pytest.raises(RuntimeError, match="previous resize's moments must move first"):
        h.arm(None, "b", (1,))


def test_another_thread_watches_the_done_event_and_reset_clears_it():
    h = MomentHandoff()
    h.arm({"exp_avg": [0]}, "layout", (0,))
    woke = []
    watcher = threading.Thread(target=lambda: woke.append(h.done.wait(10)))
    watcher.start()
    h.run(lambda _h: {})
    watcher.join(10)
    assert woke == [True]
    h.arm({"exp_avg": [0]}, "layout", (0,))
    h.reset()  # recovery: the world the moments lived in is gone
    assert h.state == IDLE and h.done.is_set() and h.old_pieces is None
    h.require_done()
