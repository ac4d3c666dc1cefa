"""`dynaresize compare`: the same job per policy on the real runtime and in the simulator.

    dynaresize compare --policies static-profiled,hysteresis --devices 16 --emulate h100:7b \\
        --set rollout.length_workload=longtail-drift --steps 40 --out compare-out

For each policy it runs the job (the run flags of `dynaresize run`, the policy replaced) on the
real runtime with emulated accelerators, then the simulator on the same job: the same batches
(`rollout.length_workload` at the workload's reference lengths), devices, bounds, accelerator
and model cost model (`emulate.predict`), started at the same split. It writes

    OUT/<policy>/            the run directory (records.jsonl, summary.json, ...)
    OUT/<policy>/sim.jsonl   the simulator's records of the same job
    OUT/summary.json         per policy: measured total_time_s, samples_per_s, idle_fraction,
                             resizes, overhead_s, overrun_steps, ledger_ok; the simulator's
                             predicted_total_s, predicted_samples_per_s, predicted_resizes; and
                             prediction_error = predicted_total_s / total_time_s - 1
    OUT/split.png            the split over time per policy, measured beside predicted

and prints a table. Measured times are emulated seconds of the steps (startup left out), so
they are the quantity the simulator predicts; the runtime's overhead (`overhead_s`) explains
most of the gap. Needs `--emulate`: without an emulated accelerator the runtime's times are
this machine's, which the simulator does not model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dynaresize.commands.run import add_emulation_flags
    from dynaresize.presets import PRESETS

    p = sub.add_parser("compare", help="run policies on the emulated runtime and in the simulator, side by side",
                       description="Run the same job once per policy on the real runtime (emulated accelerators) "
                       "and once in the simulator, and compare measured with predicted times.")
    p.add_argument("--policies", required=True,
                   help="comma-separated runtime policies, e.g. static-profiled,hysteresis")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS),
                   help="starting config (default: demo, the emulated demo job)")
    p.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override one field, e.g. --set rollout.length_workload=longtail-drift (repeatable)")
    p.add_argument("--devices", type=int, help="number of devices (cluster.devices)")
    p.add_argument("--steps", type=int, help="number of RL steps")
    p.add_argument("--rollout-devices", type=int, help="initial rollout pool size (cluster.rollout_devices)")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    add_emulation_flags(p)
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="output directory (default: runs/compare)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main, policy=None, schedule=None, deterministic=None, faults=[])


def job_configs(args: argparse.Namespace) -> dict:
    """{policy: RunConfig} of the job, one per policy (ConfigError when a policy or flag is bad)."""
    from dynaresize.commands.run import resolve_config
    from dynaresize.config_load import build_config, config_to_dict
    from dynaresize.errors import ConfigError

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError(["policies='': name at least one policy"])
    if len(set(policies)) != len(policies):
        raise ConfigError([f"policies={args.policies!r}: a policy is listed twice"])
    base = resolve_config(args)
    if not base.cluster.emulate:
        raise ConfigError(["cluster.emulate=None: compare needs an emulated accelerator (--emulate ACCEL:MODEL): "
                           "the simulator predicts an accelerator's times, not this machine's"])
    out = {}
    for name in policies:
        data = config_to_dict(base)
        data["policy"]["name"] = name
        out[name] = build_config(data)
    from dynaresize.emulate.model import run_bounds
    from dynaresize.policy.base import make_policy

    for cfg in out.values():  # a simulator-only policy (lend, oracle) is refused before anything runs
        make_policy(cfg.policy, run_bounds(cfg), num_steps=cfg.steps)
    return out


def main(args: argparse.Namespace) -> int:
    from dynaresize.config_load import config_to_dict
    from dynaresize.driver.run import run_job
    from dynaresize.emulate.predict import predict
    from dynaresize.records import Recorder, read_records, safe_name

    configs = job_configs(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(configs.values()))
    started_ray = _start_ray(first)
    results: list[dict] = []
    timelines: dict[str, dict] = {}
    try:
        for name, cfg in configs.items():
            run_dir = out / safe_name(name)
            print(f"compare: {name}: running the job on the runtime ({run_dir})", file=sys.stderr, flush=True)
            summary = run_job(cfg, run_dir, progress=not args.no_progress)
            steps = sorted(read_records(run_dir / "records.jsonl", "step"), key=lambda r: r["step"])
            with Recorder(run_dir / "sim.jsonl") as rec:
                rec.emit("config", config=config_to_dict(cfg))
                pred = predict(cfg, recorder=rec)
                rec.emit("summary", summary=pred.summary())
            results.append(_row(name, summary, pred))
            origin = steps[0]["t_start_s"] if steps else 0.0  # step 0 holds the prologue in both
            timelines[name] = {"measured": [(s["t_start_s"] - origin, s["t_end_s"] - origin, s["num_rollout"])
                                            for s in steps],
                               "predicted": [(0.0 if k == 0 else t0, t1, r) for k, t0, t1, r in pred.timeline]}
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    doc = {"emulate": first.cluster.emulate, "time_scale": results[0]["time_scale"] if results else None,
           "workload": first.rollout.length_workload, "length_horizon_steps": first.rollout.length_horizon_steps,
           "devices": first.cluster.devices, "steps": first.steps,
           "samples_per_step": first.rollout.prompts_per_step * first.rollout.samples_per_prompt,
           "seed": first.seed, "time_unit": "emulated seconds of the steps (startup left out)", "results": results}
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    doc["plot"] = str(write_split_plot(timelines, doc, out / "split.png"))
    print(format_table(doc))
    print(f"wrote {out}/summary.json, {doc['plot']}, one run directory per policy")
    return 0 if all(r["ledger_ok"] for r in results) else 1


def _start_ray(cfg) -> bool:
    """One local Ray for every run of the comparison (each run's cluster joins it)."""
    import math

    import ray

    if ray.is_initialized():
        return False
    kwargs: dict = {"include_dashboard": False, "log_to_driver": True}
    if cfg.cluster.address:
        kwargs["address"] = cfg.cluster.address
    else:
        kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(cfg.cluster.devices * cfg.cluster.cpus_per_device))
    ray.init(**kwargs)
    return True


