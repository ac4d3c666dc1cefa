"""Presets: plain functions returning a nested config dict (before files, flags and --set).

Nothing is paced unless a preset, a file, `--emulate` or `cluster.emulate` says so, and only
`demo` (and `compare`'s starting point) does.

`default` is what `dynaresize run` runs with no arguments: a local Ray with 4 CPU devices at
this machine's own speed, the `demo` workload (the same job as `cpu`).

`demo` is the embedded demo `make demo` runs (`--preset demo`): a local Ray with 6 device
workers paced as A100s running a 7B model (`cluster.emulate`, see docs/emulate.md), the tiny
Qwen2 really generating and training on the toy task, the hysteresis policy, and synthetic
lengths of the `demo-cap-raise` workload, whose length cap rises 8x at step 10 (the midpoint):
before it training is the slower stage and the policy gives it devices; after it the released
tail makes rollout the slower one and the policy moves them back. Because every device is
paced to the same emulated hardware, the resizes and their gain do not depend on how fast or
loaded this machine is.

`cpu` is the job at this machine's own speed (no emulation): 4 CPU devices, the `demo`
workload; `user` starts from it for real prompts, `static` and `deterministic` are it on a fixed
split and in deterministic mode. Tests build on `cpu`.

`math` is a real math task, offline: grade-school arithmetic word problems in verl's parquet
schema, graded by math-verify, on the tiny model, 3 CPU devices, with scripted resizes each way.

`dapo` is the `math` job with DAPO's dynamic sampling, overlong shaping and clip-higher on
(verl's DAPO recipe in this project's names: docs/training.md).

`agent` is a multi-turn task: arithmetic with a calculator tool (`agent-calc`, rl/agent_task.py;
the model must call the tool to score), up to 3 turns, on the tiny model, 3 CPU devices, with
scripted resizes each way (`--set task.name=agent-guess` runs the pure-text guessing game).
"""

from __future__ import annotations

from typing import Callable

from dynaresize.errors import ConfigError


def demo() -> dict:
    """The emulated demo (`make demo`): see the module docstring."""
    return {
        "steps": 20,
        "seed": 0,
        # A100 80 GB x 6 emulated: a 7B's training state (16 B/param, costmodel.memory) needs >= 3
        # training devices, so the legal splits are 1..3 rollout devices; it starts at 3:3. 60
        # emulated seconds per wall second: a step of ~240 emulated seconds lasts ~4 s, well above
        # the real work of a few tokens per sample.
        "cluster": {"devices": 6, "rollout_devices": 3, "emulate": "a100:7b", "time_scale": 60.0},
        # The real work stays far below the paced time: 32 x 8 samples, each really generating
        # <= 8 tokens (its length from the workload scaled to max_new_tokens; its emulated length
        # is the workload's own, up to 16k tokens) after the prompt's last 4 tokens (the example
        # words), on a Qwen2 smaller than the built-in one (0.25M parameters: ~10x less compute).
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
        "rollout": {"prompts_per_step": 32, "samples_per_prompt": 8, "max_new_tokens": 8, "max_prompt_tokens": 4,
                    "batch_rows": 16, "synthetic_lengths": True, "length_workload": "demo-cap-raise"},
        # A 20-step run: the gain horizon is a few steps, not the 20 of a long job. The move-cost
        # prior stays the GPU default (10 emulated seconds) until the first move is measured.
        "policy": {"name": "hysteresis", "horizon_steps": 6},
        "train": {"lr": 5e-3, "micro_batch_size": 64},
    }


def cpu() -> dict:
    """The job at this machine's own speed: 4 CPU devices, nothing paced, the `demo` workload
    (its mean length falls then rises, so resizes can go both ways when this machine's stage
    times let them pay)."""
    return {
        "steps": 30,
        "seed": 0,
        "cluster": {"devices": 4, "rollout_devices": 3},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 128,
                    "synthetic_lengths": True, "length_workload": "demo"},
        # Resizes on this CPU job cost well under a second (measured); the default prior
        # (10 s, a GPU cluster's warm join) would veto every move before the first is measured.
        # A short run: the gain horizon is a few steps, not the 20 of a long GPU job.
        "policy": {"name": "hysteresis", "move_cost_prior_s": 0.5, "horizon_steps": 6},
        "train": {"lr": 5e-3},
    }


