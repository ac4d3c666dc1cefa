"""The policy interface and its factory.

A policy sees one `StepReport` per finished step and returns `Keep` or `Move`. It never
changes the assignment itself: the controller checks the bounds, the cooldown and the reversal
window, and plans the move. Policies are pure (no I/O, no clock) and deterministic.

Optional attributes the controller and the simulator read with `getattr` (absent = default):
- `cooldown_steps: int` (0): reports after a move in which the controller suppresses moves;
- `reversal_window_steps: int` (0): the controller refuses a move that reverses the previous
  move's direction within this many steps;
- `start_rollout: int | None` (None): the rollout pool size the policy wants from step 0 (a
  runtime starts there when it can; `static:R`, a scripted step-0 entry, the simulator's pilot);
- `lends: bool` (False): the simulator lends idle trainers to rollout inside each step;
- `reads_response_lengths: bool` (True): False lets a runtime leave `StepReport.response_lengths`
  empty (the simulator's sweeps skip building them);
- `on_bounds(bounds)`: called when the bounds change (devices lost).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from dynaresize.config import PolicyConfig, parse_schedule
from dynaresize.errors import ConfigError
from dynaresize.types import Bounds, Decision, StepReport

SIMULATOR_ONLY = ("lend", "best-static", "oracle")


@runtime_checkable
class Policy(Protocol):
    name: str

    def decide(self, report: StepReport) -> Decision: ...


def parse_static(name: str) -> int:
    """"static:12" -> 12; anything else is a ConfigError naming the value."""
    _, _, value = name.partition(":")
    if not value.strip().isdigit():
        raise ConfigError([f"policy.name={name!r}: expected static:R with R a number of rollout devices"])
    return int(value)


def make_policy(cfg: PolicyConfig, bounds: Bounds, *, num_steps: int | None = None, simulator: bool = False,
                pilot_rollout: int | None = None, staleness: int = 1) -> Policy:
    """Build the policy `cfg.name` under `bounds`.

    `num_steps` lets a policy stop moving when too few steps remain to pay a move back.
    `simulator=True` allows the simulator-only `lend`; `pilot_rollout` is the split a pilot run
    found (the simulator's sweep of the first `profile_steps` steps); without it
    `static-profiled` finds the balanced split from its own first reports. `staleness` is the
    pipeline's (0: serial, where `hysteresis` adds the stages; 1: one-step-off; >= 2:
    streaming, where `hysteresis` uses its throughput model).
    """
    from dynaresize.policy.baselines import Greedy, Lend, Scripted, Static, StaticProfiled
    from dynaresize.policy.hysteresis import Hysteresis

    name = cfg.name
    if name == "hysteresis":
        return Hysteresis(cfg, bounds, num_steps=num_steps, start_rollout=pilot_rollout, staleness=staleness)
    if name == "static":
        return Static(cfg.static_rollout, name="static")
    if name.startswith("static:"):
        return Static(parse_static(name), name=name)
    if name == "static-profiled":
        return StaticProfiled(cfg, bounds, pilot_rollout=pilot_rollout)
    if name == "greedy":
        return Greedy(cfg, bounds, start_rollout=pilot_rollout)
    if name == "scripted":
        try:
            schedule = parse_schedule(cfg.schedule)
        except ValueError as exc:
            raise ConfigError([f"policy.schedule={cfg.schedule!r}: {exc}"]) from None
        return Scripted(schedule)
    if name == "lend":
        if not simulator:
            raise ConfigError([f"policy.name={name!r}: simulator only (use it with `dynaresize simulate`)"])
        return Lend(start_rollout=pilot_rollout)
    if name in SIMULATOR_ONLY:
        raise ConfigError([f"policy.name={name!r}: simulator only; the simulator builds it from its sweep"])
    raise ConfigError([f"policy.name={name!r}: unknown policy"])
