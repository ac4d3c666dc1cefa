"""The discrete-event engine: a one-step-off-policy pipeline driven by the real controller.

Timeline of step k (batch k trains while batch k+1 rolls out, with weights one version old):

    step_start ─┬─ resize critical path (if the controller planned a move after step k-1)
                ├─ rollout of batch k+1 on the rollout pool  ──> rollout_done
                ├─ training of batch k on the training pool  ──> train_done   [lend: trainers
                │                                                 lend themselves to rollout]
                └─ when both are done: weight sync           ──> sync_done -> report -> controller

Before step 0 a prologue rolls out batch 0 alone; the last step trains only.

`serial=True` is the serial pipeline (staleness 0, `train.staleness=0`): step k rolls out batch k
with the current weights, then trains it, then syncs; rollout devices idle while training runs
and trainers while rollout runs (both counted as bubble). No prologue; the last step does not
sync. The report carries no `next_train_tokens` (the next batch is not rolled out yet). Events are kept
in a heap and handled in time order; a handler may schedule later events (lending re-times
`rollout_done`, superseding the earlier one).

Idle accounting (device-seconds): *tail* idle = rollout devices whose replica is done while the
stage's last response is still decoding; *bubble* idle = the pool of the faster stage waiting
for the slower one (and trainers during the prologue); *resize* idle = every device during a
resize's critical path. Weight sync counts as work. `idle = tail + bubble + resize`.

Resizes happen at the step boundary, where no request is in flight: a rollout -> train move's
`migrate_requests` moves none (`requests_moved` 0) and costs its fixed control time.

Pure except for the optional recorder (records.Recorder) the shell passes in.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable

from dynaresize.control.controller import Controller, decision_fields
from dynaresize.control.planner import MIGRATE_REQUESTS
from dynaresize.control.state import Refusal
from dynaresize.costmodel.scenarios import Scenario
from dynaresize.costmodel.stages import StageModel
from dynaresize.metrics import throughput_fields
from dynaresize.sim.resize import ResizeTiming, lend_step, time_plan
from dynaresize.types import TRAIN, Assignment, Bounds, ResizePlan, StepReport


class EventQueue:
    """A time-ordered heap of (time, seq, kind, data); ties break by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0

    def push(self, time_s: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self._heap, (time_s, self._seq, kind, data))
        self._seq += 1

    def pop(self) -> tuple[float, str, Any]:
        t, _, kind, data = heapq.heappop(self._heap)
        return t, kind, data

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class PolicyResult:
    policy: str
    num_devices: int
    num_steps: int
    start_rollout: int
    total_time_s: float = 0.0
    num_samples: int = 0
    idle_device_s: float = 0.0
    tail_idle_device_s: float = 0.0
    bubble_idle_device_s: float = 0.0
    resize_idle_device_s: float = 0.0
    resizes: int = 0
    refusals: int = 0
    reversals: int = 0
    resize_critical_s: float = 0.0
    resize_total_s: float = 0.0
    rollout_devices_final: int = 0
    steps_lent: int = 0
    timeline: list[tuple[int, float, float, int]] = field(default_factory=list)  # step, start, end, rollout
    staleness: int = 1  # the pipeline: 1 = this module's one-step-off; >= 2 = `sim.stream`
    partial: bool = False
    # streaming only (`sim.stream`): which pool the bubble idle is in, and the staleness facts
    rollout_wait_idle_device_s: float = 0.0  # rollout devices with no chunk (the window is full)
    train_wait_idle_device_s: float = 0.0  # trainers waiting for a step's last chunk
    busy_device_s: float = 0.0
    max_staleness: int = 0  # max over samples of consumed step - oldest version of its tokens
    mixed_version_samples: int = 0  # partial rollout: samples whose tokens span versions
    max_version_span: int = 0  # ... and the largest span (newest - oldest version)
    migrated_samples: int = 0  # samples a rollout -> train move handed to the remaining replicas

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.total_time_s if self.total_time_s > 0 else 0.0

    def summary(self) -> dict:
        denom = self.num_devices * self.total_time_s if self.total_time_s > 0 else 1.0
        # total time, samples/s, idle and tail-idle fractions: the runtime's assembly (metrics.py)
        headline = throughput_fields(num_devices=self.num_devices, total_time_s=self.total_time_s,
                                     num_samples=self.num_samples, idle_device_s=self.idle_device_s,
                                     tail_idle_device_s=self.tail_idle_device_s)
        return {
            "policy": self.policy, **headline,
            "bubble_idle_fraction": self.bubble_idle_device_s / denom,
            "resize_idle_fraction": self.resize_idle_device_s / denom,
            "resizes": self.resizes, "reversals": self.reversals, "refusals": self.refusals,
            "rollout_devices_final": self.rollout_devices_final, "rollout_devices_start": self.start_rollout,
            "resize_critical_s": self.resize_critical_s, "resize_total_s": self.resize_total_s,
            "steps_lent": self.steps_lent, "staleness": self.staleness,
        } | (self._stream_summary(denom) if self.staleness >= 2 else {})

    def _stream_summary(self, denom: float) -> dict:
        return {"partial": self.partial,
                "rollout_wait_idle_fraction": self.rollout_wait_idle_device_s / denom,
                "train_wait_idle_fraction": self.train_wait_idle_device_s / denom,
                "max_staleness": self.max_staleness, "mixed_version_samples": self.mixed_version_samples,
                "max_version_span": self.max_version_span, "migrated_samples": self.migrated_samples}


