"""How often a run takes a full in-memory snapshot, and what recovery by replay costs (pure).

A full snapshot (parameters, optimizer moments, the reference weights) is taken every K steps;
between them the driver keeps the scored samples of the steps since, and a loss restores the
last full snapshot and replays those steps (driver/snapshots.py, docs/faults.md). Young's
first-order optimum (Young 1974; Daly 2006) for the interval between checkpoints of cost C
under a mean time between failures M is sqrt(2 C M); in steps of T seconds:

    K = round(sqrt(2 * C * M) / T), bounded to [1, MAX_EVERY]

The bound keeps the replay of a fault short and the samples kept small whatever the estimate.
Expected replay per fault: (K - 1) / 2 steps (a fault falls uniformly between two snapshots),
K - 1 at worst.

Invariant: `snapshot_every` is a function of its arguments only (no clock, no I/O).
"""

from __future__ import annotations

import math

MAX_EVERY = 50  # steps: the longest replay a fault may cost is MAX_EVERY - 1 steps


def young_daly_every(snapshot_s: float, mtbf_s: float, step_s: float) -> int:
    """The full-snapshot interval in steps, from a snapshot's cost, the MTBF and the step time."""
    if step_s <= 0 or not math.isfinite(step_s):
        return MAX_EVERY
    k = math.sqrt(2.0 * max(snapshot_s, 0.0) * mtbf_s) / step_s
    return max(1, min(MAX_EVERY, int(round(k))))


def snapshot_every(configured: int, snapshot_s: float, mtbf_s: float, step_s: float) -> int:
    """`checkpoint.snapshot_every_steps` when set (> 0), else Young/Daly's K."""
    if configured > 0:
        return configured
    return young_daly_every(snapshot_s, mtbf_s, step_s)


def expected_replay_steps(every: int) -> float:
    """Steps replayed by one fault, on average (a fault uniform over the interval)."""
    return (every - 1) / 2.0


def per_step_bytes(full_bytes: int, params_bytes: int, every: int) -> float:
    """Host bytes copied per step: a parameters copy each step, the full state every K steps."""
    return full_bytes / every + params_bytes * (every - 1) / every
