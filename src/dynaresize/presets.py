"""Presets: plain functions returning a nested config dict (before files, flags and --set).

`default` is the embedded job `dynaresize run` runs with no arguments: local Ray, 4 CPU
devices, the tiny Qwen2, the toy task, the hysteresis policy and synthetic long-tail lengths
whose mean first falls then rises, so resizes happen in both directions.
"""

from __future__ import annotations

from typing import Callable

from dynaresize.errors import ConfigError


def default() -> dict:
    return {
        "steps": 30,
        "seed": 0,
        "cluster": {"devices": 4, "rollout_devices": 3},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 128,
                    "synthetic_lengths": True, "length_workload": "demo"},
        # Resizes on this CPU demo cost well under a second (measured); the default prior
        # (10 s, a GPU cluster's warm join) would veto every move before the first is measured.
        # A 24-step run: the gain horizon is a few steps, not the 20 of a long GPU job.
        "policy": {"name": "hysteresis", "move_cost_prior_s": 0.5, "horizon_steps": 6},
        "train": {"lr": 5e-3},
    }


def static() -> dict:
    """The default job on a fixed split (the comparison a user runs first)."""
    cfg = default()
    cfg["policy"] = {"name": "static"}
    return cfg


def deterministic() -> dict:
    """Deterministic mode: a run with resizes equals a static run with the same seed."""
    cfg = default()
    cfg["deterministic"] = True
    return cfg


def user() -> dict:
    """A starting point for real prompts: natural response lengths (EOS), hysteresis policy."""
    cfg = default()
    cfg["rollout"] = {**cfg["rollout"], "synthetic_lengths": False}
    return cfg


PRESETS: dict[str, Callable[[], dict]] = {
    "default": default,
    "static": static,
    "deterministic": deterministic,
    "user": user,
}


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError([f"preset={name!r}: unknown (known: {', '.join(PRESETS)})"])
    return PRESETS[name]()