class _Null:
    def emit(self, kind: str, **fields: Any) -> None:
        pass


def run_policy(scenario: Scenario, stages: StageModel, policy, bounds: Bounds, *, start_rollout: int,
               reversal_window: int, recorder=None, on_step: Callable[[int], None] | None = None,
               serial: bool = False) -> PolicyResult:
    """Simulate one policy over the scenario; returns its result (records go to `recorder`).
    `serial`: the serial pipeline (staleness 0) instead of the one-step-off one."""
    rec = recorder if recorder is not None else _Null()
    N, K, model = scenario.num_devices, scenario.num_steps, stages.model
    ctl = Controller(policy=policy, bounds=bounds, assignment=Assignment.split(N, start_rollout))
    res = PolicyResult(policy=policy.name, num_devices=N, num_steps=K, start_rollout=start_rollout,
                       staleness=0 if serial else 1)
    lends = bool(getattr(policy, "lends", False))
    if lends and serial:
        raise ValueError("lending needs the one-step-off pipeline (trainers lend while rollout runs)")
    q = EventQueue()
    if serial:
        q.push(0.0, "step_start", (0, None))
    else:
        pro = stages.rollout(0, start_rollout)
        res.tail_idle_device_s += pro.tail_idle_device_s
        res.bubble_idle_device_s += (N - start_rollout) * pro.time_s
        q.push(pro.time_s, "step_start", (0, None))
    st: dict[str, Any] = {}
    measured_cost: float | None = None

    while len(q):
        now, kind, data = q.pop()
        if kind == "step_start":
            k, timing = data
            a = ctl.assignment
            stall = timing.critical_s if timing else 0.0
            t0 = now + stall
            tr = stages.train(k, a.num_train)
            # serial: batch k rolls out first, and training starts when it is in
            ro = stages.rollout(k, a.num_rollout) if serial else stages.rollout(k + 1, a.num_rollout) if k + 1 < K else None
            lead = ro.time_s if serial else 0.0
            train_s = max(tr.time_s, timing.optimizer_ready_s - stall - lead) if timing else tr.time_s
            st = {"k": k, "start": now, "t0": t0, "stall": stall, "R": a.num_rollout, "n": a.num_train,
                  "ro": ro, "train_s": train_s, "fixed": tr.fixed_s, "roll_end": None, "train_end": None,
                  "lend": None, "version": 0, "train_tokens": stages.seq_tokens(k),
                  "next_train_tokens": stages.seq_tokens(k + 1) if k + 1 < K and not serial else 0,
                  "sync_after": k + 1 < K}
            res.resize_idle_device_s += N * stall
            q.push(t0 + lead + train_s, "train_done", k)
            if ro is not None:
                q.push(t0 + ro.time_s, "rollout_done", (k, 0))
            else:
                st["roll_end"] = t0
        elif kind == "train_done":
            st["train_end"] = now
            ro = st["ro"]
            if lends and ro is not None and st["roll_end"] is None:
                times, serial_s, _ = stages.replica_detail(st["k"] + 1, st["R"])
                out = lend_step(times, serial_s, st["train_s"], st["n"], model, stages.hw)
                if out.lent:
                    st["lend"], st["version"] = out, st["version"] + 1
                    st["train_end"] = st["t0"] + out.back_s  # trainers are back before the next step
                    q.push(st["t0"] + out.rollout_s, "rollout_done", (st["k"], st["version"]))
            _maybe_sync(q, st, stages)
        elif kind == "rollout_done":
            k, version = data
            if (k, version) != (st["k"], st["version"]):
                continue  # superseded by lending
            st["roll_end"] = now
            _maybe_sync(q, st, stages)
        elif kind == "sync_done":
            k = st["k"]
            report = _account(res, st, now, N, rec, measured_cost)
            measured_cost = None
            if on_step is not None:
                on_step(k)
            timing = None
            if k + 1 < K:
                for cmd in ctl.on_report(report):
                    timing = _apply(cmd, ctl, res, rec, now, model, k, stages.hw)
                    if timing is not None:
                        measured_cost = timing.critical_s
                _decision(rec, ctl, k)
                q.push(now, "step_start", (k + 1, timing))
            else:
                res.total_time_s = now
    res.rollout_devices_final = ctl.assignment.num_rollout
    res.reversals = ctl.history.count_reversals(reversal_window)
    res.num_samples = scenario.total_samples()
    return res