def static() -> dict:
    """The `cpu` job on a fixed split (the comparison a user runs first)."""
    cfg = cpu()
    cfg["policy"] = {"name": "static"}
    return cfg


def deterministic() -> dict:
    """Deterministic mode: a run with resizes equals a static run with the same seed."""
    cfg = cpu()
    cfg["deterministic"] = True
    return cfg


def user() -> dict:
    """A starting point for real prompts: natural response lengths (EOS), hysteresis policy,
    this machine's own speed."""
    cfg = cpu()
    cfg["rollout"] = {**cfg["rollout"], "synthetic_lengths": False}
    return cfg


def math() -> dict:
    """A real math task, offline: the built-in `arith` task (grade-school arithmetic word problems
    generated from a fixed seed into verl's parquet schema, chat prompts, graded by math-verify in
    two reward workers: rl/math_task.py) on the tiny model at this machine's own speed, 3 CPU
    devices, natural response lengths, and scripted resizes each way: training gets a device
    before step 2 and rollout takes it back before step 4 (the policy would need stage times
    this machine does not give reliably; `--policy hysteresis` runs it under the policy)."""
    return {
        "steps": 6,
        "seed": 0,
        "cluster": {"devices": 3, "rollout_devices": 2},
        "task": {"name": "arith", "reward_workers": 2, "reward_timeout_s": 30.0},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 32,
                    "synthetic_lengths": False},
        "policy": {"name": "scripted", "schedule": "2:1,4:2"},
        "train": {"lr": 5e-3},
    }


def dapo() -> dict:
    """DAPO as verl users run it, on the `math` job: dynamic sampling (prompt groups whose shaped
    reward is the same for every sample are filtered out and further generation batches of 4
    prompts are generated until the step has its 4 groups; at most 8 batches), soft overlong
    punishment over the last 24 of the 32 response tokens, clip-higher (0.2 / 0.28) and the
    token-mean loss; scripted resizes each way (training gets a device before step 2, rollout
    takes it back before step 4). Response lengths come from the `dapo-qwen3-8b` workload (scaled
    to the 32-token budget): the tiny random model almost never ends before its budget, so with
    natural lengths every response is 32 tokens, every shaped reward -1 and every group filtered
    (the run stops at the cap). The overlong buffer is the budget's last 24 tokens, so a group
    whose responses all end within 8 tokens (and are all wrong) is constant and filtered."""
    cfg = math()
    cfg["algorithm"] = {"filter_groups": True, "filter_metric": "reward", "max_num_gen_batches": 8}
    cfg["rollout"] = {**cfg["rollout"], "gen_prompts_per_step": 4, "synthetic_lengths": True,
                      "length_workload": "dapo-qwen3-8b"}
    cfg["reward"] = {"overlong_buffer_len": 24, "overlong_penalty_factor": 1.0}
    cfg["train"] = {**cfg["train"], "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"}
    return cfg


def agent() -> dict:
    """A multi-turn task with a tool (see the module docstring): trajectories of up to 3 model
    turns of <= 24 tokens with calculator results in between, 320 tokens in all; training gets
    a device before step 2 and rollout takes it back before step 4."""
    return {
        "steps": 6,
        "seed": 0,
        "cluster": {"devices": 3, "rollout_devices": 2},
        "task": {"name": "agent-calc", "max_turns": 3, "max_total_tokens": 320, "env_timeout_s": 10.0},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 24, "max_prompt_tokens": 160,
                    "synthetic_lengths": False},
        "policy": {"name": "scripted", "schedule": "2:1,4:2"},
        "train": {"lr": 5e-3},
    }


PRESETS: dict[str, Callable[[], dict]] = {
    "default": cpu,  # unpaced: emulation only when asked
    "cpu": cpu,
    "demo": demo,
    "static": static,
    "deterministic": deterministic,
    "user": user,
    "math": math,
    "dapo": dapo,
    "agent": agent,
}


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError([f"preset={name!r}: unknown (known: {', '.join(PRESETS)})"])
    return PRESETS[name]()
