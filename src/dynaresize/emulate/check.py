"""Checks that a run config's emulation fields fit together and with the cost model.

`configload.build_config` runs them once the fields have passed their own checks (each field
checks itself in `config`); they need the accelerator and model presets, so they live here,
beside the bounds they apply, and not in `config`.

Pure: no Ray, torch, I/O or clock. Config objects are read duck-typed.
"""

from __future__ import annotations

from typing import Any

from dynaresize.emulate.model import emulated_bounds, parse


def check_config(cfg: Any) -> list[tuple[str, Any, str]]:
    """(field path, value, message) for each problem emulation has with a run config."""
    c = cfg.cluster
    out: list[tuple[str, Any, str]] = []
    if not c.emulate:
        if c.time_scale is not None:
            out.append(("cluster.time_scale", c.time_scale, "only used with cluster.emulate (ACCEL:MODEL)"))
        return out
    try:
        target = parse(c.emulate)
    except ValueError as exc:
        return [("cluster.emulate", c.emulate, str(exc))]
    if c.time_scale is not None and not c.time_scale > 0:
        out.append(("cluster.time_scale", c.time_scale, "must be > 0 (emulated seconds per wall second)"))
    if c.devices < 2 or not 0 < c.rollout_devices < c.devices:
        return out  # ClusterConfig names those
    b = emulated_bounds(target, cfg.policy, c.devices, cfg)
    if not b.splits():
        out.append(("cluster.devices", c.devices,
                    f"too few for {target.spec}: rollout needs >= {b.min_rollout} devices and training "
                    f">= {b.min_train} (the training state's memory floor)"))
    elif not b.allowed(c.rollout_devices):
        out.append(("cluster.rollout_devices", c.rollout_devices,
                    f"not a legal split for {target.spec} on {c.devices} devices ({b.why_not(c.rollout_devices)}; "
                    f"legal: {', '.join(map(str, b.splits()))})"))
    return out