def _maybe_sync(q: EventQueue, st: dict, stages: StageModel) -> None:
    if st["roll_end"] is not None and st["train_end"] is not None and "synced" not in st:
        st["synced"] = True
        sync = stages.sync_s if st["sync_after"] else 0.0
        st["sync_s"] = sync
        q.push(max(st["roll_end"], st["train_end"]) + sync, "sync_done", st["k"])


def _account(res: PolicyResult, st: dict, now: float, N: int, rec, measured_cost: float | None) -> StepReport:
    """Idle accounting for the finished step; emits its record and returns its report."""
    t0, R, n, ro, lend = st["t0"], st["R"], st["n"], st["ro"], st["lend"]
    stage_end = max(st["roll_end"], st["train_end"]) - t0
    roll_s = st["roll_end"] - t0
    if ro is None:
        tail, bubble = 0.0, R * stage_end
    elif lend is None:
        tail = ro.tail_idle_device_s
        bubble = R * (stage_end - roll_s) + n * (stage_end - st["train_s"])
    else:
        # Base replicas and lenders share the remaining work (work is conserved); the pool's
        # unused time before the last response is tail idle. Lenders' switches count as work.
        t_avail = st["train_s"] + lend.switch_in_s
        lent_s = max(roll_s - t_avail, 0.0)
        ld = lend.lender_devices
        tail = max(R * roll_s + ld * lent_s - ro.work_device_s, 0.0)
        bubble = R * (stage_end - roll_s) + max(
            n * (stage_end - st["train_s"]) - ld * (lend.switch_in_s + lend.switch_out_s + lent_s), 0.0)
        res.steps_lent += 1
    res.tail_idle_device_s += tail
    res.bubble_idle_device_s += bubble
    res.idle_device_s = res.tail_idle_device_s + res.bubble_idle_device_s + res.resize_idle_device_s
    res.timeline.append((st["k"], st["start"], now, R))
    step_s = now - st["start"]
    rec.emit("step", step=st["k"], t_start_s=st["start"], t_end_s=now, rollout_s=roll_s, train_s=st["train_s"],
             sync_s=st["sync_s"], num_rollout=R, num_train=n, idle_device_s=tail + bubble + N * st["stall"],
             tail_idle_device_s=tail, bubble_idle_device_s=bubble, resize_stall_s=st["stall"], step_s=step_s,
             rollout_work_s=ro.work_device_s if ro else 0.0, rollout_floor_s=ro.floor_s if ro else 0.0,
             lent_devices=lend.lender_devices if lend else 0)
    return StepReport(step=st["k"], now_s=now, num_rollout=R, num_train=n, rollout_s=roll_s, train_s=st["train_s"],
                      sync_s=st["sync_s"], step_s=step_s, rollout_work_s=ro.work_device_s if ro else 0.0,
                      rollout_longest_s=ro.longest_s if ro else 0.0, train_fixed_s=st["fixed"],
                      idle_device_s=tail + bubble, tail_idle_device_s=tail, resize_critical_s=measured_cost,
                      rollout_floor_s=ro.floor_s if ro else 0.0, train_tokens=st["train_tokens"],
                      next_train_tokens=st["next_train_tokens"])


def _apply(cmd, ctl: Controller, res: PolicyResult, rec, now: float, model, k: int, hw) -> ResizeTiming | None:
    if isinstance(cmd, Refusal):
        res.refusals += 1
        rec.emit("refused", step=cmd.step, requested_rollout=cmd.requested_rollout, reason=cmd.reason)
        return None
    assert isinstance(cmd, ResizePlan)
    timing = time_plan(cmd, model, hw)
    # At this boundary no request is in flight: migrate_requests moves none and costs only its
    # control messages (costs.MIGRATE_S).
    for op in timing.ops:
        moved = {"requests_moved": 0} if op.name == MIGRATE_REQUESTS else {}
        rec.emit("op", resize_id=cmd.resize_id, name=op.name, device=op.device, start_s=now + op.start_s,
                 end_s=now + op.end_s, bytes=op.bytes, critical=op.critical, **moved)
    rec.emit("resize", resize_id=cmd.resize_id, step=k, **{"from": cmd.src.to_json(), "to": cmd.dst.to_json()},
             moving=list(cmd.moving), to_role=cmd.to_role, critical_s=timing.critical_s, total_s=timing.total_s,
             bytes=timing.bytes_moved, reason=cmd.reason, **({"requests_moved": 0} if cmd.to_role == TRAIN else {}))
    ctl.on_resize_done(cmd.resize_id, timing.critical_s, timing.total_s)
    res.resizes += 1
    res.resize_critical_s += timing.critical_s
    res.resize_total_s += timing.total_s
    return timing


def _decision(rec, ctl: Controller, k: int) -> None:
    rec.emit("decision", step=k, **decision_fields(ctl))
