"""Driver waits on device workers that always end, and say which devices were lost.

Every wait of the driver on a worker goes through a `Tracker` (or `Watchdog.wait`, built on it),
so no wait can outlast a lost device:

- a worker whose process died surfaces at once as a Ray actor error: lost;
- a worker that stopped (its process hangs: an injected `stop`, a frozen host) answers no
  liveness ping (a worker that never answered yet may still be starting: only the call
  bound applies to it). Pings go to the worker's `ctl` thread, which answers even while the worker
  computes, so "no answer for `collective_s`" means the whole process is stuck: lost;
- a worker that answers pings but whose call neither ends nor fails while a peer of the same
  batch already failed or was lost is wedged in a collective with that peer. In a batch wait
  (`Watchdog.wait`: the calls of one collective op) the wedge clock starts at the first failure
  *or loss* of the batch (a router's or a rollout's wait, whose calls are independent, starts
  it at a failure only): a killed peer raises no error of its own
  (its call ends as an actor error), and on NCCL the survivors' calls do not fail either (a
  collective returns once enqueued; the survivor blocks at its next device sync until the
  communicator is aborted or its timeout fires). Every group has an explicit timeout of at
  most `collective_s`, so a healthy survivor is freed within that; one still busy
  `collective_s + margin` after the first failure or loss is declared lost too (and says why);
- a call that runs past `actor_call_s` (a bound for compute, not for collectives) is lost.

On the first loss of a batch (`Watchdog.wait`), the survivors still in it are told to abort
their communicators (`on_loss`, the cluster's `abort_comms` on each worker's `ctl` thread: the
abort NCCL provides for another thread), so they leave the collective with the lost peer at
once instead of at the timeout; gloo's abort does not interrupt a running collective, so on
CPU the group's timeout frees them (docs/faults.md, NCCL semantics).

A call that fails with the worker's own exception while no device is lost is a genuine error
and is re-raised unchanged (a reward function, a bug): the watchdog never turns errors into
faults. Losses are also written into a shared `lost` dict (rank -> reason), so a wait running
in another driver thread gives up on that device at once instead of timing out twice.

Detection latency: a killed worker is seen within one poll (`poll_s`); a stopped one within
`collective_s + poll_s` of its call starting; a survivor wedged with either, within
`collective_s + margin + poll_s` of that loss (never `actor_call_s`).

`DevicesLost` is raised only once every call of the batch has ended or been given up, so no
survivor is still inside that batch's collective.

Time and Ray come in through the watchdog (`clock`, `api`: `time.time` and the `ray` module by
default), so unit tests drive it with a fake clock and fake calls, without sleeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray

WEDGE_MARGIN_S = 2.0  # added to collective_s before a busy, answering survivor counts as wedged


class DevicesLost(Exception):
    """Devices (world ranks) were lost during `where`. Driver-side only; never crosses Ray."""

    def __init__(self, lost: dict[int, str], where: str) -> None:
        self.lost = dict(lost)
        self.where = where
        super().__init__(f"devices {sorted(self.lost)} lost during {where}: "
                         + "; ".join(f"{d}: {r}" for d, r in sorted(self.lost.items())))


def is_lost_error(exc: BaseException) -> bool:
    """Whether an error from a call means the actor itself is gone (not a failure it raised)."""
    return isinstance(exc, ray.exceptions.RayActorError)


@dataclass
class Tracker:
    """Liveness state of one wait (one batch of calls, or one router's in-flight calls)."""

    dog: "Watchdog"
    where: str
    deadline_s: float | None = None  # calls still running this long after the start: lost
    t_start: float = field(default_factory=time.time)  # `Watchdog.tracker` sets it from the watchdog's clock
    alive_at: dict[int, float] = field(default_factory=dict)
    pings: dict[int, Any] = field(default_factory=dict)
    first_failure: float | None = None  # first failure (or loss, with `wedge_on_loss`): the wedge clock's start
    wedge_on_loss: bool = False  # a batch of one collective op (`Watchdog.wait`): a loss starts the clock too

    def poll(self, inflight: dict[Any, int], *, first: bool = False
             ) -> tuple[list[tuple[Any, int, bool, Any]], dict[int, str]]:
        """Wait up to the poll interval on `inflight` (ref -> rank): for all of them, or with
        `first` only until one ends (a router that dispatches more work at once).

        Returns (done, lost): done = (ref, rank, ok, value or exception) for calls that ended
        (removed from `inflight`); lost = ranks newly declared lost (their refs are removed too).
        """
        dog = self.dog
        api = dog.api
        done_out: list[tuple[Any, int, bool, Any]] = []
        lost: dict[int, str] = {}
        if inflight:
            ready, _ = api.wait(list(inflight), num_returns=1 if first else len(inflight), timeout=dog.poll_s)
        else:
            ready = []
        now = dog.clock()
        for ref in ready:
            rank = inflight.pop(ref)
            try:
                done_out.append((ref, rank, True, api.get(ref)))
                dog.seen.add(rank)
            except Exception as exc:  # noqa: BLE001 - classified below
                if is_lost_error(exc):
                    lost[rank] = f"worker died during {self.where} ({type(exc).__name__})"
                else:
                    self.first_failure = self.first_failure or now
                    done_out.append((ref, rank, False, exc))
        busy = sorted({r for r in inflight.values()} - set(lost))
        for rank in busy:
            known = dog.lost.get(rank)
            if known is not None:
                lost[rank] = known
                continue
            self.alive_at.setdefault(rank, self.t_start)
            ping = self.pings.get(rank)
            if ping is not None:
                ready_ping, _ = api.wait([ping], timeout=0)
                if ready_ping:
                    self.pings.pop(rank)
                    try:
                        api.get(ping)
                        self.alive_at[rank] = now
                        dog.seen.add(rank)
                    except Exception as exc:  # noqa: BLE001
                        if is_lost_error(exc):
                            lost[rank] = f"worker died during {self.where} ({type(exc).__name__})"
                            continue
            if rank not in self.pings:
                self.pings[rank] = dog.ping(rank)
            silent = now - self.alive_at[rank]
            if silent > dog.collective_s and rank in dog.seen:  # a worker still starting may be slow
                lost[rank] = f"no answer for {silent:.1f}s during {self.where} (stopped)"
            elif self.first_failure is not None and now - self.first_failure > dog.collective_s + dog.margin_s:
                lost[rank] = (f"still busy {now - self.first_failure:.1f}s after a peer failed or was lost during "
                              f"{self.where} (wedged in a collective)")
            elif now - self.t_start > (self.deadline_s or dog.call_s):
                lost[rank] = f"no result within {self.deadline_s or dog.call_s:g}s during {self.where}"
        if lost:  # a killed peer starts the wedge clock as a failure does (module docstring)
            self._lost_at(now)
        for ref, rank in list(inflight.items()):
            if rank in lost:
                inflight.pop(ref)
        for rank, why in lost.items():
            dog.lost.setdefault(rank, why)
            dog.lost_at.setdefault(rank, now)
        return done_out, lost

    def _lost_at(self, now: float) -> None:
        """A peer of this wait was lost at `now`: in a batch of one collective op, its survivors
        are freed by the groups' timeout from then on (the wedge clock starts). A router's or a
        rollout's wait (independent calls) leaves the clock alone: its other calls run on."""
        if self.wedge_on_loss and self.first_failure is None:
            self.first_failure = now


class Watchdog:
    """Deadlines and liveness for the driver's waits on the workers of one cluster."""

    def __init__(self, *, ping: Callable[[int], Any], collective_s: float, call_s: float,
                 poll_s: float | None = None, margin_s: float = WEDGE_MARGIN_S,
                 on_loss: Callable[[list[int]], Any] | None = None,
                 clock: Callable[[], float] | None = None, api: Any = None) -> None:
        """`on_loss(ranks)`: called once per `wait`, at its first loss, with the ranks still in
        the batch (the survivors to abort); `clock`, `api`: time and Ray (module docstring)."""
        self.ping = ping  # rank -> ObjectRef of a liveness call on the worker's ctl thread
        self.on_loss = on_loss
        self.clock = clock or (lambda: time.time())  # looked up at each call (tests patch `time`)
        self._api = api
        self.collective_s = float(collective_s)
        self.call_s = float(call_s)
        self.poll_s = float(poll_s) if poll_s is not None else max(0.05, min(0.5, collective_s / 10))
        self.margin_s = float(margin_s)
        self.lost: dict[int, str] = {}  # shared by every wait: ranks lost and not yet recovered
        self.lost_at: dict[int, float] = {}  # when each was declared lost
        self.seen: set[int] = set()  # ranks that answered once (started): silence means stopped

    @property
    def api(self) -> Any:
        """What the watchdog waits with (`wait`, `get`): the `ray` module unless one was given."""
        return ray if self._api is None else self._api

    def tracker(self, where: str, deadline_s: float | None = None, *, wedge_on_loss: bool = False) -> Tracker:
        return Tracker(self, where, deadline_s=deadline_s, t_start=self.clock(), wedge_on_loss=wedge_on_loss)

    def wait(self, calls: Sequence[tuple[int, Any]], where: str, *, deadline_s: float | None = None) -> list[Any]:
        """Results of `calls` ((rank, ref) pairs) in order.

        Raises `DevicesLost` once every call has ended or been given up, when any device was
        lost; re-raises a worker's own error when one failed and none was lost.
        """
        tracker = self.tracker(where, deadline_s, wedge_on_loss=True)
        index = {ref: i for i, (_, ref) in enumerate(calls)}
        inflight = {ref: rank for rank, ref in calls}
        results: list[Any] = [None] * len(calls)
        errors: list[BaseException] = []
        lost: dict[int, str] = {}
        aborted = False
        while inflight:
            done, newly = tracker.poll(inflight)
            lost.update(newly)
            if lost and not aborted and inflight and self.on_loss is not None:
                aborted = True  # survivors leave the collective with the lost peer now, not at its timeout
                self.on_loss(sorted(set(inflight.values())))
            for ref, _, ok, value in done:
                if ok:
                    results[index[ref]] = value
                else:
                    errors.append(value)
        if lost:
            raise DevicesLost(lost, where)
        if errors:
            raise errors[0]
        return results

    def clear(self, num_ranks: int) -> None:
        """After a recovery: the lost ranks are gone and the `num_ranks` survivors renumbered."""
        self.lost.clear()
        self.lost_at.clear()
        self.seen = set(range(num_ranks))
