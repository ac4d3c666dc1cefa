"""The streaming router (`train.staleness >= 2`): rollout engines kept busy across steps.

Driver side. The schedule (which item each free engine runs next, and with which weight
version) is `streamplan.StreamQueue`'s; this module sends it to the workers and collects the
results. Requests stay in flight across the runtime's windows: `pump` dispatches and collects
until a condition holds and returns without waiting for the calls still running.

- Weights: an engine that must change version pulls it from the driver's snapshot of that
  version (`restore_rollout`, chained before its `generate` on the same actor, so the two run in
  order; emulated: paced to the weight sync's modelled time). In deterministic mode the engine's
  digest after a pull is checked against the trainers' digest of that version.
- One item per engine at a time, so an engine whose call came back has nothing in flight.
- `drain(devices)`: route nothing new to `devices` and pump (the other engines go on) until
  they have nothing in flight; returns when it started and ended (a resize's `drain_s`).
- Only one thread pumps at a time (the runtime's background pump during training is joined
  before the main thread pumps, drains or resizes); results land in per-step `StepRollout`s.
- A lost device: its item goes back to the front of the queue and `DevicesLost` is raised
  (the runtime stops the run: recovery is not supported under streaming, docs/pipeline.md).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from dynaresize.cluster.watchdog import DevicesLost
from dynaresize.pipeline.stepstate import StepRollout
from dynaresize.pipeline.streamplan import StreamQueue
from dynaresize.types import ROLLOUT

WAKE_S = 0.02  # how often a pump looks at its stop condition while calls run


class StreamRouter:
    def __init__(self, cluster: Any, eta: int, buffers: dict[int, StepRollout],
                 weights: Callable[[int], Any], digests: dict[int, str] | None = None) -> None:
        self.cluster = cluster
        self.queue = StreamQueue(eta=eta)
        self.buffers = buffers  # step -> StepRollout (the runtime's `rollouts`)
        self.weights = weights  # version -> snapshot.Snapshot holding its parameters
        self.digests = digests  # version -> trainers' digest (deterministic mode), else None
        self.inflight: dict[Any, int] = {}  # generate ref -> rank
        self.meta: dict[Any, tuple[int, int, Any, Any]] = {}  # ref -> (rank, step, item, pull ref)
        self.calls: list[tuple[int, int, float, float]] = []  # (device, step, t0, t1) ended since `take_calls`
        self.pulls: list[dict] = []  # weight pulls ended since `take_pulls`
        self.items_per_step: dict[int, int] = {}  # step -> items (engine calls) it was cut into

    # ------------------------------------------------------------------ steps and engines

    def release(self, step: int, groups: list[list[Any]]) -> None:
        """Queue `step` (its weights exist): its groups, or emulated one share per rollout device."""
        n = max(1, len(self.cluster.assignment.devices(ROLLOUT)))
        items = self.cluster.pacing.rollout_chunks(step, groups, n, stream=True)
        self.items_per_step[step] = len(items)
        self.queue.release(step, items)
        self.buffers[step] = StepRollout(step=step, remaining=[], t0=time.time())

    def set_engines(self, devices, version: int) -> None:
        for d in devices:
            self.queue.add_engine(d, version)

    def remove_engines(self, devices) -> None:
        for d in devices:
            self.queue.remove_engine(d)

    # ------------------------------------------------------------------ pumping

    def _dispatch(self) -> None:
        c = self.cluster
        for d in c.assignment.devices(ROLLOUT):
            if d in c.watchdog.lost:
                continue
            nxt = self.queue.next_for(d)
            if nxt is None:
                continue
            pull = None
            if nxt.pull:
                snap = self.weights(nxt.version)
                pull = c.pacing.call(c.workers[d], "restore_rollout", nxt.version, snap.metas, *snap.params,
                                     pace_s=c.pacing.sync_s())
                if self.digests is not None:
                    pull = (pull, c.workers[d].engine_digest.remote())
            ref = c.pacing.call(c.workers[d], "generate", nxt.item, nxt.step, pace_s=getattr(nxt.item, "pace_s", None))
            self.inflight[ref] = d
            self.meta[ref] = (d, nxt.step, nxt.item, pull)

    def pump(self, until: Callable[[], bool], where: str, wait: Callable[[float], Any] | None = None) -> None:
        """Dispatch and collect until `until()`. With nothing in flight and nothing to dispatch,
        `wait(seconds)` is called (a stop event's wait); without `wait` that is an error."""
        c = self.cluster
        tracker = c.watchdog.tracker(where)
        last_poll = time.time()
        while True:
            self._dispatch()
            if until():
                return
            if not self.inflight:
                if wait is None:
                    raise RuntimeError(f"stream router: {where} cannot finish: nothing queued or in flight "
                                       f"(rollout devices {c.assignment.devices(ROLLOUT)})")
                wait(WAKE_S)
                continue
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=WAKE_S)
            if not ready and time.time() - last_poll < c.watchdog.poll_s:
                continue
            last_poll = time.time()
            done, lost = tracker.poll(self.inflight, first=True)  # pings the busy engines (watchdog.py)
            for ref, d, ok, res in done:
                self._collect(ref, ok, res)
            if lost:
                for ref in [r for r in self.meta if r not in self.inflight]:
                    d, step, item, _ = self.meta.pop(ref)
                    self.queue.put_back(d, step, item)
                raise DevicesLost(lost, where)

    def _collect(self, ref: Any, ok: bool, res: Any) -> None:
        d, step, item, pull = self.meta.pop(ref)
        c = self.cluster
        if not ok:
            raise res  # the engine's own error: nothing to retry
        if pull is not None:
            self._pulled(d, step, pull)
        c.pacing.note(res)
        buf, dev = self.buffers[step], c.ids[d]
        buf.results.extend((dev, r) for r in res["results"])
        buf.calls.append((dev, res["t0"], res["t1"]))
        buf.busy_s[dev] = buf.busy_s.get(dev, 0.0) + res["t1"] - res["t0"]
        buf.last_end[dev] = max(buf.last_end.get(dev, res["t1"]), res["t1"])
        buf.t1 = max(buf.t1 or res["t1"], res["t1"])
        self.calls.append((dev, step, res["t0"], res["t1"]))
        self.queue.done(d, step)

    def _pulled(self, d: int, step: int, pull: Any) -> None:
        """A pull chained before an engine call that ended: it ended too; check and note it."""
        ref, digest_ref = pull if isinstance(pull, tuple) else (pull, None)
        r = ray.get(ref)
        self.cluster.pacing.note(r, stage=False)
        version = int(r["version"])
        if digest_ref is not None:
            got = ray.get(digest_ref)
            if got != self.digests[version]:
                raise RuntimeError(f"weight pull of version {version} (step {step}): the engine on device "
                                   f"{self.cluster.ids[d]} does not hold the trainers' weights (digest mismatch)")
        self.pulls.append({**r, "device": self.cluster.ids[d]})

    def drain(self, devices) -> tuple[float, float]:
        """Route nothing new to `devices`; pump until none of them has a request in flight.
        Returns the drain's wall start and end."""
        t0 = time.time()
        self.queue.close(devices)
        self.pump(lambda: self.queue.idle(devices), f"drain {list(devices)}")
        return t0, time.time()

    def pull_all(self, version: int) -> None:
        """Every (drained) rollout engine pulls `version` now (before evaluation)."""
        c = self.cluster
        snap = self.weights(version)
        devices = [d for d in c.assignment.devices(ROLLOUT) if self.queue.engine_version.get(d) != version]
        out = c.wait([(d, c.pacing.call(c.workers[d], "restore_rollout", version, snap.metas, *snap.params,
                                        pace_s=c.pacing.sync_s())) for d in devices], f"rollout weights {version}")
        for d, r in zip(devices, out):
            c.pacing.note(r, stage=False)
            self.pulls.append({**r, "device": c.ids[d]})
            self.queue.engine_version[d] = version
        for d in c.assignment.devices(ROLLOUT):
            self.queue.closed.discard(d)

    # ------------------------------------------------------------------ what the runtime reads

    def take_calls(self) -> list[tuple[int, int, float, float]]:
        out, self.calls = self.calls, []
        return out

    def take_pulls(self) -> list[dict]:
        out, self.pulls = self.pulls, []
        return out
