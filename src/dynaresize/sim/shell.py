"""The simulator's imperative shell: build each policy, run it through the engine, write records,
`summary.json` and plots.

Every policy starts from the pilot split (`oracle.pilot_split`) except `static:R` (at R),
`scripted` (its step-0 entry, or the pilot split), `best-static` (its sweep's split) and
`oracle` (its plan's first split). `best-static` and `oracle` run as planned policies through
the same controller and engine, so they pay exactly the costs every other policy pays.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from dynaresize.config import PolicyConfig
from dynaresize.errors import ConfigError
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.records import Recorder
from dynaresize.sim.costs import naive_resize_cost
from dynaresize.sim.engine import PolicyResult, run_policy
from dynaresize.sim.oracle import best_static, build_table, grid, oracle_plan, pilot_split
from dynaresize.sim.resize import canonical_timing
from dynaresize.sim.scenarios import Scenario

DEFAULT_POLICIES = ("static-profiled", "best-static", "hysteresis", "greedy", "lend", "oracle")
KNOWN = ("hysteresis", "static-profiled", "best-static", "greedy", "lend", "oracle", "scripted", "static")


def check_policy_names(names: list[str]) -> None:
    bad = [n for n in names if n not in KNOWN and not re.fullmatch(r"static:\d+", n)]
    if bad:
        raise ConfigError([f"policies={','.join(bad)}: unknown (known: {', '.join(KNOWN)}, static:R)"])
    if len(set(names)) != len(names):
        raise ConfigError([f"policies={','.join(names)}: a policy is listed twice"])


def safe_name(policy: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", policy)


def resize_cost_table(scenario: Scenario, bounds, pilot: int) -> dict:
    """Predicted critical and total seconds of one move-unit resize each way next to the pilot
    split, for the optimized op graph and for the naive path (tear down, new world, reload)."""
    unit, N, m = bounds.move_unit, scenario.num_devices, scenario.model
    out: dict = {}
    for key, step in (("train_to_rollout", unit), ("rollout_to_train", -unit)):
        a = pilot if bounds.allowed(pilot + step) else pilot - step
        if bounds.allowed(a) and bounds.allowed(a + step):
            t = canonical_timing(m, N, a, a + step, scenario.hardware)
            out[key] = {"from_rollout": a, "to_rollout": a + step, "critical_s": t.critical_s, "total_s": t.total_s,
                        "bytes": t.bytes_moved}
    naive = naive_resize_cost(m, N, scenario.hardware)
    out["naive"] = {"critical_s": naive.critical_s, "total_s": naive.total_s, "bytes": naive.bytes_moved}
    return out


def simulate(scenario: Scenario, policies: list[str], cfg: PolicyConfig = PolicyConfig(), *,
             out_dir: str | Path | None = None, progress: bool = False, write_plots: bool = True,
             on_progress: Callable[[int], None] | None = None) -> dict:
    """Run every policy on the scenario; returns the summary (also written to out_dir)."""
    check_policy_names(policies)
    stages = scenario.stages()
    bounds = scenario.bounds(cfg)
    K, N = scenario.num_steps, scenario.num_devices
    pilot = pilot_split(stages, bounds, K, cfg.profile_steps)
    need_table = any(p in ("best-static", "oracle") for p in policies)
    splits = grid(bounds, include=(pilot,))
    total_work = K * len(policies) + (K if need_table else 0)
    bar = _progress(total_work, progress)
    tick = (lambda _k: (bar.update(1) if bar else None, on_progress(1) if on_progress else None))
    table = build_table(stages, splits, N, K, on_step=tick) if need_table else None
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    runs: dict[str, PolicyResult] = {}
    for name in policies:
        policy, start, extra = _build(name, cfg, bounds, scenario, stages, pilot, table)
        path = out / safe_name(name) / "records.jsonl" if out is not None else None
        if path is not None and path.exists():
            path.unlink()
        with Recorder(path) as rec:
            rec.emit("config", config={"policy": name, "workload": scenario.name, "devices": N, "steps": K,
                                       "model": scenario.model.name, "seed": scenario.seed, "start_rollout": start,
                                       "bounds": {"min_rollout": bounds.min_rollout, "min_train": bounds.min_train,
                                                  "move_unit": bounds.move_unit},
                                       "policy_config": cfg.__dict__ | {"name": name}})
            res = run_policy(scenario, stages, policy, bounds, start_rollout=start,
                             reversal_window=cfg.horizon_steps, recorder=rec, on_step=tick)
            summary = res.summary() | extra
            rec.emit("summary", summary=summary)
        runs[name] = res
        results.append(summary)
    if bar is not None:
        bar.close()
    doc = {"workload": scenario.name, "devices": N, "steps": K, "model": scenario.model.name,
           "seed": scenario.seed, "samples_per_step": scenario.samples_per_step, "pilot_rollout": pilot,
           "bounds": {"min_rollout": bounds.min_rollout, "min_train": bounds.min_train, "move_unit": bounds.move_unit},
           "grid": len(splits) < len(bounds.splits()), "reversal_window_steps": cfg.horizon_steps,
           "resize_cost_model": resize_cost_table(scenario, bounds, pilot), "results": results}
    if out is not None:
        (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
        if write_plots:
            from dynaresize.report.sim_figures import write_sim_figures

            doc["plots"] = [str(p) for p in write_sim_figures(runs, doc, out)]
    return doc


def _build(name: str, cfg: PolicyConfig, bounds, scenario: Scenario, stages, pilot: int, table):
    K, N = scenario.num_steps, scenario.num_devices
    if name == "best-static":
        r, total = best_static(table)
        return Planned("best-static", [r] * K), r, {"rollout_devices": r, "predicted_total_s": total}
    if name == "oracle":
        path, total = oracle_plan(table, stages, N)
        return Planned("oracle", path), path[0], {"predicted_total_s": total}
    starts_at_pilot = name in ("hysteresis", "static-profiled", "greedy", "lend")
    policy = make_policy(replace(cfg, name=name), bounds, num_steps=K, simulator=True,
                         pilot_rollout=pilot if starts_at_pilot else None)
    start = getattr(policy, "start_rollout", None)
    if start is None:
        start = pilot
    if not bounds.allowed(start):
        raise ConfigError([f"policy {name}: start split {start} breaks the bounds ({bounds.why_not(start)})"])
    extra = {"rollout_devices": start} if name.startswith("static") else {}
    return policy, start, extra


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="simulate", unit="step", leave=False)


def format_table(doc: dict) -> str:
    """The comparison table printed by `dynaresize simulate`."""
    results = doc["results"]
    base = next((r["samples_per_s"] for r in results if r["policy"] == "static-profiled"), None)
    head = f"{'policy':<18}{'samples/s':>11}{'vs prof.':>9}{'time h':>9}{'idle':>7}{'tail':>7}{'resizes':>9}{'rev':>5}{'R end':>7}"
    lines = [f"workload {doc['workload']}, {doc['devices']} devices, {doc['steps']} steps, model {doc['model']}, "
             f"seed {doc['seed']}, pilot split {doc['pilot_rollout']} rollout devices", head, "-" * len(head)]
    for r in results:
        rel = f"{r['samples_per_s'] / base:.3f}x" if base else "-"
        lines.append(f"{r['policy']:<18}{r['samples_per_s']:>11.2f}{rel:>9}{r['total_time_s'] / 3600:>9.2f}"
                     f"{r['idle_fraction']:>7.1%}{r['tail_idle_fraction']:>7.1%}{r['resizes']:>9}{r['reversals']:>5}"
                     f"{r['rollout_devices_final']:>7}")
    cost = doc.get("resize_cost_model", {})
    parts = [f"{k} critical {v['critical_s']:.2f}s total {v['total_s']:.2f}s" for k, v in cost.items()]
    if parts:
        lines.append("resize cost (one move unit): " + "; ".join(parts))
    return "\n".join(lines)
