"""The simulator's prediction of an emulated job: the same job, bounds and starting split the
runtime uses, run by `sim.engine` (one-step-off) or `sim.stream` (streaming).

`dynaresize compare` and `dynaresize run --emulate` put these next to what the runtime
measured. This is the one part of `emulate` that reads the simulator, so the cluster (which
paces its workers with `emulate.model`) never imports it.

Pure: no Ray, torch, I/O or clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dynaresize.emulate.model import Emulator, run_bounds
from dynaresize.errors import ConfigError
from dynaresize.metrics import Prediction


def _start(policy: Any, cfg: Any) -> int:
    start = getattr(policy, "start_rollout", None)
    return cfg.cluster.rollout_devices if start is None else int(start)


def start_split(cfg: Any) -> int:
    """The rollout devices a run of `cfg` starts with (as `driver.run.Run` picks them)."""
    from dynaresize.policy.base import make_policy

    return _start(make_policy(cfg.policy, run_bounds(cfg), num_steps=cfg.steps), cfg)


def predict(cfg: Any, policy_name: str | None = None, recorder: Any = None):
    """The simulator's run of the job `cfg` (emulated) under `policy_name` (default: its own),
    started as the runtime starts it: at `cluster.rollout_devices` unless the policy names its
    split, with the same bounds and no pilot. Returns a `sim.engine.PolicyResult`.

    With `train.staleness` >= 2 it is the streaming engine as the runtime runs it: the trainers
    accumulate a step's gradients as its samples arrive, a replica admits its next share while
    the last request of its current one decodes (`admit`), and `rollout.partial` is partial
    rollout."""
    from dynaresize.policy.base import make_policy
    from dynaresize.sim.engine import run_policy
    from dynaresize.sim.stream import run_stream

    emu = Emulator.from_config(cfg)
    if emu is None:
        raise ConfigError(["cluster.emulate=None: a prediction needs an emulated accelerator (ACCEL:MODEL)"])
    pcfg = replace(cfg.policy, name=policy_name or cfg.policy.name)
    bounds = run_bounds(cfg)
    eta = int(cfg.train.staleness)
    policy = make_policy(pcfg, bounds, num_steps=cfg.steps, staleness=max(eta, 1))
    start = _start(policy, cfg)
    scenario = emu.scenario(cfg.cluster.devices)
    if eta >= 2:
        return run_stream(scenario, scenario.stages(), policy, bounds, start_rollout=start, staleness=eta,
                          partial=cfg.rollout.partial, admit=True, reversal_window=pcfg.horizon_steps,
                          recorder=recorder)
    return run_policy(scenario, scenario.stages(), policy, bounds, start_rollout=start,
                      reversal_window=pcfg.horizon_steps, recorder=recorder)


def best_static(cfg: Any) -> tuple[int, float]:
    """(rollout devices, samples/s) of the best fixed split in hindsight for the job `cfg`, as the
    simulator predicts it (a sweep over the legal splits, `sim.oracle.best_static`; with
    `train.staleness` >= 2 the streaming engine as the runtime runs it, `stream_best_static`)."""
    from dynaresize.sim.oracle import best_static as sweep
    from dynaresize.sim.oracle import build_table, grid, stream_best_static

    emu = Emulator.from_config(cfg)
    if emu is None:
        raise ConfigError(["cluster.emulate=None: a prediction needs an emulated accelerator (ACCEL:MODEL)"])
    scenario = emu.scenario(cfg.cluster.devices)
    bounds, eta = run_bounds(cfg), int(cfg.train.staleness)
    if eta >= 2:
        split, total, _, _ = stream_best_static(scenario, scenario.stages(), bounds, grid(bounds), eta,
                                                cfg.rollout.partial, admit=True)
    else:
        split, total = sweep(build_table(scenario.stages(), grid(bounds), cfg.cluster.devices, cfg.steps))
    return split, scenario.total_samples() / total


def headline_prediction(cfg: Any) -> Prediction:
    """The simulator's figures for a run's headline (`metrics.Prediction`): samples/s of the static
    split the run of `cfg` starts from and of its own policy. Shared by `dynaresize run`'s closing
    summary and `dynaresize report`."""
    start = start_split(cfg)
    static, own = predict(cfg, f"static:{start}"), predict(cfg)
    return Prediction(start_rollout=start, static_samples_per_s=static.samples_per_s,
                      policy_samples_per_s=own.samples_per_s, policy_resizes=own.resizes)
