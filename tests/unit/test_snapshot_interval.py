"""The full-snapshot interval (Young/Daly, bounded) and the replay arithmetic (costmodel/snapshot_interval.py)."""

from __future__ import annotations

import math

from dynaresize.costmodel.snapshot_interval import (MAX_EVERY, expected_replay_steps, per_step_bytes,
                                                    snapshot_every, young_daly_every)


def test_young_daly_interval_in_steps():
    # sqrt(2 x 2 s x 3600 s) = 120 s of steps of 10 s: every 12 steps
    assert young_daly_every(2.0, 3600.0, 10.0) == 12
    assert young_daly_every(2.0, 3600.0 * 4, 10.0) == 24  # 4x the MTBF: 2x the interval
    assert young_daly_every(8.0, 3600.0, 10.0) == 24  # 4x the cost: 2x the interval


def test_interval_is_bounded():
    assert young_daly_every(0.0, 3600.0, 10.0) == 1  # free snapshots: every step
    assert young_daly_every(1e6, 1e6, 1.0) == MAX_EVERY  # replay stays bounded
    assert young_daly_every(1.0, 3600.0, 0.0) == MAX_EVERY  # no step time measured


def test_configured_interval_wins():
    assert snapshot_every(5, 2.0, 3600.0, 10.0) == 5
    assert snapshot_every(0, 2.0, 3600.0, 10.0) == 12


def test_replay_and_bytes_per_step():
    assert expected_replay_steps(1) == 0 and expected_replay_steps(9) == 4
    # full of 12 units every 4 steps, params of 4 units between: (12 + 3 x 4) / 4
    assert math.isclose(per_step_bytes(12, 4, 4), 6.0)
    assert math.isclose(per_step_bytes(12, 4, 1), 12.0)  # K = 1: a full snapshot per step
