"""The answer of `dynaresize advise`: the same job on the same devices, with the calibrated
stage models, through the simulator's own sweeps and engine.

- the logged split as reproduced: its column of the one-step-off step table (`sim.oracle`);
  a colocated log (rollout on all N devices, then training on all N) is reproduced as the sum
  of its fitted stages and the per-step rest, as it ran;
- every static split: the table's static totals; the best one in hindsight;
- hysteresis: the product's policy run through the engine and controller (`sim.engine`) from
  the logged split (a colocated log: from the pilot split), paying the resize cost model's
  critical path for each move, or `Job.switch_s` when given (`with_switch_cost`);
- the oracle: the offline-optimal schedule (`sim.oracle.oracle_plan`), same costs.

Gains are against the reproduced logged split (same model on both sides, each total with the
simulator's prologue: batch 0 rolled out alone). `reproduced_steps` leaves the prologue out, as a
log's step times do: it is the number to hold against the logged throughput. The verdict line
says which of three cases holds: nothing pays (every gain below `PAYS`), a fixed split pays
(hysteresis does not beat the best static split by `PAYS`), or moving devices pays.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.costs import Hardware, ModelPreset
from dynaresize.costmodel.scenarios import Scenario
from dynaresize.costmodel.stages import Batch
from dynaresize.errors import ConfigError
from dynaresize.policy.base import make_policy
from dynaresize.sim.engine import run_policy
from dynaresize.sim.oracle import best_static, build_table, grid, oracle_plan, pilot_split
from dynaresize.sim.resize import canonical_timing
from dynaresize.types import Bounds

PAYS = 1.02  # a gain under 2% is within what the fit and the rebuilt lengths can tell


@dataclass(frozen=True, kw_only=True)
class Job:
    """The logged job as the simulator sees it."""

    name: str
    batches: tuple[Batch, ...]
    num_devices: int
    rollout_devices: int  # == num_devices: a colocated run (stages one after the other on all devices)
    model: ModelPreset  # calibrated
    hardware: Hardware
    bounds: Bounds
    staleness: int = 1  # 0: serial pipeline, 1: one-step-off
    switch_s: float | None = None  # a move's critical time each way (None: the resize cost model's)

    def __post_init__(self) -> None:
        if self.switch_s is not None and not (math.isfinite(self.switch_s) and self.switch_s >= 0):
            raise ConfigError([f"switch-s={self.switch_s}: must be a finite number of seconds >= 0"])
        if self.staleness not in (0, 1):
            raise ConfigError([f"staleness={self.staleness}: advise models the serial (0) and one-step-off (1) "
                               "pipelines; the streaming pipeline (>= 2) is not built into advise yet"])
        if not self.colocated and not self.bounds.allowed(self.rollout_devices):
            raise ConfigError([f"rollout-devices={self.rollout_devices}: not a legal split of {self.num_devices} "
                               f"devices ({self.bounds.why_not(self.rollout_devices)})"])

    @property
    def colocated(self) -> bool:
        return self.rollout_devices >= self.num_devices


class _Steps:
    """A recorder that keeps the engine's step and resize records."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.resizes: list[dict] = []

    def emit(self, kind: str, **fields) -> None:
        if kind == "step":
            self.steps.append(fields)
        elif kind == "resize":
            self.resizes.append(fields)


def with_switch_cost(model: ModelPreset, hw: Hardware, num_devices: int, rollout: int, unit: int,
                     switch_s: float) -> ModelPreset:
    """The preset whose one-unit move from `rollout` costs `switch_s` on the critical path each
    way: the difference goes to the engine wake (train -> rollout) and release (rollout -> train)
    ops, the ones a cold engine or a slow framework makes long. A direction the bounds leave no
    room for at `rollout` is timed from the next split over."""
    up_from = rollout if rollout + unit < num_devices else rollout - unit
    down_from = rollout if rollout - unit >= 1 else rollout + unit
    up = canonical_timing(model, num_devices, up_from, up_from + unit, hw).critical_s
    down = canonical_timing(model, num_devices, down_from, down_from - unit, hw).critical_s
    return replace(model, engine_wake_s=max(model.engine_wake_s + switch_s - up, 0.0),
                   engine_release_s=max(model.engine_release_s + switch_s - down, 0.0))