def _row(name: str, summary: dict, pred) -> dict:
    """One policy's line: the run's and the simulator's numbers, both assembled by metrics.py."""
    total = summary["total_time_s"]
    p = pred.summary()
    return {
        "policy": name, "total_time_s": total, "samples_per_s": summary["samples_per_s"],
        "idle_fraction": summary["idle_fraction"], "tail_idle_fraction": summary["tail_idle_fraction"],
        "resizes": summary["resizes"],
        "resizes_to_rollout": summary["resizes_to_rollout"], "resizes_to_train": summary["resizes_to_train"],
        "rollout_devices_final": summary["rollout_devices_final"], "overhead_s": summary["overhead_s"],
        "overhead_fraction": summary["overhead_fraction"], "overrun_steps": summary["overrun_steps"],
        "ledger_ok": summary["ledger_ok"], "wall_time_s": summary["wall_time_s"], "time_scale": summary["time_scale"],
        "predicted_total_s": p["total_time_s"], "predicted_samples_per_s": p["samples_per_s"],
        "predicted_idle_fraction": p["idle_fraction"], "predicted_resizes": p["resizes"],
        "predicted_rollout_devices_final": p["rollout_devices_final"],
        "prediction_error": p["total_time_s"] / total - 1.0 if total > 0 else None,
    }


def format_table(doc: dict) -> str:
    rows = doc["results"]
    base = rows[0]["samples_per_s"] if rows else None
    base_p = rows[0]["predicted_samples_per_s"] if rows else None
    head = (f"{'policy':<18}{'samples/s':>10}{'vs first':>9}{'predicted':>10}{'vs first':>9}{'error':>8}"
            f"{'idle':>7}{'resizes':>8}{'pred.':>6}{'overhead':>9}{'overrun':>8}{'ledger':>7}")
    horizon = f" over {doc['length_horizon_steps']} steps" if doc.get("length_horizon_steps") else ""
    lines = [f"{doc['emulate']} emulated ({doc['time_unit']}), workload {doc['workload']}{horizon}, {doc['devices']} devices, "
             f"{doc['steps']} steps, {doc['samples_per_step']} samples/step, seed {doc['seed']}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<18}{r['samples_per_s']:>10.3f}{r['samples_per_s'] / base:>8.3f}x"
                     f"{r['predicted_samples_per_s']:>10.3f}{r['predicted_samples_per_s'] / base_p:>8.3f}x"
                     f"{r['prediction_error']:>+8.1%}{r['idle_fraction']:>7.1%}{r['resizes']:>8}"
                     f"{r['predicted_resizes']:>6}"
                     f"{r['overhead_fraction']:>9.1%}{r['overrun_steps']:>8}{'ok' if r['ledger_ok'] else 'FAIL':>7}")
    lines.append("error = predicted total time / measured - 1; overhead = share of the measured time the driver, "
                 "controller and Ray added beyond the paced work")
    return "\n".join(lines)


def write_split_plot(timelines: dict, doc: dict, path: Path) -> Path:
    """Rollout devices over (emulated) time per policy: measured beside predicted."""
    from dynaresize.report.mpl import pyplot, save_figure

    plt = pyplot()
    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.9 * len(names) + 0.9), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for key, color, style in (("measured", "#4C72B0", "-"), ("predicted", "#DD8452", "--")):
            tl = timelines[name][key]
            if not tl:
                continue
            t = [row[0] / 3600 for row in tl] + [tl[-1][1] / 3600]
            r = [row[2] for row in tl]
            ax.step(t, r + [r[-1]], where="post", color=color, ls=style, lw=1.5, label=key)
        row = next(r for r in doc["results"] if r["policy"] == name)
        ax.set_title(f"{name}: measured {row['resizes']} resizes, predicted {row['predicted_resizes']}; "
                     f"prediction error {row['prediction_error']:+.1%}", fontsize=9, loc="left")
        ax.set_ylabel("rollout\ndevices", fontsize=8)
        ax.set_ylim(0, doc["devices"])
        ax.legend(fontsize=7, loc="lower right")
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("emulated time (h)")
    fig.suptitle(f"Split over time, runtime vs simulator: {doc['emulate']}, {doc['workload']}, "
                 f"{doc['devices']} devices, {doc['steps']} steps", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
