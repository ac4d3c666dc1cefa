"""The streaming router (`train.staleness >= 2`): rollout engines driven request by request.

Driver side. The schedule (which item each engine takes next, when it may admit another, and
with which weight version) is `streamplan.StreamQueue`'s; this module sends it to the workers
and collects results request by request. Each engine serves through one call at a time,
`DeviceWorker.serve` (cluster/worker_serve.py): it starts the requests it is given, runs
engine iterations until one finishes (or a short slice passes) and returns; the router sends
the next call at once while the engine has requests. Between two calls the worker runs
whatever else the driver queued for it (a weight pull, the ops of a resize).

- Admission: an engine runs several items; it takes another (of the version it holds) when the
  item fits in its free slots (`rollout.vllm_max_num_seqs`, emulated: the replica's slots) or
  once every item it runs is down to its last request, as the simulator's `admit`; items are
  offered in rounds, the emptiest engine first (cluster/router_engines.py).
- Weights: an engine that must change version pulls it from the driver's snapshot of that
  version (`restore_rollout`, queued on the actor before the `serve` that starts the item;
  emulated: paced to the weight sync's modelled time). In deterministic mode the engine's
  digest after a pull is checked against the trainers' digest of that version. Under partial
  rollout (`rollout.partial`) the pull may come while tails run: they go on under the new
  weights, and their results say which version made which tokens.
- Emulated accelerators: a result is delivered at the time the emulator gives its request
  (`pacing.request_due`), not when the tiny real model finished it: the share's longest request
  at the share's modelled end, the others when its body ends (`StageModel.chunk`), as the
  simulator times a share on a replica; a share admitted while others run is timed from the end
  of their body (the simulator runs a replica's shares one after another, tails overlapping); a
  pull under running tails moves their ends by the pull (partial rollout).
- `migrate(devices)`, the `migrate_requests` op of a rollout -> train move: the requests in
  flight on leaving engines stop there and go back to the front of the queue (same sample
  ids and seeds; with their prefix under partial rollout), for the remaining engines. The
  move never waits for them to finish.
- `drain(devices)`: route nothing new to `devices` and pump until they have nothing in flight
  (before evaluation, which needs every engine on one version).
- Only one thread pumps at a time (the runtime's background pump during training is joined
  before the main thread pumps, migrates or resizes); results land in per-step `StepRollout`s.
- Requests in flight per engine over time are kept (`take_concurrency`) for the records.
- A lost device: its undelivered requests go back to the front of the queue and
  `DevicesLost` is raised; before the recovery `abandon` hands back the survivors' requests too
  (their engines are restored), and `set_engines` takes the new ranks (docs/faults.md).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from dynaresize.cluster.replicas import ReplicaCall
from dynaresize.cluster.router_engines import StreamEngine, StreamItem, admission_order
from dynaresize.cluster.watchdog import DevicesLost
from dynaresize.pipeline.stepstate import StepRollout
from dynaresize.pipeline.streamplan import StreamQueue
from dynaresize.types import ROLLOUT

WAKE_S = 0.02  # how often a pump looks at its stop condition while calls run
SERVE_SLICE_S = 0.1  # longest a `serve` call runs engine iterations before it answers


class StreamRouter:
    def __init__(self, cluster: Any, eta: int, buffers: dict[int, StepRollout],
                 weights: Callable[[int], Any], digests: dict[int, str] | None = None,
                 partial: bool = False) -> None:
        self.cluster = cluster
        self.queue = StreamQueue(eta=eta)
        self.partial = bool(partial)
        self.buffers = buffers  # step -> StepRollout (the runtime's `rollouts`)
        self.weights = weights  # version -> snapshot.Snapshot holding its parameters
        self.digests = digests  # version -> trainers' digest (deterministic mode), else None
        self.engines: dict[int, StreamEngine] = {}
        self.calls: list[tuple[int, int, float, float]] = []  # (device, step, t0, t1) ended since `take_calls`
        self.pulls: list[dict] = []  # weight pulls ended since `take_pulls`
        self.items_per_step: dict[int, int] = {}  # step -> items it was cut into
        self.put_back_ids: list = []  # requests of lost engines put back, until `abandon`

    # ------------------------------------------------------------------ steps and engines

    def release(self, step: int, groups: list[list[Any]]) -> None:
        """Queue `step` (its weights exist): its groups, or emulated one share per replica."""
        n = max(1, len(self.cluster.replicas()))
        items = self.cluster.pacing.rollout_chunks(step, groups, n, stream=True)
        self.items_per_step[step] = len(items)
        self.queue.release(step, items)
        # a resumed run's step may already hold the samples its checkpoint kept
        self.buffers.setdefault(step, StepRollout(step=step, remaining=[], t0=time.time()))

    def release_more(self, step: int, groups: list[list[Any]]) -> None:
        """Queue more groups of a released step (dynamic sampling), ahead of later steps."""
        items = self.cluster.pacing.rollout_chunks(step, groups, max(1, len(self.cluster.replicas())), stream=True)
        self.items_per_step[step] = self.items_per_step.get(step, 0) + len(items)
        self.queue.release_more(step, items)

    def set_engines(self, devices, version: int) -> None:
        """The replicas of the current assignment that hold `devices` serve from now on."""
        want = set(devices)
        for rep in self.cluster.replicas():
            if want & set(rep):
                self.queue.add_engine(rep[0], version)
                self.engines[rep[0]] = StreamEngine(ranks=rep)

    def remove_engines(self, devices) -> None:
        for d in self._leaders(devices):
            self.queue.remove_engine(d)
            self.engines.pop(d, None)

    def _leaders(self, devices) -> list[int]:
        """The engines (leader ranks) of the replicas holding any of `devices`."""
        want = set(devices)
        return [d for d, e in self.engines.items() if want & set(e.ranks)]

    # ------------------------------------------------------------------ pumping

    def _dispatch(self) -> None:
        """Admission rounds (cluster/router_engines.py): each open engine, the emptiest first,
        takes at most one item per round, until a round admits nothing."""
        c = self.cluster
        while True:
            took = False
            for d in admission_order({d: e for d, e in self.engines.items() if d in c.assignment.devices(ROLLOUT)}):
                e = self.engines[d]
                if self._down(e):
                    continue
                nxt = self.queue.next_for(d, admitting=e.in_tail, partial=self.partial,
                                          free=e.free(c.pacing.engine_slots(self.queue.head_step())))
                if nxt is not None:
                    self._start(d, e, nxt)
                    took = True
            if not took:
                return

    def _start(self, d: int, e: StreamEngine, nxt: Any) -> None:
        """Engine `d` takes item `nxt` (a streamplan.Dispatch): its pull first when it needs one."""
        c = self.cluster
        now, pull_s = time.time(), 0.0
        c.reach("rollout", nxt.step, list(e.ranks))  # the fault point of generating (cluster/faults.py)
        if nxt.pull:
            snap = self.weights(nxt.version)
            c.reach("weight_sync", nxt.step, list(e.ranks))  # the fault point of a pull (cluster/faults.py)
            for r in e.ranks:  # every TP rank loads the full weights (its loaders slice them)
                pull = c.pacing.call(c.workers[r], "restore_rollout", nxt.version, snap.metas, *snap.params,
                                     pace_s=c.pacing.sync_s(), step=nxt.step)
                if self.digests is not None and nxt.version in self.digests:
                    pull = (pull, c.workers[r].engine_digest.remote())
                e.pulls.append((nxt.step, r, pull))
            pull_s = c.pacing.wall_s(c.pacing.sync_s())
            for it in e.items:  # partial rollout: the tails pause for the pull
                it.due = {s: t + pull_s for s, t in it.due.items()}
        item = StreamItem(step=nxt.step, requests=nxt.item, t0=now, pending={tuple(r.sample_id): r for r in nxt.item})
        # emulated: timed from the end of the body of what the engine already runs, as the
        # simulator runs a replica's shares one after another with their tails overlapping
        item.due = c.pacing.request_due(nxt.item, max([now + pull_s] + [min(it.due.values()) for it in e.items if it.due]))
        e.items.append(item)
        e.to_add.extend(nxt.item)
        e.spans.extend([now, None] for _ in nxt.item)

    def _serve(self, inflight: dict) -> None:
        """A `serve` call to every engine with requests to start or still running and none in flight."""
        c = self.cluster
        for d, e in self.engines.items():
            if e.ref is None and (e.to_add or e.running) and not self._down(e):
                e.ref = ReplicaCall(lambda r: c.workers[r].serve.remote(e.to_add, SERVE_SLICE_S), e.ranks)
                e.to_add, e.running = [], len(e.to_add) + e.running
                inflight.update(e.ref.refs)

    def _down(self, e: StreamEngine) -> bool:
        """A replica with a lost rank is lost whole."""
        return any(r in self.cluster.watchdog.lost for r in e.ranks)

    def pump(self, until: Callable[[], bool], where: str, wait: Callable[[float], Any] | None = None) -> None:
        """Dispatch, serve and deliver until `until()`. With nothing in flight and nothing due,
        `wait(seconds)` is called (a stop event's wait); without `wait` that is an error."""
        c = self.cluster
        tracker = c.watchdog.tracker(where)
        last_poll = time.time()
        inflight = {ref: e.ref.refs[ref] for e in self.engines.values() if e.ref is not None for ref in e.ref.waiting}
        while True:
            self._deliver_due()
            self._dispatch()
            self._serve(inflight)
            if until():
                return
            due = self._next_due()
            pause = WAKE_S if due is None else min(WAKE_S, max(0.0, due - time.time()))
            if not inflight:
                if due is None and wait is None:
                    raise RuntimeError(f"stream router: {where} cannot finish: nothing queued or in flight "
                                       f"(rollout devices {c.assignment.devices(ROLLOUT)})")
                (wait or time.sleep)(pause)
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=pause)
            if not ready and time.time() - last_poll < c.watchdog.poll_s:
                continue
            last_poll = time.time()
            done, lost = tracker.poll(inflight, first=True)  # pings the busy engines (watchdog.py)
            for ref, r, ok, res in done:
                e = next((x for x in self.engines.values() if x.ref is not None and ref in x.ref.refs), None)
                if e is not None and not self._down(e) and e.ref.take(ref, res):
                    self._collect(e.ranks[0], e.ref.result())
            if lost:
                self._lost(lost, where)

    def _collect(self, d: int, res: Any) -> None:
        """A `serve` call came back (from every rank): its pulls ended too; results held until
        due (emulated) or delivered."""
        e = self.engines[d]
        e.ref = None
        for step, r, pull in e.pulls:
            self._pulled(r, step, pull)
        e.pulls = []
        e.running = int(res["running"])
        for r in res["results"]:
            item = next((it for it in e.items if tuple(r.sample_id) in it.pending), None)
            if item is None:
                raise RuntimeError(f"device {self.cluster.ids[d]} returned sample {r.sample_id}, which it was not running")
            item.held[tuple(r.sample_id)] = r
            item.real_end = max(item.real_end, res["t1"])
        self._deliver_due()

    def _deliver_due(self) -> None:
        now = time.time()
        for d, e in self.engines.items():
            for item in list(e.items):
                for sid in [s for s in item.held if item.due.get(s, 0.0) <= now]:
                    self._deliver(d, e, item, sid)

    def _deliver(self, d: int, e: StreamEngine, item: StreamItem, sid: tuple) -> None:
        c = self.cluster
        res = item.held.pop(sid)
        item.pending.pop(sid)
        dev = c.ids[d]
        t_end = max(item.due.get(sid, 0.0), item.real_end)  # emulated: when it was due (or later, an overrun)
        buf = self.buffers[item.step]
        buf.results.append((dev, res))
        buf.t1 = max(buf.t1 or t_end, t_end)
        for span in e.spans:
            if span[1] is None and span[0] == item.t0:
                span[1] = t_end
                break
        if item.pending:
            return
        e.items.remove(item)
        self.queue.done(d, item.step)
        end = max([item.real_end, *item.due.values()])
        if item.due:  # emulated: the share's paced interval, and its real seconds (overruns)
            c.pacing.note({"paced_from": item.t0, "paced_s": max(item.due.values()) - item.t0,
                           "real_s": item.real_end - item.t0})
        start = max(item.t0, e.busy_until)
        for rank_dev in [c.ids[r] for r in e.ranks]:  # every TP rank of the replica ran it
            if end > start:  # spans are the union of what the engine ran (admitted items overlap)
                buf.calls.append((rank_dev, start, end))
                buf.busy_s[rank_dev] = buf.busy_s.get(rank_dev, 0.0) + end - start
                self.calls.append((rank_dev, item.step, start, end))
            buf.last_end[rank_dev] = max(buf.last_end.get(rank_dev, end), end)
        e.busy_until = max(e.busy_until, end)

    def _next_due(self) -> float | None:
        times = [item.due[s] for e in self.engines.values() for item in e.items for s in item.held if s in item.due]
        return min(times) if times else None

    def _pulled(self, d: int, step: int, pull: Any) -> None:
        """A pull queued before a serve call that ended: it ended too; check and note it."""
        ref, digest_ref = pull if isinstance(pull, tuple) else (pull, None)
        r = ray.get(ref)
        self.cluster.pacing.note(r, stage=False)
        version = int(r["version"])
        if digest_ref is not None:
            got = ray.get(digest_ref)
            if got != self.digests.get(version, got):
                raise RuntimeError(f"weight pull of version {version} (step {step}): the engine on device "
                                   f"{self.cluster.ids[d]} does not hold the trainers' weights (digest mismatch)")
        self.pulls.append({**r, "device": self.cluster.ids[d]})

    def _hand_back(self, d: int, e: StreamEngine, sent: dict | None = None, ran: bool = False) -> list:
        """Every request engine `d` has not delivered goes back to the front of the queue as an
        item of its step, the oldest step first in line: as the engine last held it (`sent`:
        with its prefix under partial rollout) or as it was sent; paced from the prefix made
        when `ran`. Returns those requests; the engine holds no item after."""
        back = []
        for item in sorted(e.items, key=lambda it: -it.step):
            reqs = [(sent or {}).get(sid, r) for sid, r in item.pending.items()]
            ran_s = time.time() - item.t0 if ran else None
            self.queue.put_back(d, item.step, self.cluster.pacing.moved_item(item.step, reqs, item.requests,
                                                                             ran_s=ran_s))
            back += reqs
        e.items = []
        return back

    def _lost(self, lost: dict[int, str], where: str) -> None:
        for d in self._leaders(lost):  # a replica with a lost rank is lost whole
            self.put_back_ids += [tuple(r.sample_id) for r in self._hand_back(d, self.engines[d])]
            self.engines[d] = StreamEngine(ranks=self.engines[d].ranks)
        raise DevicesLost(lost, where)

    # ------------------------------------------------------------------ recovery

    def abandon(self) -> list:
        """Devices were lost (a recovery follows, which renumbers the survivors and restores
        their engines, dropping what they run): every request not delivered goes back to the
        front of the queue with its sample id and seed, and no engine is known any more.
        Returns the sample ids that went back (a lost engine's went back when it was found)."""
        back, self.put_back_ids = self.put_back_ids, []
        for d, e in self.engines.items():
            back += [tuple(r.sample_id) for r in self._hand_back(d, e)]
        for d in list(self.engines):
            self.remove_engines([d])
        self.queue.closed.clear()
        return back

    # ------------------------------------------------------------------ moves, drains, pulls

    def migrate(self, devices) -> list[dict]:
        """The `migrate_requests` op (see the module docstring): one entry per device with the
        requests it handed on (`requests_moved`)."""
        c = self.cluster
        leaders = self._leaders(devices)
        self.queue.close(leaders)
        out = []
        for d in devices:
            t0 = time.time()
            e = self.engines.get(d)
            if e is None:  # a device of no replica, or a TP rank that is not its replica's leader
                out.append({"t0": t0, "t1": time.time(), "requests_moved": 0})
                continue
            if e.ref is not None:  # its last serve call: collect what it finished
                self._collect(d, self._wait_call(e.ref, f"migrate {c.ids[d]}"))
            call = ReplicaCall(lambda r: c.workers[r].serve.remote([], 0.0, abort_all=True, keep=self.partial), e.ranks)
            stopped = self._wait_call(call, f"migrate {c.ids[d]}")
            moved = len(self._hand_back(d, e, {tuple(r.sample_id): r for r in stopped["moved"]}, ran=self.partial))
            now = time.time()
            for span in e.spans:
                span[1] = now if span[1] is None else span[1]
            self.engines[d] = StreamEngine(ranks=e.ranks, spans=e.spans)
            out.append({"t0": t0, "t1": time.time(), "requests_moved": moved})
        return out

    def _wait_call(self, call: ReplicaCall, where: str) -> dict:
        """Wait for every rank of `call` (with the watchdog); the replica's answer."""
        for ref, value in zip(call.refs, self.cluster.wait([(r, ref) for ref, r in call.refs.items()], where)):
            call.take(ref, value)
        return call.result()

    def drain(self, devices) -> tuple[float, float]:
        """Route nothing new to `devices`; pump until none of them has a request in flight.
        Returns the drain's wall start and end."""
        t0 = time.time()
        leaders = self._leaders(devices)
        self.queue.close(leaders)
        self.pump(lambda: self.queue.idle(leaders), f"drain {list(devices)}")
        return t0, time.time()

    def pull_all(self, version: int) -> None:
        """Every (drained) rollout engine pulls `version` now (before evaluation)."""
        c = self.cluster
        snap = self.weights(version)
        devices = [r for d, e in self.engines.items() if self.queue.engine_version.get(d) != version for r in e.ranks]
        out = c.wait([(d, c.pacing.call(c.workers[d], "restore_rollout", version, snap.metas, *snap.params,
                                        pace_s=c.pacing.sync_s())) for d in devices], f"rollout weights {version}")
        for d, r in zip(devices, out):
            c.pacing.note(r, stage=False)
            self.pulls.append({**r, "device": c.ids[d]})
            if d in self.engines:
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

    def take_concurrency(self, t0: float, t1: float) -> dict[int, list[tuple[float, float]]]:
        """Device id -> (admitted, delivered) of its requests in flight during [t0, t1]
        (still running: until t1); requests delivered before t1 are forgotten afterwards."""
        out: dict[int, list[tuple[float, float]]] = {}
        for d, e in self.engines.items():
            mine = [(a, t1 if b is None else b) for a, b in e.spans if (b is None or b > t0) and a < t1]
            out[self.cluster.ids[d]] = mine
            e.spans = [s for s in e.spans if s[1] is None or s[1] > t1]
        return out
