"""The run's in-memory snapshots: full every K steps, parameters between, off the step's path.

After step s's optimizer step the trainers start a host copy of version s+1: every kind
(parameters, moments, reference) when s+1 is a multiple of K, a checkpoint boundary or the run's
end ("full"), the parameters only otherwise ("params": enough to serve rollout pulls and the
engines' weights after a loss). The request rides on the step's own training call (the
`snapshot` argument of the trainers' `train` / last `train_part`), so no call of its own sits on
the step's path; the copy runs on a copy thread of each trainer, overlapped with what follows,
and the next optimizer step waits for it (`snap_wait_s`). The arrays go to the object store of
the trainer's node (`snapshot_take`, cluster/worker_recovery.py: results owned by the driver, so
they outlive the trainer; full ones get a holder on another node on multi-node runs). The
driver issues those calls and waits for their small metas on its own threads
(driver/snapshot_collect.py): the main thread only hands the version over and later finds it
done (`poll`), never holding the arrays; the streaming router's thread may complete a version
too (`_lock`). A call without the request (a replayed version: `params_now`) falls back to
`snapshot_begin` + `snapshot_take` from the main thread.

Recovery by replay: the scored samples of every step since the last full snapshot are kept
(`replay`: small, prompt and response tokens); on a loss the trainers restore the last full
snapshot and train those steps again (driver/recovery.py). Deterministic mode makes the replayed
state equal the lost one (fixed micro-batch composition and reduction order).

K: `checkpoint.snapshot_every_steps`, or Young/Daly from the start snapshot's measured seconds,
`checkpoint.mtbf_s` and the first step's time (costmodel/snapshot_interval.py), said once.

Invariants:
- a full snapshot counts (`latest_full`) only once complete (every shard in the object store,
  replicas pinned); the replay log keeps every step from the latest full one on, so the state
  after any trained step is recoverable: the latest full snapshot plus its replay;
- the copy of version v reads version v: it starts right after the optimizer step that made v,
  and the next step's optimizer (or a resize: `settle`) waits for it;
- the object store holds one full snapshot (an older one keeps its parameters only once a newer
  one is complete) and the parameter versions a window needs;
- one `snapshot` record per snapshot (docs/records.md): critical_s is everything it puts on the
  step's path (the main thread's hand-over, commit and any blocking wait, plus the optimizer's
  wait for the copy); the collector threads' time (`collector_s`) is off that path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import ray

from dynaresize.cluster import snapshot
from dynaresize.costmodel.snapshot_interval import expected_replay_steps, snapshot_every
from dynaresize.driver.snapshot_collect import Collector as _Collector
from dynaresize.driver.snapshot_collect import Flag as _Flag
from dynaresize.driver.console import say
from dynaresize.pipeline.stepstate import rollout_version


@dataclass
class _Pending:
    version: int
    kind: str
    devices: tuple[int, ...]
    metas: list[Any]
    params: list[Any]
    others: list[Any]
    issue_s: float
    nodes: list[str] | None = None  # Ray node of each shard's primary (multi-node runs)
    wait_s: float = 0.0
    gate_s: float | None = None
    # Issued by the collector thread (None: by the main thread, the fallback): set once the
    # refs above are in; `done` once the metas are (`result`) or the wait failed (`error`).
    issued: "_Flag | None" = None
    done: "_Flag | None" = None
    result: list[dict] | None = None
    error: BaseException | None = None
    collector_s: float = 0.0  # the collector thread's time to issue the calls (off the main thread)
    snap: snapshot.Snapshot | None = None  # built by the collector once the metas are in


@dataclass
class _Row:
    """A completed snapshot's record fields, emitted once the optimizer's wait on it is known."""

    fields: dict
    gate_known: bool = False


class Snapshots:
    """version -> `snapshot.Snapshot` (a mapping; a pending version is completed when read)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        cfg = run.cfg
        self.every: int | None = cfg.checkpoint.snapshot_every_steps or None
        self.done: dict[int, snapshot.Snapshot] = {}
        self.pending: dict[int, _Pending] = {}
        self.replay: dict[int, Any] = {}  # step -> its ScoredStep, for every step since the latest full
        self.rows: dict[int, _Row] = {}
        self.full_s: float | None = None  # the start snapshot's copy seconds (Young/Daly's cost)
        self.bytes_total = 0  # bytes of the per-step snapshots (not the start's nor a recovery's)
        self.kinds: dict[str, int] = {"full": 0, "params": 0}
        self._t_prev: float | None = None
        self._started: tuple[int, str] | None = None  # (version, kind) every trainer's step call began
        self._collector: _Collector | None = None
        self._lock = threading.RLock()  # completing a version: the main thread or the streaming router's

    def __getitem__(self, version: int) -> snapshot.Snapshot:
        if version in self.pending:
            self.complete(version)
        return self.done[version]

    def __setitem__(self, version: int, snap: snapshot.Snapshot) -> None:
        self.done[version] = snap

    def __contains__(self, version: object) -> bool:
        return version in self.done or version in self.pending

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(set(self.done) | set(self.pending)))

    def items(self) -> list[tuple[int, snapshot.Snapshot]]:
        """The completed snapshots (a pending one is not usable yet)."""
        return sorted(self.done.items())

    def latest_full(self) -> int:
        return max(v for v, s in self.done.items() if s.others is not None)

    def start(self, version: int, devices: tuple[int, ...]) -> None:
        """The blocking full snapshot at the run's start (or resume): its cost sets K."""
        t0 = time.time()
        snap = snapshot.take(self.run.cluster, version, devices)
        self.done[version] = snap
        self.full_s = max(m.get("seconds", 0.0) for m in snap.metas)
        self._row(version, "full", snap.metas, seconds=self.full_s, critical_s=time.time() - t0, cause="start")
        self._t_prev = time.time()
        self._check_capacity(snap)
        self._collector = _Collector()  # its threads start here, not on a step's path
        if self.every is not None:
            say(f"dynaresize: full snapshots every {self.every} steps (checkpoint.snapshot_every_steps); "
                "parameters-only copies between, recovery replays the steps since the last full one")

    def kind_for(self, version: int) -> str:
        cfg = self.run.cfg
        every_ckpt = cfg.checkpoint.every_steps
        if version >= cfg.steps or (every_ckpt and version % every_ckpt == 0):
            return "full"  # a checkpoint is written from it
        if self.every is not None and version % self.every == 0:
            return "full"
        return "params"

    def _choose_every(self) -> None:
        """Young/Daly's K, once: from the start snapshot's cost and the first step's time."""
        if self.every is not None:
            return
        cfg = self.run.cfg
        step_s = time.time() - (self._t_prev or time.time())
        self.every = snapshot_every(0, self.full_s or 0.0, cfg.checkpoint.mtbf_s, step_s)
        say(f"dynaresize: full snapshots every {self.every} steps (Young/Daly: a full snapshot "
            f"{self.full_s or 0.0:.3f} s, checkpoint.mtbf_s {cfg.checkpoint.mtbf_s:g} s, the first step "
            f"{step_s:.2f} s; checkpoint.snapshot_every_steps sets it); expected replay per fault "
            f"{expected_replay_steps(self.every):.1f} steps")

    def request(self, version: int) -> tuple[int, str]:
        """The `snapshot` argument of the training call that makes `version`: its trainers start
        the copy (of this kind) right after their optimizer step. Version 1's kind is decided
        before K is chosen (after step 0): full only if set or a checkpoint needs it."""
        return version, self.kind_for(version)

    def begin(self, version: int, devices: tuple[int, ...], kind: str | None = None) -> None:
        """Collect the snapshot of `version` on the trainers `devices` (started by the step call
        when `after_train` saw every trainer confirm it; else started here) and return."""
        t0 = time.perf_counter()
        self._choose_every()
        started, self._started = self._started, None
        cluster = self.run.cluster
        nodes = [cluster.node_of(d) for d in devices] if cluster.nodes else None
        if kind is None and started is not None and started[0] == version:
            if self._collector is None:  # normally made by `start`
                self._collector = _Collector()
            p = _Pending(version=version, kind=started[1], devices=tuple(devices), metas=[], params=[], others=[],
                         issue_s=0.0, nodes=nodes)
            self._collector.submit(p, cluster.workers)
            self.pending[version] = p
            p.issue_s = time.perf_counter() - t0
            return
        kind = kind or self.kind_for(version)
        workers = cluster.workers
        for d in devices:
            workers[d].snapshot_begin.remote(version, kind)  # the issuing thread: before the next step
        calls = [workers[d].snapshot_take.remote(version) for d in devices]
        self.pending[version] = _Pending(version=version, kind=kind, devices=tuple(devices),
                                         metas=[c[0] for c in calls], params=[c[1] for c in calls],
                                         others=[c[2] for c in calls], issue_s=time.perf_counter() - t0,
                                         nodes=nodes)

    def after_train(self, step: int, stats: list[dict], scored: Any) -> None:
        """Step `step` is trained: keep it for a replay; its optimizer waited `snap_wait_s` for the
        copy of version `step`; the copy of version step+1 began in it if every trainer says so."""
        self.replay[step] = scored
        said = {tuple(st["snapshot"]) if st.get("snapshot") else None for st in stats}
        self._started = said.pop() if len(said) == 1 and None not in said else None
        gate = max((st.get("snap_wait_s", 0.0) for st in stats), default=0.0)
        if step in self.pending:
            self.pending[step].gate_s = gate
        elif step in self.rows and not self.rows[step].gate_known:
            row = self.rows[step]
            row.fields["critical_s"] += gate
            row.fields["gate_s"] = gate
            row.gate_known = True
        self.poll()

    def complete(self, version: int) -> snapshot.Snapshot:
        """Wait for the pending snapshot of `version` (the watchdog's wait: a lost trainer raises
        `DevicesLost`) and make it usable."""
        with self._lock:  # the streaming router's thread reads versions too (its weight pulls)
            if version not in self.pending:
                return self.done[version]  # completed by the other thread meanwhile
            return self._complete(self.pending[version])

    def _complete(self, p: _Pending) -> snapshot.Snapshot:
        version = p.version
        t0 = time.perf_counter()
        if p.done is not None and p.done.is_set() and p.error is None:
            metas = p.result  # the collector has them: no call from this thread
        else:
            if p.issued is not None:
                p.issued.wait()  # the collector issues at once (it never waits for a trainer first)
            metas = self.run.cluster.wait(list(zip(p.devices, p.metas)), f"snapshot {version}")
        return self._commit(p, metas, replicate=True, t0=t0)

    def _commit(self, p: _Pending, metas: list[dict], *, replicate: bool, t0: float) -> snapshot.Snapshot:
        cluster, version = self.run.cluster, p.version
        snap = p.snap if p.snap is not None and p.result is metas else snapshot.Snapshot(
            version=version, metas=metas, params=p.params, others=p.others if p.kind == "full" else None)
        if p.kind == "full" and replicate:
            snapshot.replicate(cluster, snap, p.devices)
        elif getattr(cluster, "nodes", None):
            snap.nodes = list(p.nodes or [])
        del self.pending[version]
        self.done[version] = snap
        seconds = max(m["seconds"] for m in metas)
        p.wait_s += time.perf_counter() - t0
        self._row(version, p.kind, metas, seconds=seconds, critical_s=p.issue_s + p.wait_s + (p.gate_s or 0.0),
                  cause="step", gate_known=p.gate_s is not None)
        self.rows[version].fields.update(collector_s=p.collector_s, issue_s=p.issue_s, wait_s=p.wait_s,
                                         gate_s=p.gate_s or 0.0)
        self.bytes_total += sum(m["bytes"] for m in metas)
        self.kinds[p.kind] += 1
        if p.kind == "full":
            self._new_base(version)
        return snap

    def _new_base(self, version: int) -> None:
        """Full snapshot `version` is the base of any replay now: the steps before it leave the
        replay log, and older full snapshots keep their parameters only (their moments freed)."""
        self.replay = {s: v for s, v in self.replay.items() if s >= version}
        for v, snap in self.done.items():
            if v < version and snap.others is not None:
                snap.others = None

    def poll(self) -> None:
        """Complete the pending snapshots whose results are all in (no waiting); emit the records
        of those whose optimizer wait is known. Skipped while another thread completes one."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._poll()
        finally:
            self._lock.release()

    def _poll(self) -> None:
        for v in sorted(self.pending):
            p = self.pending[v]
            if p.done is not None:
                if not p.done.is_set():
                    break  # in version order: a full snapshot counts only after the ones before it
            else:  # issued by this thread (the fallback): ask Ray
                t0 = time.perf_counter()
                ready, _ = ray.wait(p.metas, num_returns=len(p.metas), timeout=0)
                p.wait_s += time.perf_counter() - t0
                if len(ready) < len(p.metas):
                    break
            self.complete(v)
        self._emit(final=False)

    def settle(self) -> None:
        """Every pending snapshot complete (before the trainers' state moves: a resize, the end)."""
        with self._lock:
            for v in sorted(self.pending):
                self.complete(v)
            self._emit(final=False)

    def finish(self, *, settle: bool = True) -> None:
        """The run ends: every snapshot's record out (`settle`: the pending ones completed first)."""
        if settle:
            self.settle()
        self._emit(final=True)
        if self._collector is not None:
            self._collector.close()
            self._collector = None

    def engines_at(self, version: int) -> None:
        """Rollout devices hold `version` before a rollout that needs it: after the sync they
        do; after a resume or a recovery (they then hold an older one) it comes from its snapshot."""
        run = self.run
        if run.engine_version != version:
            snapshot.load_rollout(run.cluster, self[version])
            run.engine_version = version

    def after_loss(self, down: set[str]) -> list[int]:
        """Before the survivors re-form (ranks of the lost generation), drop what a loss broke: pending snapshots with a lost trainer (their results never come)
        and parameters-only ones with a shard on a dead node (not replicated). Returns the versions
        dropped."""
        dropped = []
        for v in sorted(self.pending):
            p = self.pending[v]
            try:
                if p.issued is not None:
                    p.issued.wait()
                    if p.error is not None and not p.metas:
                        raise p.error  # its calls were never issued
                metas = ray.get(p.metas, timeout=self.run.cfg.timeouts.collective_s)
            except Exception:  # noqa: BLE001 - a lost trainer's result: the snapshot is gone
                del self.pending[v]
                dropped.append(v)
                continue
            # Not replicated now (its holders may be the lost ones): a full one counts on its primaries.
            self._commit(p, metas, replicate=False, t0=time.perf_counter())
        for v, s in list(self.done.items()):
            if s.others is None and s.nodes and set(s.nodes) & down:
                del self.done[v]
                dropped.append(v)
        return dropped

    def recovered(self, version: int, devices: tuple[int, ...], cause: str = "recovery") -> float:
        """A blocking full snapshot of the trainers' state now (the new base: after a replay, or of
        a clean stop's last trained version); its seconds."""
        t0 = time.time()
        snap = snapshot.take(self.run.cluster, version, devices)
        self.done[version] = snap
        self._new_base(version)
        self._row(version, "full", snap.metas, seconds=max(m.get("seconds", 0.0) for m in snap.metas),
                  critical_s=time.time() - t0, cause=cause)
        self._emit(final=False)
        return time.time() - t0

    def params_now(self, version: int, devices: tuple[int, ...]) -> None:
        """A blocking parameters-only snapshot (a replayed version a rollout needs)."""
        self.begin(version, devices, "params")
        self.complete(version)
        self.rows[version].fields["cause"] = "recovery"

    def prune(self, keep_from: int) -> None:
        """Drop completed versions below `keep_from`, except the latest full one and the weight
        versions a checkpoint of it needs (rollout_version(F) .. F)."""
        eta = self.run.cfg.train.staleness
        try:
            f = self.latest_full()
        except ValueError:
            f = None
        lo = rollout_version(f, max(eta, 1)) if f is not None else keep_from
        for v in [v for v in self.done if v < keep_from and not (f is not None and lo <= v <= f)]:
            del self.done[v]

    def _row(self, version: int, kind: str, metas: list[dict], *, seconds: float, critical_s: float, cause: str,
             gate_known: bool = True) -> None:
        self.rows[version] = _Row(fields={"step": version, "snapshot_kind": kind,
                                          "bytes": int(sum(m.get("bytes", 0) for m in metas)),
                                          "seconds": seconds, "critical_s": critical_s, "cause": cause,
                                          "shards": len(metas)}, gate_known=gate_known)

    def _emit(self, *, final: bool) -> None:
        for v in sorted(self.rows):
            row = self.rows[v]
            if row.gate_known or final:
                self.run.rec.emit("snapshot", **row.fields)
                del self.rows[v]

    def _check_capacity(self, snap: snapshot.Snapshot) -> None:
        """Say in one line when what the run keeps would not fit in the object store."""
        cfg = self.run.cfg
        full = sum(m.get("bytes", 0) for m in snap.metas)
        params = sum(m.get("param_bytes", 0) for m in snap.metas)
        copies = 2 if getattr(self.run.cluster, "nodes", None) else 1  # a holder on another node
        kept = copies * 2 * full + (max(cfg.train.staleness, 1) + 2) * params
        try:
            capacity = float(ray.cluster_resources().get("object_store_memory", 0.0))
        except Exception:  # noqa: BLE001 - no cluster view: nothing to compare with
            return
        self.kept_bytes, self.capacity_bytes = kept, capacity
        if capacity and kept > capacity:
            say(f"dynaresize: the snapshots this run keeps (~{kept / 2**30:.1f} GiB: 2 full of "
                f"{full / 2**30:.2f} GiB x {copies} cop{'ies' if copies > 1 else 'y'} + parameter copies) would not "
                f"fit in Ray's object store ({capacity / 2**30:.1f} GiB): raise it (ray start --object-store-memory) "
                "or expect spilling to disk")

    def summary(self) -> dict:
        steps = max(1, sum(self.kinds.values()))  # snapshots taken after a step
        return {"snapshot_every": self.every, "snapshot_bytes_per_step": self.bytes_total / steps,
                "snapshots_full": self.kinds["full"], "snapshots_params": self.kinds["params"]}
