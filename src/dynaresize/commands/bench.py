"""`dynaresize bench {sim,resize,rollout,checkpoint,sync}`: benchmarks.

- `bench sim`: wall time of one policy simulated on a large cluster (default 1,024 devices x
  1,000 steps of longtail-drift, hysteresis). Writes DIR/bench_sim.json when --out is given.
- `bench resize`: measured resize costs on real workers; implemented in
  `dynaresize.commands.bench_resize` (imported only when asked for).
- `bench rollout`: the runtime's rollout path against one vLLM engine's own generate over the
  same requests (`dynaresize.commands.bench_rollout`).
- `bench checkpoint`: a streaming checkpoint's seconds and bytes against a step's time, on real
  workers (`dynaresize.commands.bench_checkpoint`).
- `bench sync`: full against delta weight sync, bytes and seconds per sync at two learning
  rates in bf16 (`dynaresize.commands.bench_sync`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: simulator speed (sim), measured resize costs (resize), "
                                     "a streaming checkpoint's cost (checkpoint)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    s = actions.add_parser("sim", help="wall time of one policy on a large simulated cluster")
    s.add_argument("--devices", type=int, default=1024)
    s.add_argument("--steps", type=int, default=1000)
    s.add_argument("--workload", default="longtail-drift")
    s.add_argument("--model", default="7b")
    s.add_argument("--policy", default="hysteresis")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", metavar="DIR", default=None, help="write DIR/bench_sim.json and the run's records")
    s.set_defaults(func=main)

    r = actions.add_parser("resize", help="measured critical and total resize seconds on real workers")
    r.add_argument("--devices", type=int, default=4, help="workers (devices) to start")
    r.add_argument("--params", type=float, default=4e7, help="model parameters of the resharded state (default ~40M)")
    r.add_argument("--repeats", type=int, default=3, help="resizes per direction")
    r.add_argument("--out", metavar="DIR", default=None, help="output directory")
    r.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="override one run-config field, e.g. --set rollout.engine=vllm (repeatable)")
    r.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="then move a device each way in a job training a rank-R LoRA adapter (train.lora), "
                        "beside the full-training moves: critical path and bytes per move (default 0: none)")
    r.set_defaults(func=main)

    o = actions.add_parser("rollout", help="the runtime's rollout path against one vLLM engine's own generate")
    o.add_argument("--steps", type=int, default=4, help="steps of the run (its windows 0..steps-2 are measured)")
    o.add_argument("--prompts", type=int, default=16, help="prompts per step")
    o.add_argument("--samples", type=int, default=4, help="samples per prompt")
    o.add_argument("--max-new-tokens", type=int, default=128, help="response budget (lengths forced below it)")
    o.add_argument("--out", metavar="DIR", default=None, help="output directory (DIR/bench-rollout.json)")
    o.set_defaults(func=main)

    c = actions.add_parser("checkpoint", help="a streaming checkpoint's seconds and bytes, as a ratio to a step's time")
    c.add_argument("--params", type=float, default=4e7, help="model parameters (default ~40M)")
    c.add_argument("--steps", type=int, default=4, help="steps of the streaming run (a checkpoint after each)")
    c.add_argument("--snapshot-steps", type=int, default=10, help="steps of the run measuring in-memory snapshots")
    c.add_argument("--snapshot-every", type=int, default=0,
                   help="its checkpoint.snapshot_every_steps (default 0: Young/Daly's K)")
    c.add_argument("--out", metavar="DIR", default=None, help="output directory")
    c.set_defaults(func=main)

    y = actions.add_parser("sync", help="full against delta weight sync: bytes and seconds per sync, with ratios")
    y.add_argument("--steps", type=int, default=6, help="steps of each run (the syncs after the first are measured)")
    y.add_argument("--hidden", type=int, default=512, help="the model's hidden size (default 512: ~11M parameters)")
    y.add_argument("--layers", type=int, default=4, help="the model's layers")
    y.add_argument("--out", metavar="DIR", default=None, help="output directory (DIR/bench-sync.json)")
    y.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.action == "sim":
        return bench_sim(args)
    if args.action == "rollout":
        return int(importlib.import_module("dynaresize.commands.bench_rollout").main(args) or 0)
    if args.action == "sync":
        return int(importlib.import_module("dynaresize.commands.bench_sync").main(args) or 0)
    if args.action == "checkpoint":
        return int(importlib.import_module("dynaresize.commands.bench_checkpoint").main(args) or 0)
    return int(importlib.import_module("dynaresize.commands.bench_resize").main(args) or 0)


def bench_sim(args: argparse.Namespace) -> int:
    from dynaresize.costmodel.scenarios import workload_scenario
    from dynaresize.sim.shell import simulate

    t0 = time.perf_counter()
    scenario = workload_scenario(args.workload, num_devices=args.devices, num_steps=args.steps, model=args.model,
                                 seed=args.seed)
    doc = simulate(scenario, [args.policy], out_dir=args.out, progress=False)
    wall_s = time.perf_counter() - t0
    r = doc["results"][0]
    result = {"benchmark": "sim", "policy": args.policy, "workload": args.workload, "devices": args.devices,
              "steps": args.steps, "model": args.model, "wall_s": wall_s,
              "steps_per_s": args.steps / wall_s if wall_s > 0 else None,
              "samples_per_step": doc["samples_per_step"], "simulated_samples_per_s": r["samples_per_s"],
              "resizes": r["resizes"]}
    print(f"bench sim: {args.policy} on {args.workload}, {args.devices} devices x {args.steps} steps "
          f"({doc['samples_per_step']} samples/step): {wall_s:.1f} s wall "
          f"({result['steps_per_s']:.0f} steps/s); simulated {r['samples_per_s']:.1f} samples/s, {r['resizes']} resizes")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_sim.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
