"""Checks that a run config's emulation fields fit together and with the cost model, and that
every split the config names is one the run's bounds allow.

`config_load.build_config` runs them once the fields have passed their own checks (each field
checks itself in `config`); they need the accelerator and model presets, so they live here,
beside the bounds they apply, and not in `config`.

Pure: no Ray, torch, I/O or clock. Config objects are read duck-typed.
"""

from __future__ import annotations

from typing import Any

from dynaresize.config import parse_schedule
from dynaresize.emulate.model import emulated_bounds, parse, run_bounds


def check_config(cfg: Any) -> list[tuple[str, Any, str]]:
    """(field path, value, message) for each problem emulation, or the run's bounds, have with a
    run config: the emulated accelerator, and every split the config names up front (the starting
    split, `static:R`, a scripted schedule) against the bounds the run will apply."""
    c = cfg.cluster
    out: list[tuple[str, Any, str]] = []
    if c.emulate:
        try:
            target = parse(c.emulate)
        except ValueError as exc:
            return [("cluster.emulate", c.emulate, str(exc))]
        if c.time_scale is not None and not c.time_scale > 0:
            out.append(("cluster.time_scale", c.time_scale, "must be > 0 (emulated seconds per wall second)"))
    elif c.time_scale is not None:
        out.append(("cluster.time_scale", c.time_scale, "only used with cluster.emulate (ACCEL:MODEL)"))
    if c.devices < 2 or not 0 < c.rollout_devices < c.devices:
        return out  # ClusterConfig names those
    p = cfg.policy
    if p.min_rollout + p.min_train > c.devices:
        return out  # RunConfig names that
    b = emulated_bounds(target, p, c.devices) if c.emulate else run_bounds(cfg)
    on = f"{target.spec} on {c.devices} devices" if c.emulate else f"{c.devices} devices"
    if not b.splits():
        out.append(("cluster.devices", c.devices,
                    f"too few for {on}: rollout needs >= {b.min_rollout} devices and training "
                    f">= {b.min_train} (the training state's memory floor)"))
        return out
    legal = ", ".join(map(str, b.splits()))
    if not b.allowed(c.rollout_devices):
        out.append(("cluster.rollout_devices", c.rollout_devices,
                    f"not a legal split for {on} ({b.why_not(c.rollout_devices)}; legal: {legal})"))
    for path, value, step, r in _named_splits(p):
        if not b.allowed(r):
            out.append((path, value, f"{r} rollout devices before step {step} is not a legal split for {on} "
                                     f"({b.why_not(r)}; legal: {legal})"))
    return out


def _named_splits(policy: Any) -> list[tuple[str, Any, int, int]]:
    """(field path, value, step, rollout devices) of each split the policy config names: `static:R`
    and the entries of a scripted schedule. Malformed ones are left to `make_policy` to name."""
    name = str(policy.name)
    if name.startswith("static:") and name[len("static:"):].strip().isdigit():
        return [("policy.name", name, 0, int(name[len("static:"):]))]
    if name == "scripted" and policy.schedule:
        try:
            return [("policy.schedule", policy.schedule, step, r) for step, r in parse_schedule(policy.schedule)]
        except ValueError:
            return []
    return []
