"""Sweeps over splits: the pilot split, the best fixed split in hindsight, and the oracle.

- `pilot_split`: the split where the two stages take the most nearly equal time, averaged over
  the first `profile_steps` steps (what a user tunes in a pilot run; `static-profiled`, and the
  start of every dynamic policy).
- `best_static`: the fixed split with the least total time in hindsight (a sweep).
- `oracle_plan`: the offline-optimal schedule of splits. Knowing every step's stage times, a
  dynamic program over steps and splits minimises the total time, paying each move's critical
  path and the wait for its optimizer shards exactly as the engine does (same plan, same cost
  model). It is the ceiling for step-boundary policies.

Each takes `serial=True` for the serial pipeline (staleness 0, `sim.engine`'s `serial`): a step
is rollout + training + sync there, so the pilot and the sweeps minimise that sum.

The streaming pipeline (staleness >= 2, `sim.stream`) has no per-step stage table (a step's
rollout overlaps others), so its sweeps run the engine itself:
- `stream_pilot_split`: the split where the rollout pool's throughput (each replica running its
  share of a step, one share after another) matches the training pool's over the first
  `profile_steps` steps: what a user would tune in a streaming pilot run;
- `stream_best_static`: every split of the grid simulated as a fixed split through the same
  engine (no moves, so nothing else differs), the fastest in hindsight. No oracle: the dynamic
  program needs stage times that do not depend on earlier splits, which streaming breaks.

Bounds with predefined splits (`Bounds.allowed_rollout`) restrict every sweep to them: the grid
is `bounds.splits()`.

When a cluster has more than `MAX_SPLITS` legal splits, the sweeps search an evenly spaced grid
of `MAX_SPLITS` splits (plus the pilot split): then `best-static` and `oracle` are bounds from
below on the true optimum (they could only do better on the full set), which is stated in the
summary (`grid`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynaresize.costmodel.costs import publish_s
from dynaresize.costmodel.stages import StageModel
from dynaresize.sim.resize import canonical_timing
from dynaresize.types import Bounds

MAX_SPLITS = 64


def grid(bounds: Bounds, include: tuple[int, ...] = (), max_points: int = MAX_SPLITS) -> tuple[int, ...]:
    splits = bounds.splits()
    if len(splits) <= max_points:
        return splits
    idx = np.unique(np.round(np.linspace(0, len(splits) - 1, max_points)).astype(int))
    chosen = {splits[i] for i in idx} | {s for s in include if bounds.allowed(s)}
    return tuple(sorted(chosen))


def pilot_split(stages: StageModel, bounds: Bounds, num_steps: int, profile_steps: int, serial: bool = False) -> int:
    """The legal split that best balances mean rollout and training time over the first steps
    (`serial`: the one with the least mean rollout + training time, as the stages add up)."""
    splits = bounds.splits()
    n_dev = bounds.num_devices
    steps = range(min(profile_steps, max(num_steps - 1, 1)))
    if serial:
        return min(splits, key=lambda r: (float(np.mean([stages.rollout(k, r).time_s + stages.train(k, n_dev - r).time_s
                                                           for k in steps])), r))

    def gap(r: int) -> float:
        roll = np.mean([stages.rollout(k + 1, r).time_s for k in steps])
        train = np.mean([stages.train(k, n_dev - r).time_s for k in steps])
        return float(roll - train)

    lo, hi = 0, len(splits) - 1  # gap falls as r grows: bisect for the sign change
    if gap(splits[hi]) >= 0:
        return splits[hi]
    if gap(splits[lo]) <= 0:
        return splits[lo]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gap(splits[mid]) > 0:
            lo = mid
        else:
            hi = mid
    near = splits[max(lo - 2, 0): hi + 3]
    return min(near, key=lambda r: (abs(gap(r)), r))


@dataclass(frozen=True)
class StepTable:
    """Stage times of every step at every split of `splits` (columns). One-step-off: a step is
    max(rollout, train) + sync; `serial` (staleness 0): rollout + train + sync."""

    splits: tuple[int, ...]
    prologue: np.ndarray  # (S,) rollout of batch 0 (serial: 0)
    rollout: np.ndarray  # (K, S) rollout of batch k+1 during step k (0 for the last step); serial: of batch k
    train: np.ndarray  # (K, S) training of batch k
    sync: np.ndarray  # (K,) weight sync after step k (0 for the last step)
    serial: bool = False

    def step_s(self) -> np.ndarray:
        if self.serial:
            return self.rollout + self.train + self.sync[:, None]
        return np.maximum(self.rollout, self.train) + self.sync[:, None]

    def static_total(self) -> np.ndarray:
        return self.prologue + self.step_s().sum(axis=0)


def build_table(stages: StageModel, splits: tuple[int, ...], num_devices: int, num_steps: int,
                on_step=None, serial: bool = False) -> StepTable:
    K, S = num_steps, len(splits)
    roll = np.zeros((K, S))
    train = np.zeros((K, S))
    sync = np.full(K, stages.sync_s)
    sync[-1] = 0.0
    prologue = np.zeros(S) if serial else np.array([stages.rollout(0, r).time_s for r in splits])
    for k in range(K):
        b = k if serial else k + 1  # the batch rolled out in step k
        for j, r in enumerate(splits):
            train[k, j] = stages.train(k, num_devices - r).time_s
            if b < K:
                roll[k, j] = stages.rollout(b, r).time_s
        if on_step is not None:
            on_step(k)
    return StepTable(splits=splits, prologue=prologue, rollout=roll, train=train, sync=sync, serial=serial)


def best_static(table: StepTable) -> tuple[int, float]:
    totals = table.static_total()
    j = int(np.argmin(totals))
    return table.splits[j], float(totals[j])


def oracle_plan(table: StepTable, stages: StageModel, num_devices: int) -> tuple[list[int], float]:
    """(rollout devices per step, predicted total seconds) of the offline-optimal schedule."""
    splits, S = table.splits, len(table.splits)
    crit = np.zeros((S, S))
    opt_wait = np.zeros((S, S))  # optimizer-ready time minus critical path: training waits for it
    for i, a in enumerate(splits):
        for j, b in enumerate(splits):
            if a != b:
                t = canonical_timing(stages.model, num_devices, a, b, stages.hw)
                crit[i, j], opt_wait[i, j] = t.critical_s, t.optimizer_ready_s - t.critical_s
    K = table.rollout.shape[0]
    value = table.prologue + table.step_s()[0]
    back = np.zeros((K, S), dtype=np.int64)
    back[0] = np.arange(S)
    for k in range(1, K):
        if table.serial:  # training starts after the rollout, so the optimizer shards have that long too
            lead = table.rollout[k][None, :]
            step_k = lead + np.maximum(table.train[k][None, :], opt_wait - lead) + table.sync[k]
        else:
            train_k = np.maximum(table.train[k][None, :], opt_wait)  # (from, to)
            step_k = np.maximum(table.rollout[k][None, :], train_k) + table.sync[k]
        cost = value[:, None] + crit + step_k
        back[k] = np.argmin(cost, axis=0)
        value = cost[back[k], np.arange(S)]
    j = int(np.argmin(value))
    total = float(value[j])
    path = [0] * K
    for k in range(K - 1, -1, -1):
        path[k] = splits[j]
        j = int(back[k][j])
    return path, total


def stream_rollout_s(stages: StageModel, b: int, num_rollout: int) -> float:
    """Seconds per step of a `num_rollout`-device rollout pool running batch `b` in even shares
    back to back (its throughput, not a latency): mean share time + one weight pull."""
    n_rep = max(1, num_rollout // stages.tp)
    n = stages.batch(b).num_samples
    share = min(stages.slots(b), -(-n // n_rep))
    total = sum(stages.chunk(b, lo, min(lo + share, n)).time_s for lo in range(0, n, share))
    chunks = -(-n // share)
    return (total + chunks * stages.sync_s) / n_rep


def stream_pilot_split(stages: StageModel, bounds: Bounds, num_steps: int, profile_steps: int) -> int:
    """The legal split where streaming rollout and training (with its publish) take the most
    nearly equal time per step, averaged over the first steps."""
    splits = bounds.splits()
    n_dev = bounds.num_devices
    steps = range(min(profile_steps, max(num_steps, 1)))

    def gap(r: int) -> float:
        roll = np.mean([stream_rollout_s(stages, k, r) for k in steps])
        train = np.mean([stages.train(k, n_dev - r).time_s + publish_s(stages.model, n_dev - r, stages.hw)
                         for k in steps])
        return float(roll - train)

    gaps = {r: gap(r) for r in splits}
    return min(splits, key=lambda r: (abs(gaps[r]), r))


def stream_lower_bound(stages: StageModel, num_devices: int, num_steps: int, num_rollout: int,
                       tails_overlap: bool = False) -> float:
    """A lower bound on a fixed split's total time in the streaming pipeline: the trainers run
    every training step and every publish but the last one back to back, and the rollout pool
    runs every share (without its weight pulls) on its replicas; where a share's tail may
    overlap the next share (partial rollout, same-version admission) a share holds its replica
    only until its body ends."""
    n = num_devices - num_rollout
    train = sum(stages.train(k, n).time_s for k in range(num_steps))
    train += (num_steps - 1) * publish_s(stages.model, n, stages.hw)
    n_rep = max(1, num_rollout // stages.tp)
    roll = 0.0
    for k in range(num_steps):
        b = stages.batch(k).num_samples
        share = min(stages.slots(k), -(-b // n_rep))
        chunks = (stages.chunk(k, lo, min(lo + share, b)) for lo in range(0, b, share))
        roll += sum(c.body_s if tails_overlap else c.time_s for c in chunks)
    return max(train, roll / n_rep)


def stream_best_static(scenario, stages: StageModel, bounds: Bounds, splits: tuple[int, ...], staleness: int,
                       partial: bool, on_run=None, *, accumulate: bool = True,
                       admit: bool = True) -> tuple[int, float, dict[int, float], dict[int, float]]:
    """(split, total seconds, {simulated split: total}, {split: lower bound}) of the fastest fixed
    split. Exact by branch and bound: splits are simulated in order of their lower bound
    (`stream_lower_bound`) until the next bound is no better than the best simulated total."""
    from dynaresize.policy.baselines import Planned
    from dynaresize.sim.stream import run_stream

    K, N = scenario.num_steps, scenario.num_devices
    bound = {r: stream_lower_bound(stages, N, K, r, partial or admit) for r in splits}
    totals: dict[int, float] = {}
    best = None
    for r in sorted(splits, key=lambda x: (bound[x], x)):
        if best is not None and bound[r] >= totals[best]:
            break
        res = run_stream(scenario, stages, Planned("best-static", [r] * K), bounds, start_rollout=r,
                         staleness=staleness, partial=partial, accumulate=accumulate, admit=admit)
        totals[r] = res.total_time_s
        if best is None or (totals[r], r) < (totals[best], best):
            best = r
        if on_run is not None:
            on_run(r)
    return best, totals[best], totals, bound
