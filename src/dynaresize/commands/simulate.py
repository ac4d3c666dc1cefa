"""`dynaresize simulate`: run policies on a modelled workload or a trace at cluster scale.

Writes DIR/summary.json, DIR/<policy>/records.jsonl per policy and DIR/allocation.png,
DIR/throughput.png; prints a comparison table. See docs/simulator.md.

A LoRA job (`--lora-rank R`, like `train.lora` of a run): the same policies also run on the same
job training every weight, and the summary's `lora` block and the table set the two side by
side: a move's state bytes and critical path, a step's weight sync, the memory floor and each
policy's samples/s (docs/lora-costs.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dynaresize.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dynaresize.costmodel.costs import HARDWARE_PRESETS, MODEL_PRESETS
    from dynaresize.sim.shell import DEFAULT_POLICIES, STREAM_DEFAULT_POLICIES
    from dynaresize.workload.lengths import WORKLOADS

    p = sub.add_parser("simulate", help="simulate policies on a workload or trace at cluster scale",
                       description="Run the controller and policies on a modelled workload (or a trace) "
                                   "of a pipelined RL job (one-step-off, or streaming with --staleness >= 2) "
                                   "and compare them.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="a named workload model")
    src.add_argument("--trace", metavar="FILE", help="a JSONL trace: one line per step with response_tokens")
    p.add_argument("--devices", type=int, default=64, help="devices in the cluster (default 64)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps to simulate (default 300; for a trace, its number of steps)")
    p.add_argument("--horizon-steps", type=int, default=None, metavar="N",
                   help="a named workload's time constants (drift, cap raise) span N steps instead of its own "
                        "(300 for the calibrated ones); like rollout.length_horizon_steps on real runs")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="7b", help="model preset (default 7b)")
    p.add_argument("--accelerator", choices=sorted(HARDWARE_PRESETS), default="h100",
                   help="the accelerator every device is (default h100)")
    p.add_argument("--prompts-per-step", type=int, default=None, metavar="P",
                   help="a named workload's batch in prompts of 16 samples (default: the workload's own, e.g. "
                        "dapo-qwen3-8b's 32, else 2 per device)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)}; with --staleness >= 2 "
                        f"{','.join(STREAM_DEFAULT_POLICIES)}; also static:R, scripted)")
    p.add_argument("--staleness", type=int, default=1, metavar="ETA",
                   help="pipeline staleness: samples of step k use weights of version max(0, k - ETA); "
                        "1 = one-step-off (default), >= 2 = streaming (see docs/pipeline.md)")
    p.add_argument("--partial", action="store_true",
                   help="partial rollout (streaming only): a running request continues under newer weights")
    p.add_argument("--no-accumulate", dest="accumulate", action="store_false",
                   help="streaming only: train a step once all its samples are in (default: the trainers "
                        "accumulate gradients over its prompt groups as they arrive, as the runtime does)")
    p.add_argument("--no-admit", dest="admit", action="store_false",
                   help="streaming only: a replica takes its next share only when its current one has ended "
                        "(default: it admits the next share of the same weight version while the last requests "
                        "of its current one decode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-sync", choices=("full", "delta"), default="full",
                   help="what a step's weight sync sends: the whole weights (default) or the changed values "
                        "(rollout.weight_sync; a joining engine still gets them whole: docs/sync.md)")
    p.add_argument("--changed-fraction", type=float, default=None, metavar="F",
                   help="delta sync: share of the weights a step changes (default 0.02, verl's 1-3%%; a run's "
                        "measured one: changed_fraction in its weight_sync records)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="simulate a LoRA job (train.lora.rank R): moves carry the adapter and its moments, a sync "
                        "sends the adapter; the same job training every weight runs beside it (default 0: full "
                        "training only)")
    p.add_argument("--lora-targets", default="all-linear", metavar="LIST",
                   help="with --lora-rank: train.lora.target_modules, comma-separated (default all-linear: every "
                        "linear layer of the blocks, as peft)")
    p.add_argument("--filter-from", metavar="RUN_DIR", default=None,
                   help="a workload with dynamic sampling (dapo-filter): its filtered share per step from this "
                        "dynaresize run's own groups_filtered (its records.jsonl) instead of the modelled share")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="policy.FIELD=VALUE",
                   help="override a policy setting, e.g. --set policy.enter_band=0.05 (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def policy_config(overrides: list[str]):
    from dynaresize.config import PolicyConfig
    from dynaresize.config_load import apply_overrides, build_config

    data = apply_overrides({}, overrides)
    bad = [k for k in data if k != "policy"]
    if bad:
        raise ConfigError([f"--set {k}...: simulate takes only policy.* settings" for k in bad])
    return build_config(data.get("policy", {}), PolicyConfig) if data else PolicyConfig()


def _filter_source(args: argparse.Namespace, scenario) -> tuple[Any, dict]:
    """The scenario with the run's own filtered share (`--filter-from`), or as it is, and the
    summary's `filter_share_source` (a workload with dynamic sampling), also printed."""
    from dataclasses import replace

    from dynaresize.workload import SAMPLES_PER_PROMPT, batch_for_step, filter_spec
    from dynaresize.workload.filter_runs import filter_shares

    spec = filter_spec(args.workload, args.horizon_steps)
    if spec is None:
        if args.filter_from:
            raise ConfigError([f"filter-from={args.filter_from}: only for a workload with dynamic sampling "
                               f"(dapo-filter), not {args.workload}"])
        return scenario, {}
    if not args.filter_from:
        why = (f"modelled [A]: {spec.filter_share0:.0%} at step 0 rising towards {spec.filter_share_end:.0%} "
               "(docs/simulator.md)")
        print(f"dynaresize: {args.workload}: filtered share {why}; --filter-from RUN_DIR takes a run's own", file=sys.stderr)
        return scenario, {"filter_share_source": why}
    run = filter_shares(args.filter_from)
    print(f"dynaresize: {args.workload}: filtered share from {run.describe()}", file=sys.stderr)
    n, horizon, seed = scenario.prompts_per_step * SAMPLES_PER_PROMPT, args.horizon_steps, args.seed

    def batch_of(b: int):  # the workload's own call, at the run's share
        return batch_for_step(args.workload, b, n, seed, samples_per_prompt=SAMPLES_PER_PROMPT,
                              horizon_steps=horizon, filter_shares=run.shares)

    return replace(scenario, batch_of=batch_of), {"filter_share_source": run.describe(),
                                                  "filter_shares": list(run.shares)}


