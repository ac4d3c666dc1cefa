"""`dynaresize bench checkpoint`: what a streaming checkpoint costs, measured on real workers.

A streaming job (`train.staleness = 2`) on the bench model (about `--params` parameters, the
same Qwen2 sizing as `bench resize`) runs `--steps` steps on 4 CPU devices with a checkpoint
after every step. A streaming checkpoint holds the trainer state (parameters, Adam moments,
step), the weight versions the steps in flight need (ETA of them: `rollout/` and `rollout-vV/`)
and the samples those steps already have (driver/checkpointing.py). Reported, from the run's
own records: each periodic checkpoint's seconds and bytes (its `checkpoint` record), the median
step time, and their ratio, side by side in one run. Writes DIR/bench_checkpoint.json and keeps
the run's records in DIR/run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dynaresize.commands.bench_resize import model_for_params


def main(args: argparse.Namespace) -> int:
    import ray

    from dynaresize.config_load import build_config, merge
    from dynaresize.driver.run import run_job
    from dynaresize.presets import preset
    from dynaresize.records import read_records

    out = Path(args.out or f"bench-checkpoint-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    data = merge(preset("cpu"), {
        "steps": args.steps, "model": model_for_params(args.params),
        "cluster": {"devices": 4, "rollout_devices": 2},
        "rollout": {"engine": "hf", "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 16},
        "train": {"staleness": 2}, "checkpoint": {"every_steps": 1}, "policy": {"name": "static"}})
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run_job(build_config(data), out / "run", progress=False)
    finally:
        if started:
            ray.shutdown()
    records = out / "run" / "records.jsonl"
    ckpts = [r for r in read_records(records, "checkpoint") if r["cause"] == "periodic"]
    steps = [r["t_end_s"] - r["t_start_s"] for r in read_records(records, "step")][1:]  # step 0 starts the engines
    ckpt_s = statistics.median(r["seconds"] for r in ckpts)
    step_s = statistics.median(steps)
    result = {"benchmark": "checkpoint", "staleness": 2, "params": args.params, "checkpoints": len(ckpts),
              "checkpoint_s_median": ckpt_s, "checkpoint_bytes_median": statistics.median(r["bytes"] for r in ckpts),
              "stream_samples_median": statistics.median(r["stream_samples"] for r in ckpts),
              "weight_versions": max(r["weight_versions"] for r in ckpts), "step_s_median": step_s,
              "checkpoint_over_step": ckpt_s / step_s}
    (out / "bench_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench checkpoint: streaming (staleness 2), ~{args.params / 1e6:.0f}M parameters: a checkpoint "
          f"{ckpt_s:.2f} s and {result['checkpoint_bytes_median'] / 2**20:.0f} MiB "
          f"({result['weight_versions']} weight versions + trainer state, "
          f"{result['stream_samples_median']:.0f} samples kept); a step {step_s:.2f} s; "
          f"checkpoint / step = {result['checkpoint_over_step']:.2f}")
    return 0
