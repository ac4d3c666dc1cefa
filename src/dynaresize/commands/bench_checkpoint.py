"""`dynaresize bench checkpoint`: what a streaming checkpoint costs, measured on real workers.

A streaming job (`train.staleness = 2`) on the bench model (about `--params` parameters, the
same Qwen2 sizing as `bench resize`) runs `--steps` steps on 4 CPU devices with a checkpoint
after every step. A streaming checkpoint holds the trainer state (parameters, Adam moments,
step), the weight versions the steps in flight need (ETA of them: `rollout/` and `rollout-vV/`)
and the samples those steps already have (driver/checkpointing.py). Reported, from the run's
own records: each periodic checkpoint's seconds and bytes (its `checkpoint` record), the median
step time, and their ratio, side by side in one run. Writes DIR/bench_checkpoint.json and keeps
the run's records in DIR/run.

Then the in-memory snapshots' cost per step (driver/snapshots.py), before and after snapshots by
interval: a one-step-off run of `--snapshot-steps` steps on the same model and devices, no
periodic checkpoint, K = `--snapshot-every` (0: Young/Daly's), records in DIR/snapshots.
Before (a full snapshot per step, the driver blocked until it was in the object store): the
run's start snapshot is exactly that operation, blocking; its seconds and bytes, per step.
After: the step snapshots' `critical_s` summed over the steps, per step, and their bytes per
step (`snapshot_bytes_per_step`); each snapshot's critical_s / seconds. Extrapolated by bytes
(seconds in proportion to the bytes, the bench model's bytes per parameter) to 7B and 32B
shapes (`SHAPES`): the copy rate of these CPU workers, not a GPU's device-to-host rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dynaresize.commands.bench_resize import model_for_params, qwen2_num_params

SHAPES = {"7B": 7.6e9, "32B": 32.8e9}  # parameters of Qwen2-7B and Qwen2.5-32B


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
    snap_data = merge(data, {"steps": args.snapshot_steps, "train": {"staleness": 1},
                             "checkpoint": {"every_steps": 0, "snapshot_every_steps": args.snapshot_every}})
    try:
        run_job(build_config(data), out / "run", progress=False)
        snap_summary = run_job(build_config(snap_data), out / "snapshots", progress=False)
    finally:
        if started:
            ray.shutdown()
    snaps = snapshot_costs(read_records(out / "snapshots" / "records.jsonl", "snapshot"), snap_summary,
                           qwen2_num_params(data["model"]))
    records = out / "run" / "records.jsonl"
    ckpts = [r for r in read_records(records, "checkpoint") if r["cause"] == "periodic"]
    steps = [r["t_end_s"] - r["t_start_s"] for r in read_records(records, "step")][1:]  # step 0 starts the engines
    ckpt_s = statistics.median(r["seconds"] for r in ckpts)
    step_s = statistics.median(steps)
    result = {"benchmark": "checkpoint", "staleness": 2, "params": args.params, "checkpoints": len(ckpts),
              "checkpoint_s_median": ckpt_s, "checkpoint_bytes_median": statistics.median(r["bytes"] for r in ckpts),
              "stream_samples_median": statistics.median(r["stream_samples"] for r in ckpts),
              "weight_versions": max(r["weight_versions"] for r in ckpts), "step_s_median": step_s,
              "checkpoint_over_step": ckpt_s / step_s, "snapshots": snaps}
    (out / "bench_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench checkpoint: streaming (staleness 2), ~{args.params / 1e6:.0f}M parameters: a checkpoint "
          f"{ckpt_s:.2f} s and {result['checkpoint_bytes_median'] / 2**20:.0f} MiB "
          f"({result['weight_versions']} weight versions + trainer state, "
          f"{result['stream_samples_median']:.0f} samples kept); a step {step_s:.2f} s; "
          f"checkpoint / step = {result['checkpoint_over_step']:.2f}")
    b, a = snaps["before"], snaps["after"]
    print(f"bench checkpoint: in-memory snapshots per step, before (a full one each step, blocking): "
          f"{b['critical_s_per_step']:.3f} s and {b['bytes_per_step'] / 2**20:.0f} MiB; after (K = {snaps['every']}): "
          f"{a['critical_s_per_step']:.4f} s on the step's path ({a['copy_s_per_step']:.3f} s of copy off it) and "
          f"{a['bytes_per_step'] / 2**20:.0f} MiB; critical/seconds per snapshot at most "
          f"{a['critical_over_seconds_max']:.3f}")
    for name, x in snaps["extrapolated"].items():
        print(f"  {name}: full snapshot {x['full_bytes'] / 1e9:.0f} GB; before {x['before_critical_s_per_step']:.1f} s "
              f"per step on the path; after {x['after_critical_s_per_step']:.2f} s on the path, "
              f"{x['after_bytes_per_step'] / 1e9:.1f} GB copied per step")
    return 0


def snapshot_costs(records: list[dict], summary: dict, num_params: int) -> dict:
    """Snapshot cost per step before (a blocking full snapshot each step: the start snapshot) and
    after (the step snapshots of the run), and both extrapolated by bytes to `SHAPES`."""
    start = next(r for r in records if r["cause"] == "start")
    steps = [r for r in records if r["cause"] == "step"]
    n = max(1, len(steps))
    full = [r for r in steps if r["snapshot_kind"] == "full"] or [start]
    before = {"critical_s_per_step": start["critical_s"], "copy_s": start["seconds"], "bytes_per_step": start["bytes"]}
    after = {"critical_s_per_step": sum(r["critical_s"] for r in steps) / n,
             "copy_s_per_step": sum(r["seconds"] for r in steps) / n,
             "bytes_per_step": summary["snapshot_bytes_per_step"],
             "critical_over_seconds_max": max(r["critical_s"] / r["seconds"] for r in steps if r["seconds"] > 0),
             "critical_s_max": max(r["critical_s"] for r in steps), "full": summary["snapshots_full"],
             "params": summary["snapshots_params"]}
    full_bytes = statistics.median(r["bytes"] for r in full)
    out = {}
    for name, params in SHAPES.items():
        scale = params / num_params
        out[name] = {"params": params, "full_bytes": full_bytes * scale,
                     "before_critical_s_per_step": before["critical_s_per_step"] * scale,
                     "after_critical_s_per_step": after["critical_s_per_step"] * scale,  # an upper bound: the issue part does not grow
                     "after_copy_s_per_step": after["copy_s_per_step"] * scale,
                     "after_bytes_per_step": after["bytes_per_step"] * scale}
    return {"every": summary["snapshot_every"], "steps": len(steps), "bench_params": num_params,
            "before": before, "after": after, "extrapolated": out}