def _lora_args(args: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    targets = tuple(t.strip() for t in str(args.lora_targets).split(",") if t.strip())
    if args.lora_rank < 0:
        raise ConfigError([f"lora-rank={args.lora_rank}: must be >= 1 (0: full training)"])
    if not args.lora_rank:
        if targets != ("all-linear",):
            raise ConfigError([f"lora-targets={args.lora_targets}: only with --lora-rank"])
        return 0, targets
    if args.weight_sync == "delta":
        raise ConfigError(["weight-sync=delta: a LoRA job's weight sync sends the whole adapter (full)"])
    return args.lora_rank, targets


def _moves_beside(lora_doc: dict, full_doc: dict, scenario, full_model) -> dict:
    """Full training's cost of the LoRA job's move-unit resizes, at the same splits (the
    full job's floor allowing), else at its own pilot split's (its `resize_cost_model`)."""
    from dynaresize.sim.resize import canonical_timing

    out = dict(full_doc["resize_cost_model"])
    floor = full_doc["bounds"]["min_train"]
    for key in ("train_to_rollout", "rollout_to_train"):
        m = lora_doc["resize_cost_model"].get(key)
        if m and scenario.num_devices - max(m["from_rollout"], m["to_rollout"]) >= floor:
            t = canonical_timing(full_model, scenario.num_devices, m["from_rollout"], m["to_rollout"], scenario.hardware)
            out[key] = {"from_rollout": m["from_rollout"], "to_rollout": m["to_rollout"], "critical_s": t.critical_s,
                        "total_s": t.total_s, "bytes": t.bytes_moved}
    return out


def lora_block(lora_doc: dict, full_doc: dict, scenario, full_model) -> dict:
    """The summary's `lora` block: the LoRA job's cost terms beside full training's (a move at
    the same splits), and each policy's samples/s in both (the two simulations' summaries)."""
    from dynaresize.costmodel import costs
    from dynaresize.costmodel import lora as lora_math

    lora_model = scenario.model
    full = {r["policy"]: r for r in full_doc["results"]}
    return {
        "rank": lora_model.lora_rank, "target_modules": list(lora_model.lora_targets),
        "adapter_params": lora_model.adapter_params, "num_params": lora_model.num_params,
        "move_state_bytes": lora_math.move_bytes(lora_model.adapter_params),
        "full_move_state_bytes": lora_math.ADAPTER_MOVE_BYTES_PER_PARAM * full_model.num_params,
        "sync_bytes": costs.sync_bytes(lora_model), "full_sync_bytes": costs.sync_bytes(full_model),
        "sync_s": costs.sync_s(lora_model), "full_sync_s": costs.sync_s(full_model),
        "min_train": lora_doc["bounds"]["min_train"], "full_min_train": full_doc["bounds"]["min_train"],
        "full_pilot_rollout": full_doc["pilot_rollout"],
        "full_resize_cost_model": _moves_beside(lora_doc, full_doc, scenario, full_model),
        "full_results": full_doc["results"],
        "samples_per_s_vs_full": {p: r["samples_per_s"] / full[p]["samples_per_s"]
                                  for p, r in ((r["policy"], r) for r in lora_doc["results"])
                                  if p in full and full[p]["samples_per_s"] > 0},
    }


def format_lora(doc: dict) -> str:
    """The lines `simulate` prints for a LoRA job, below its table."""
    b = doc["lora"]
    gb = 1e9
    lines = [f"LoRA rank {b['rank']} on {','.join(b['target_modules'])}: {b['adapter_params'] / 1e6:.2f}M adapter "
             f"parameters ({b['adapter_params'] / b['num_params']:.2%} of {b['num_params'] / 1e9:.2f}B); beside it the "
             "same job training every weight (LoRA vs full):",
             f"  trainer state a reshard moves (fp32 parameters + two moments, every shard): {b['move_state_bytes'] / gb:.3f} GB vs "
             f"{b['full_move_state_bytes'] / gb:.1f} GB",
             f"  weight sync per step: {b['sync_bytes'] / gb:.3f} GB, {b['sync_s']:.2f} s vs "
             f"{b['full_sync_bytes'] / gb:.2f} GB, {b['full_sync_s']:.2f} s; memory floor {b['min_train']} vs "
             f"{b['full_min_train']} training devices"]
    mine, full = doc["resize_cost_model"], b["full_resize_cost_model"]
    for key in ("train_to_rollout", "rollout_to_train", "naive"):
        if key in mine and key in full:
            at = (f" {mine[key]['from_rollout']}->{mine[key]['to_rollout']} vs {full[key]['from_rollout']}->"
                  f"{full[key]['to_rollout']} rollout devices" if "from_rollout" in mine[key] else "")
            lines.append(f"  {key.replace('_', ' ')}{at}: critical {mine[key]['critical_s']:.3f} s vs "
                         f"{full[key]['critical_s']:.3f} s, {mine[key]['bytes'] / gb:.4g} GB vs {full[key]['bytes'] / gb:.4g} GB")
    by_full = {r["policy"]: r["samples_per_s"] for r in b["full_results"]}
    lines.append("  samples/s: " + ", ".join(f"{r['policy']} {r['samples_per_s']:.2f} vs {by_full[r['policy']]:.2f} "
                                             f"({b['samples_per_s_vs_full'][r['policy']]:.3f}x)"
                                             for r in doc["results"] if r["policy"] in b["samples_per_s_vs_full"]))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from dynaresize.costmodel.scenarios import trace_scenario, workload_scenario
    from dynaresize.report.sim_figures import write_sim_figures
    from dynaresize.sim.shell import check_pipeline, default_policies, format_table, simulate
    from dynaresize.workload.trace import load_trace

    cfg = policy_config(args.overrides)
    check_pipeline(args.staleness, args.partial, args.accumulate, args.admit)
    spec = args.policies if args.policies is not None else ",".join(default_policies(args.staleness))
    policies = [p.strip() for p in spec.split(",") if p.strip()]
    if not policies:
        raise ConfigError(["policies='': name at least one policy"])
    if args.steps is not None and args.steps < 1:
        raise ConfigError([f"steps={args.steps}: needs at least 1 step"])
    if args.horizon_steps is not None and (args.horizon_steps < 1 or args.trace):
        raise ConfigError([f"horizon-steps={args.horizon_steps}: " + ("only a named workload has a horizon"
                                                                      if args.trace else "must be >= 1")])
    if args.trace and args.filter_from:
        raise ConfigError([f"filter-from={args.filter_from}: a trace's batches are its own (only with --workload)"])
    notes: dict = {}
    lora_rank, lora_targets = _lora_args(args)
    job = {"lora_rank": lora_rank, "lora_targets": lora_targets}
    if args.trace:
        batches = load_trace(args.trace)
        if args.prompts_per_step is not None:
            raise ConfigError([f"prompts-per-step={args.prompts_per_step}: a trace's batch is its own"])
        scenario = trace_scenario(batches, args.trace, num_devices=args.devices, num_steps=args.steps,
                                  model=args.model, seed=args.seed, accelerator=args.accelerator,
                                  weight_sync=args.weight_sync, changed_fraction=args.changed_fraction, **job)
        if args.steps is not None and args.steps > len(batches):
            print(f"dynaresize: note: the trace has {len(batches)} steps; simulating {len(batches)}", file=sys.stderr)
    else:
        if args.prompts_per_step is not None and args.prompts_per_step < 1:
            raise ConfigError([f"prompts-per-step={args.prompts_per_step}: must be >= 1"])
        from dynaresize.workload.lengths import WORKLOADS

        if WORKLOADS[args.workload].filter_share_end and args.staleness >= 2:
            raise ConfigError([f"staleness={args.staleness}: the {args.workload} workload's dynamic sampling is "
                               "modelled for the one-step-off pipeline only (--staleness 0 or 1)"])
        scenario = workload_scenario(args.workload, num_devices=args.devices, num_steps=args.steps or 300,
                                     model=args.model, seed=args.seed, horizon_steps=args.horizon_steps,
                                     prompts_per_step=args.prompts_per_step, accelerator=args.accelerator,
                                     weight_sync=args.weight_sync, changed_fraction=args.changed_fraction, **job)
        scenario, notes = _filter_source(args, scenario)
    progress = not args.quiet and sys.stderr.isatty()
    if lora_rank:  # the same job training every weight, beside it (no records of its own)
        from dataclasses import replace

        from dynaresize.costmodel.costs import with_lora

        full_model = with_lora(scenario.model, 0)
        try:
            full_doc = simulate(replace(scenario, model=full_model), policies, cfg, staleness=args.staleness,
                                partial=args.partial, accumulate=args.accumulate, admit=args.admit)
        except ConfigError as exc:  # e.g. a static split below the full job's memory floor
            raise ConfigError([f"the full-training job beside the LoRA one: {e}" for e in exc.errors]) from None
    doc = simulate(scenario, policies, cfg, staleness=args.staleness, partial=args.partial,
                   accumulate=args.accumulate, admit=args.admit, out_dir=args.out,
                   progress=progress, figures=None if args.no_plots else write_sim_figures, notes=notes)
    if lora_rank:
        import json
        from pathlib import Path

        doc["lora"] = lora_block(doc, full_doc, scenario, full_model)
        (Path(args.out) / "summary.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "plots"},
                                                                indent=2) + "\n")
    print(format_table(doc))
    if lora_rank:
        print(format_lora(doc))
    print(f"wrote {args.out}/summary.json, one records.jsonl per policy"
          + ("" if args.no_plots else ", allocation.png, throughput.png"))
    return 0
