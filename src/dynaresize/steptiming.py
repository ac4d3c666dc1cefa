"""The runtime's time unit, and where each step's time went: paced work or overhead.

Time unit: with `cluster.emulate` every time the runtime records or reports is in *emulated*
seconds, wall seconds x `cluster.time_scale` (`scale`), so records, the controller's reports
and the policy's cost priors are in the emulated accelerator's seconds, as in the simulator.
Without it `scale` is 1 and times are wall seconds.

Accounting, per step k (the driver's loop is sequential between the points below):

    since the previous step record's end  =  work_s + overhead_s
    work_s  =  critical ops of the resize before k
               +  time covered by the workers' calls of this window: the rollout of k if it ran
                  here (the prologue), the rollout of k+1, the training of k, the weight sync

Both terms are measured on the workers' own clocks; a paced call counts for its paced
duration (the model's), overlapped stages once. `overhead_s` is the rest: the driver (scoring,
ledger, records, snapshots), the controller, Ray's calls, and what weight syncs and resize ops
take here beyond their modelled time (cluster/pacing.py). It is what separates a runtime step
from the simulator's prediction of it. A step is `overrun` when one of its rollout or training
calls took longer for real than its paced time: then that stage took the machine's time, not
the model's.
"""

from __future__ import annotations

from typing import Any

from dynaresize.emulate import Emulator, covered_s, span_s, time_scale_of
from dynaresize.types import StepReport


def _interval(result: dict) -> tuple[float, float]:
    """A worker call's work: its paced interval when paced (what it takes beyond is overhead)."""
    if "paced_s" in result:
        return result["paced_from"], result["paced_from"] + result["paced_s"]
    return result["t0"], result["t1"]


class StepTiming:
    """One run's time unit and step accounting (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.emulate: str | None = cfg.cluster.emulate
        self.scale = time_scale_of(cfg.cluster)
        self.emulator = Emulator.from_config(cfg)
        self._prev_end: float | None = None
        self._first_start: float | None = None
        self._resize_work = 0.0
        self.overhead_s = 0.0  # record units, summed over steps
        self.work_s = 0.0
        self.overrun_steps: list[int] = []

    def on_resize(self, outcome: Any) -> None:
        """A resize's critical ops ran (cluster.ResizeOutcome): their spans are the next step's work."""
        by_name: dict[str, list[dict]] = {}
        for op in outcome.ops:
            if op["critical"]:
                by_name.setdefault(op["name"], []).append(op)
        for ops in by_name.values():  # an op runs on its devices in parallel; paced: its modelled time
            paced = [op["paced_s"] for op in ops if "paced_s" in op]
            self._resize_work += max(paced) if paced else span_s((op["t0"], op["t1"]) for op in ops)

    def step(self, *, window_t0: float, t_end: float, prologue: Any, rolled: Any, train_stats: list[dict],
             sync: list[dict], step: int, overruns: list[dict]) -> dict:
        """Fields of step `step`'s record: `work_s`, `overhead_s` (record units) and `overrun`."""
        start = self._prev_end if self._prev_end is not None else window_t0
        if self._first_start is None:
            self._first_start = window_t0
        calls = [(t0, t1) for r in (prologue, rolled) if r is not None for _, t0, t1 in r.calls]
        calls += [_interval(s) for s in [*train_stats, *sync]]
        work = self._resize_work + covered_s((t0, t1) for t0, t1 in calls if t0 >= window_t0)
        self._resize_work = 0.0
        overhead = (t_end - start) - work
        self._prev_end = t_end
        self.overhead_s += overhead * self.scale
        self.work_s += work * self.scale
        if overruns:
            self.overrun_steps.append(step)
        return {"work_s": work * self.scale, "overhead_s": overhead * self.scale, "overrun": bool(overruns)}

    def report(self, report: StepReport, rollout_step: int | None) -> StepReport:
        """The controller's report; emulated, with what the emulated engine and trainer know."""
        return self.emulator.report(report, rollout_step) if self.emulator is not None else report

    def summary(self, consumed: int, wall_s: float) -> dict:
        """Summary fields. Emulated: `total_time_s` and `samples_per_s` are those of the steps
        (first step's start to the last one's end, startup left out) in emulated seconds."""
        steps_s = ((self._prev_end - self._first_start) * self.scale
                   if self._prev_end is not None and self._first_start is not None else 0.0)
        out = {"emulate": self.emulate, "time_scale": self.scale if self.emulate else None,
               "time_unit": (f"emulated seconds ({self.emulate}, {self.scale:g} per wall second)"
                             if self.emulate else "wall seconds"),
               "wall_time_s": wall_s, "steps_time_s": steps_s, "work_s": self.work_s, "overhead_s": self.overhead_s,
               "overhead_fraction": self.overhead_s / steps_s if steps_s > 0 else 0.0,
               "overrun_steps": len(self.overrun_steps), "overrun_step_ids": self.overrun_steps[:50]}
        if self.emulate and steps_s > 0:
            out.update(total_time_s=steps_s, samples_per_s=consumed / steps_s)
        return out
