"""`dynaresize bench sync`: full against delta weight sync (`rollout.weight_sync`) on real workers.

The same static job (2 CPU devices: 1 trainer, 1 HF rollout engine in bf16; a model of a few
million parameters so a sync moves megabytes) runs four times: at learning rates 1e-6 and 1e-5,
each with `rollout.weight_sync = full` and `delta`, same seed. Per run, over the syncs after the
first (the first is full in either mode: the delta chain starts there), the mean bytes on the
wire per sync (the engine's `weight_sync` records, `wire_bytes`), the mean seconds per sync
(the step records' `sync_s`: from the first participant's start to the last one's end, the
trainers' gather included) and the mean changed fraction. Printed side by side with the
ratios delta / full, and written to DIR/bench-sync.json; the runs stay in DIR/<lr>-<mode>.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LRS = (1e-6, 1e-5)
MODES = ("full", "delta")


def job_config(args: argparse.Namespace, lr: float, mode: str):
    from dynaresize.config_load import build_config, merge
    from dynaresize.presets import preset

    return build_config(merge(preset("cpu"), {
        "steps": args.steps, "seed": 0, "cluster": {"devices": 2, "rollout_devices": 1},
        "rollout": {"engine": "hf", "dtype": "bf16", "weight_sync": mode, "prompts_per_step": 2,
                    "samples_per_prompt": 2, "max_new_tokens": 8},
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4, "num_kv_heads": 2,
                  "vocab_size": 2048},
        "train": {"lr": lr, "staleness": 0}, "policy": {"name": "static"}}))


def measure(run_dir: Path) -> dict:
    """Means over the syncs after the first: wire bytes, seconds, changed fraction; and modes."""
    from dynaresize.records import read_records

    syncs = [r for r in read_records(run_dir / "records.jsonl", "weight_sync") if r["step"] > 0]
    steps = [r for r in read_records(run_dir / "records.jsonl", "step") if r["step"] > 0 and r["sync_s"] > 0]
    fracs = [r["changed_fraction"] for r in syncs if r.get("changed_fraction") is not None]
    if not syncs or not steps:
        raise RuntimeError(f"bench sync: {run_dir} recorded no weight sync after the first")
    return {"syncs": len(syncs), "modes": sorted({r["mode"] for r in syncs}),
            "wire_bytes": sum(r["wire_bytes"] for r in syncs) / len(syncs),
            "sync_s": sum(r["sync_s"] for r in steps) / len(steps),
            "changed_fraction": sum(fracs) / len(fracs) if fracs else None}


def main(args: argparse.Namespace) -> int:
    import ray

    from dynaresize.driver.run import run_job

    out = Path(args.out or f"bench-sync-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for lr in LRS:
            for mode in MODES:
                name = f"{lr:g}-{mode}"
                run_job(job_config(args, lr, mode), out / name, progress=False)
                runs[name] = measure(out / name)
    finally:
        ray.shutdown()
    rows = []
    for lr in LRS:
        full, delta = runs[f"{lr:g}-full"], runs[f"{lr:g}-delta"]
        if delta["modes"] != ["delta"] or full["modes"] != ["full"]:
            raise RuntimeError(f"bench sync: lr {lr:g}: modes {full['modes']} / {delta['modes']}")
        rows.append({"lr": lr, "full_bytes": full["wire_bytes"], "delta_bytes": delta["wire_bytes"],
                     "bytes_ratio": delta["wire_bytes"] / full["wire_bytes"], "full_s": full["sync_s"],
                     "delta_s": delta["sync_s"], "seconds_ratio": delta["sync_s"] / full["sync_s"],
                     "changed_fraction": delta["changed_fraction"], "syncs": delta["syncs"]})
    result = {"benchmark": "sync", "steps": args.steps, "hidden_size": args.hidden, "num_layers": args.layers,
              "engine_dtype": "bfloat16", "rows": rows, "runs": runs}
    (out / "bench-sync.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench sync: bf16 HF engine, {args.steps} steps, per sync after the first (mean)")
    print(f"{'lr':>7} {'full MB':>9} {'delta MB':>9} {'bytes':>7} {'full s':>8} {'delta s':>8} {'seconds':>8} "
          f"{'changed':>8}")
    for r in rows:
        print(f"{r['lr']:>7g} {r['full_bytes'] / 1e6:>9.2f} {r['delta_bytes'] / 1e6:>9.3f} {r['bytes_ratio']:>7.3f} "
              f"{r['full_s']:>8.3f} {r['delta_s']:>8.3f} {r['seconds_ratio']:>8.2f} {r['changed_fraction']:>8.4f}")
    return 0
