"""The driver's wedge clock under NCCL's failure semantics (cluster/watchdog.py), on a fake clock.

A killed peer raises no error of its own and, on NCCL, its survivors' calls do not fail either
(a collective returns once enqueued): a survivor that stays busy with the dead peer must be
given up `collective_s` plus a margin after the loss, not after `actor_call_s`. Ray and time are
stand-ins (module attributes patched, as tests/unit/test_config_fields.py does): no sleeping.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import ray

from dynaresize.cluster import watchdog as wd


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def time(self) -> float:
        return self.t


class FakeRay:
    """Calls scripted by rank: ("ok", t_end) ends at t_end, ("dead", t) dies at t, ("busy",)
    never ends but its worker answers pings. `wait` advances the clock by its timeout when
    fewer than `num_returns` calls are ready (what a real wait does while nothing happens)."""

    exceptions = ray.exceptions

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.start = clock.t
        self.script: dict[object, tuple] = {}

    def call(self, *script) -> object:
        ref = object()
        self.script[ref] = script
        return ref

    def _ready(self, ref) -> bool:
        kind, *rest = self.script[ref]
        return kind == "ping" or (kind in ("ok", "dead") and self.clock.t >= rest[0])

    def wait(self, refs, num_returns: int = 1, timeout: float | None = None):
        if self.clock.t - self.start > 2 * CALL_S:
            raise AssertionError(f"still waiting {self.clock.t - self.start:.0f} s into the batch (> 2 x actor_call_s)")
        ready = [r for r in refs if self._ready(r)]
        if len(ready) < num_returns and timeout:
            self.clock.t += timeout
            ready = [r for r in refs if self._ready(r)]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        kind, *rest = self.script[ref]
        if kind == "dead":
            raise ray.exceptions.RayActorError()
        return rest[-1] if kind == "ok" else 0


COLLECTIVE_S, CALL_S, MARGIN_S = 30.0, 900.0, 2.0


def _dog(fake: FakeRay, **kw) -> wd.Watchdog:
    dog = wd.Watchdog(ping=lambda rank: fake.call("ping"), collective_s=COLLECTIVE_S, call_s=CALL_S,
                      poll_s=0.5, margin_s=MARGIN_S, **kw)
    dog.seen = {0, 1, 2}
    return dog


def _run_batch(calls, **kw):
    clock = Clock()
    fake = FakeRay(clock)
    t0 = clock.t
    with mock.patch.object(wd, "ray", fake), mock.patch.object(wd, "time", SimpleNamespace(time=clock.time)):
        dog = _dog(fake, **kw)
        refs = [(rank, fake.call(*(s if s[0] == "busy" else (s[0], t0 + s[1], rank)))) for rank, s in calls]
        with pytest.raises(wd.DevicesLost) as info:
            dog.wait(refs, "train 3")
    return info.value, clock.t - t0, dog


def test_killed_peer_batch_is_lost_after_collective_s_plus_margin_not_actor_call_s():
    """Rank 0 is killed 5 s into the batch; rank 1 stays busy in the collective with it (NCCL:
    blocked at its next device sync) and answers pings; rank 2 ends normally."""
    exc, elapsed, _ = _run_batch([(0, ("dead", 5.0)), (1, ("busy",)), (2, ("ok", 1.0))])
    assert sorted(exc.lost) == [0, 1]
    assert "wedged" in exc.lost[1], exc.lost[1]
    # declared lost once collective_s + margin passed after the loss (at 5 s), within two polls
    assert 5.0 + COLLECTIVE_S + MARGIN_S < elapsed <= 5.0 + COLLECTIVE_S + MARGIN_S + 1.0, elapsed
    assert elapsed < CALL_S


def test_first_loss_aborts_the_survivors_still_in_the_batch_once():
    """The survivors still inside the batch are told to abort their communicators at the first
    loss (the cluster's `abort_comms` on their ctl threads), once per wait; a rank that already
    ended is not told."""
    told: list[list[int]] = []
    exc, _, _ = _run_batch([(0, ("dead", 5.0)), (1, ("busy",)), (2, ("busy",)), (3, ("ok", 1.0))],
                           on_loss=told.append)
    assert told == [[1, 2]]
    assert sorted(exc.lost) == [0, 1, 2]


def test_router_wait_does_not_start_the_wedge_clock_on_a_loss():
    """A router's or rollout's tracker waits on independent calls: a loss there leaves the
    other calls running (they are no collective with the lost device)."""
    clock = Clock()
    fake = FakeRay(clock)
    with mock.patch.object(wd, "ray", fake), mock.patch.object(wd, "time", SimpleNamespace(time=clock.time)):
        dog = _dog(fake)
        tracker = dog.tracker("rollout 2")
        inflight = {fake.call("dead", clock.t + 1.0): 0, fake.call("busy"): 1}
        lost: dict = {}
        while clock.t < 1000.0 + COLLECTIVE_S + MARGIN_S + 10.0:
            _, newly = tracker.poll(inflight, first=True)
            lost.update(newly)
    assert sorted(lost) == [0] and list(inflight.values()) == [1]
