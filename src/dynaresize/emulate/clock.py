"""The runtime's clock, and where each step's time went: paced work or overhead.

The clock (`EmulatedClock`): with `cluster.emulate` the runtime's times are *emulated* seconds.
A wall interval counts `time_scale` emulated seconds per wall second while a worker's paced work
runs (a rollout, training or weight-sync call, a resize's critical op: each paced to the
emulated hardware's time, cluster/pacing.py), and one per wall second otherwise: the driver,
the controller and Ray take the same seconds on a GPU cluster as here, so they are not scaled
up. Every time the runtime records or reports (spans, ops, step and resize records, the
controller's reports, the summary) goes through this clock, so the policy's cost priors and the
simulator's predictions are in the same seconds. Without `cluster.emulate` the clock is the wall
clock.

Accounting, per step k (the driver's loop is sequential between the points below):

    since the previous step record's end  =  work_s + overhead_s
    work_s  =  critical ops of the resize before k
               +  time covered by the workers' calls of this window: the rollout of k if it ran
                  here (the prologue), the rollout of k+1, the training of k, the weight sync

A paced call counts for its paced duration (the model's), overlapped stages once. `overhead_s`
is the rest: the driver (scoring, ledger, records, snapshots), the controller, Ray's calls, and
what weight syncs and resize ops take on this host beyond their modelled time. It is what
separates a runtime step from the simulator's prediction of it. A step is `overrun` when one of
its rollout or training calls took longer for real than its paced time: then that stage took
the machine's time, not the model's.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from typing import Any

from dynaresize.emulate.model import Emulator, covered_s, span_s, time_scale_of
from dynaresize.types import StepReport


class EmulatedClock:
    """Wall times -> the run's seconds: paced work at `scale`, everything else 1:1 (see above)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)
        self._starts: list[float] = []  # merged, sorted intervals of paced work
        self._ends: list[float] = []
        self._cum: list[float] = []  # covered length before interval i
        self._lock = threading.Lock()

    def add(self, a: float, b: float) -> None:
        """Paced work ran from wall time `a` to `b` (any thread)."""
        if self.scale == 1.0 or not b > a:
            return
        with self._lock:
            pairs = sorted([*zip(self._starts, self._ends), (float(a), float(b))])
            starts, ends = [pairs[0][0]], [pairs[0][1]]
            for s, e in pairs[1:]:
                if s <= ends[-1]:
                    ends[-1] = max(ends[-1], e)
                else:
                    starts.append(s)
                    ends.append(e)
            cum, total = [], 0.0
            for s, e in zip(starts, ends):
                cum.append(total)
                total += e - s
            self._starts, self._ends, self._cum = starts, ends, cum

    def _covered_before(self, t: float) -> float:
        i = bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        return self._cum[i] + min(t, self._ends[i]) - self._starts[i]

    def work(self, a: float, b: float) -> float:
        """Wall seconds of paced work between wall times `a` and `b`."""
        if self.scale == 1.0 or not b > a:
            return 0.0
        with self._lock:
            return self._covered_before(b) - self._covered_before(a)

    def span(self, a: float, b: float) -> float:
        """The run's seconds from wall time `a` to `b`."""
        return (b - a) + (self.scale - 1.0) * self.work(a, b)


class StepTiming:
    """One run's time unit and step accounting (see the module docstring)."""

    def __init__(self, cfg: Any, clock: EmulatedClock) -> None:
        self.emulate: str | None = cfg.cluster.emulate
        self.scale = time_scale_of(cfg.cluster)
        self.clock = clock
        self.emulator = Emulator.from_config(cfg)
        self._prev_end: float | None = None
        self._first_start: float | None = None
        self._resize_work = 0.0
        self.overhead_s = 0.0  # record units, summed over steps
        self.work_s = 0.0
        self.overrun_steps: list[int] = []
        self.real_fraction_max = 0.0

    def on_resize(self, outcome: Any) -> None:
        """A resize's critical ops ran (cluster.ResizeOutcome): the next step's work (unpaced; a
        paced op's interval is on the clock)."""
        by_name: dict[str, list[dict]] = {}
        for op in outcome.ops:
            if op["critical"]:
                by_name.setdefault(op["name"], []).append(op)
        for ops in by_name.values():  # an op runs on its devices in parallel; paced: its modelled time
            paced = [op["paced_s"] for op in ops if "paced_s" in op]
            self._resize_work += max(paced) if paced else span_s((op["t0"], op["t1"]) for op in ops)

    def step(self, *, window_t0: float, t_end: float, prologue: Any, rolled: Any, train_stats: list[dict],
             sync: list[dict], step: int, stage_calls: list[tuple[float, float]]) -> dict:
        """Fields of step `step`'s record: `work_s`, `overhead_s`, and, emulated, `overrun` and
        `real_fraction` (the largest real / paced time of its rollout and training calls)."""
        start = self._prev_end if self._prev_end is not None else window_t0
        if self._first_start is None:
            self._first_start = window_t0
        if self.emulate:
            work = self.clock.work(start, t_end) * self.scale
        else:
            calls = [(t0, t1) for r in (prologue, rolled) if r is not None for _, t0, t1 in r.calls]
            calls += [(s["t0"], s["t1"]) for s in [*train_stats, *sync]]
            work = self._resize_work + covered_s((t0, t1) for t0, t1 in calls if t0 >= window_t0)
        self._resize_work = 0.0
        overhead = self.clock.span(start, t_end) - work
        self._prev_end = t_end
        self.overhead_s += overhead
        self.work_s += work
        fraction = max((real / paced for real, paced in stage_calls if paced > 0), default=0.0)
        overrun = any(real > paced for real, paced in stage_calls)
        if overrun:
            self.overrun_steps.append(step)
        self.real_fraction_max = max(self.real_fraction_max, fraction)
        return {"work_s": work, "overhead_s": overhead, "overrun": overrun, "real_fraction": fraction}

    def report(self, report: StepReport, rollout_step: int | None) -> StepReport:
        """The controller's report; emulated, with what the emulated engine and trainer know."""
        return self.emulator.report(report, rollout_step) if self.emulator is not None else report

    def summary(self, wall_s: float) -> dict:
        """Summary fields. Emulated, also `steps_total_s`: the run's total time is that of the
        steps (first step's start to the last one's end, startup left out) in emulated seconds."""
        steps_s = (self.clock.span(self._first_start, self._prev_end)
                   if self._prev_end is not None and self._first_start is not None else 0.0)
        out = {"emulate": self.emulate, "time_scale": self.scale if self.emulate else None,
               "time_unit": (f"emulated seconds ({self.emulate}: paced work at {self.scale:g} per wall second, "
                             "the rest 1:1)"
                             if self.emulate else "wall seconds"),
               "wall_time_s": wall_s, "steps_time_s": steps_s, "work_s": self.work_s, "overhead_s": self.overhead_s,
               "overhead_fraction": self.overhead_s / steps_s if steps_s > 0 else 0.0,
               "overrun_steps": len(self.overrun_steps), "overrun_step_ids": self.overrun_steps[:50],
               "real_fraction_max": self.real_fraction_max}
        if self.emulate and steps_s > 0:
            out["steps_total_s"] = steps_s
        return out