def advise(job: Job, cfg: PolicyConfig = PolicyConfig(), *, colocated_step_s: list[float] | None = None) -> dict:
    """Every number of the answer (module doc), as a JSON-able dict."""
    K, N, R = len(job.batches), job.num_devices, job.rollout_devices
    serial = job.staleness == 0
    samples = sum(b.num_samples for b in job.batches)
    scenario = Scenario(name=job.name, num_devices=N, num_steps=K, model=job.model, prompts_per_step=max(
        1, round(samples / K)), samples_per_prompt=1, batch_of=lambda b: job.batches[b], trace_samples=samples,
        hardware=job.hardware)
    stages = scenario.stages()
    bounds = job.bounds
    start = pilot_split(stages, bounds, K, cfg.profile_steps, serial=serial) if job.colocated else R
    if job.switch_s is not None:  # the moves' cost set at the split they start from
        model = with_switch_cost(job.model, job.hardware, N, start, bounds.move_unit, job.switch_s)
        job = replace(job, model=model)
        scenario = replace(scenario, model=model)
        stages = scenario.stages()
    splits = grid(bounds, include=(start,))
    table = build_table(stages, splits, N, K, serial=serial)
    totals = table.static_total()
    rate = {r: samples / t for r, t in zip(splits, totals.tolist()) if t > 0}
    if job.colocated:
        reproduced = reproduced_steps = samples / sum(colocated_step_s or [math.inf])
    else:  # the simulator's totals include the prologue (batch 0 rolled out alone); a log's steps do not
        reproduced, j = rate[R], splits.index(R)
        reproduced_steps = samples / float(totals[j] - table.prologue[j])
    r_best, t_best = best_static(table)
    path, t_oracle = oracle_plan(table, stages, N)
    rec = _Steps()
    policy = make_policy(replace(cfg, name="hysteresis"), bounds, num_steps=K, simulator=True, pilot_rollout=start,
                         staleness=job.staleness)
    res = run_policy(scenario, stages, policy, bounds, start_rollout=start, reversal_window=cfg.horizon_steps,
                     recorder=rec, serial=serial)
    hyst = res.samples_per_s
    moves = [{"after_step": r["step"], "from_rollout": len(r["from"]["rollout"]),
              "to_rollout": len(r["to"]["rollout"]), "critical_s": r["critical_s"]} for r in rec.resizes]
    out = {
        "steps": K, "samples": samples, "devices": N, "pipeline": "serial" if serial else "one-step-off",
        "static": [{"rollout": r, "samples_per_s": rate.get(r, 0.0)} for r in splits],
        "best_static": {"rollout": r_best, "samples_per_s": samples / t_best},
        "hysteresis": {"samples_per_s": hyst, "moves": len(moves), "start_rollout": start,
                       "end_rollout": res.rollout_devices_final, "move_list": moves,
                       "payback_steps": _payback(table, splits.index(start), rec) if moves and not job.colocated
                       else None},
        "oracle": {"samples_per_s": samples / t_oracle, "moves": int(np.count_nonzero(np.diff(path))),
                   "splits": _runs(path)},
        "switch_cost_s": {"train_to_rollout": _crit(job, start, +bounds.move_unit),
                          "rollout_to_train": _crit(job, start, -bounds.move_unit)},
        "reproduced": reproduced, "reproduced_steps": reproduced_steps,
    }
    out["gain_vs_logged"] = hyst / reproduced if reproduced > 0 else None
    out["gain_vs_best_static"] = hyst / out["best_static"]["samples_per_s"]
    out["oracle_gain_vs_logged"] = out["oracle"]["samples_per_s"] / reproduced if reproduced > 0 else None
    out["best_static_gain_vs_logged"] = out["best_static"]["samples_per_s"] / reproduced if reproduced > 0 else None
    out["verdict"] = verdict(out, R, job.colocated)
    return out


def _crit(job: Job, start: int, step: int) -> float | None:
    if not (job.bounds.allowed(start) and job.bounds.allowed(start + step)):
        return None
    return canonical_timing(job.model, job.num_devices, start, start + step, job.hardware).critical_s


def _runs(path: list[int]) -> list[dict]:
    """The oracle's schedule as runs: [{"from_step", "rollout"}] at each change."""
    return [{"from_step": k, "rollout": r} for k, r in enumerate(path) if k == 0 or r != path[k - 1]]


def _payback(table, col: int, rec: _Steps) -> int | None:
    """Steps from the first move until the time saved against staying at the logged split
    (its table column, step by step) covers the moves' stalls; None if it never does."""
    logged = table.step_s()[:, col]
    first = rec.resizes[0]["step"] + 1
    saved = 0.0
    for s in rec.steps:
        k = s["step"]
        if k < first:
            continue
        saved += float(logged[k]) - float(s["step_s"])
        if saved >= 0:
            return k - first + 1
    return None


def verdict(out: dict, logged_rollout: int, colocated: bool) -> str:
    """One line: nothing pays / a fixed split pays / moving devices pays."""
    g, gs = out["gain_vs_logged"] or 0.0, out["best_static_gain_vs_logged"] or 0.0
    go = out["oracle_gain_vs_logged"] or 0.0
    h, best = out["hysteresis"], out["best_static"]
    here = "the colocated run" if colocated else f"the logged split ({logged_rollout} rollout devices)"
    if max(g, gs) < PAYS:
        return (f"no split change pays on this job: against {here}, the best fixed split gives {_pct(gs)}, "
                f"hysteresis {_pct(g)} ({_moves(h['moves'])}), the oracle {_pct(go)}")
    if out["gain_vs_best_static"] < PAYS or not h["moves"]:
        return (f"a fixed split of {best['rollout']} rollout devices pays {_pct(gs)} over {here}; moving devices "
                f"during the run adds {_pct(out['gain_vs_best_static'])} over that split (oracle {_pct(go)})")
    first = h["move_list"][0]
    net = h["end_rollout"] - h["start_rollout"]
    way = f"{abs(net)} devices to {'rollout' if net >= 0 else 'training'}"
    pay = f", each move paid back within ~{h['payback_steps']} steps" if h.get("payback_steps") else ""
    return (f"moving {way} after step ~{first['after_step']} pays {_pct(g)} over {here} "
            f"({_pct(out['gain_vs_best_static'])} over the best fixed split in hindsight, {best['rollout']} rollout "
            f"devices); {_moves(h['moves'])}{pay}; the oracle {_pct(go)}")


def _moves(n: int) -> str:
    return f"{n} move" + ("" if n == 1 else "s")


def _pct(gain: float) -> str:
    return f"{(gain - 1) * 100:+.1f}%"
