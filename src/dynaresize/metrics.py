"""A run's headline numbers, assembled one way for the simulator, the real runtime and `compare`.

`dynaresize simulate` (sim/engine.py, sim/stream.py), `dynaresize run` (runtime.py) and
`dynaresize compare` (which puts the two side by side) all report a run with these fields, from
the same inputs: the devices, the run's time, the samples consumed, the device-seconds no work
ran (and the part of it rollout devices spent waiting for a step's last response), and the
resizes by direction. So a `prediction_error` compares two numbers defined the same way.

Invariants: `idle_fraction` and `tail_idle_fraction` are shares of `num_devices x
total_time_s`, `tail_idle_fraction <= idle_fraction`; `resizes = resizes_to_rollout +
resizes_to_train`. Pure: no Ray, torch or I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from dynaresize.types import ROLLOUT, TRAIN


def throughput_fields(*, num_devices: int, total_time_s: float, num_samples: int, idle_device_s: float,
                      tail_idle_device_s: float) -> dict:
    """`total_time_s`, `samples_per_s`, `idle_fraction`, `tail_idle_fraction` of a run."""
    device_s = num_devices * total_time_s
    return {
        "total_time_s": total_time_s,
        "samples_per_s": num_samples / total_time_s if total_time_s > 0 else 0.0,
        "idle_fraction": idle_device_s / device_s if device_s > 0 else 0.0,
        "tail_idle_fraction": tail_idle_device_s / device_s if device_s > 0 else 0.0,
    }


def resize_counts(to_roles: Iterable[str]) -> dict:
    """`resizes`, `resizes_to_rollout`, `resizes_to_train` from each resize's destination role."""
    roles = list(to_roles)
    return {"resizes": len(roles), "resizes_to_rollout": roles.count(ROLLOUT), "resizes_to_train": roles.count(TRAIN)}
