"""`dynaresize simulate`: run policies on a modelled workload or a trace at cluster scale.

Writes DIR/summary.json, DIR/<policy>/records.jsonl per policy and DIR/allocation.png,
DIR/throughput.png; prints a comparison table. See docs/simulator.md.
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
    if args.trace:
        batches = load_trace(args.trace)
        if args.prompts_per_step is not None:
            raise ConfigError([f"prompts-per-step={args.prompts_per_step}: a trace's batch is its own"])
        scenario = trace_scenario(batches, args.trace, num_devices=args.devices, num_steps=args.steps,
                                  model=args.model, seed=args.seed, accelerator=args.accelerator,
                                  weight_sync=args.weight_sync, changed_fraction=args.changed_fraction)
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
                                     weight_sync=args.weight_sync, changed_fraction=args.changed_fraction)
        scenario, notes = _filter_source(args, scenario)
    progress = not args.quiet and sys.stderr.isatty()
    doc = simulate(scenario, policies, cfg, staleness=args.staleness, partial=args.partial,
                   accumulate=args.accumulate, admit=args.admit, out_dir=args.out,
                   progress=progress, figures=None if args.no_plots else write_sim_figures, notes=notes)
    print(format_table(doc))
    print(f"wrote {args.out}/summary.json, one records.jsonl per policy"
          + ("" if args.no_plots else ", allocation.png, throughput.png"))
    return 0
