"""metrics.py: one assembly of a run's headline numbers for the simulator, the runtime and compare."""

from __future__ import annotations

import pytest

from dynaresize.metrics import resize_counts, throughput_fields


def test_fractions_are_shares_of_device_time():
    m = throughput_fields(num_devices=4, total_time_s=10.0, num_samples=50, idle_device_s=8.0, tail_idle_device_s=2.0)
    assert m == {"total_time_s": 10.0, "samples_per_s": 5.0, "idle_fraction": pytest.approx(0.2),
                 "tail_idle_fraction": pytest.approx(0.05)}
    empty = throughput_fields(num_devices=4, total_time_s=0.0, num_samples=0, idle_device_s=0.0, tail_idle_device_s=0.0)
    assert empty["samples_per_s"] == empty["idle_fraction"] == 0.0


def test_resizes_are_counted_by_direction():
    assert resize_counts(["train", "rollout", "rollout"]) == {"resizes": 3, "resizes_to_rollout": 2,
                                                              "resizes_to_train": 1}
    assert resize_counts([]) == {"resizes": 0, "resizes_to_rollout": 0, "resizes_to_train": 0}
