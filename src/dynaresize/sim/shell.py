"""The simulator's imperative shell: build each policy, run it through the engine, write records,
`summary.json` and plots.

The pipeline is `staleness` steps off policy: 1 is the one-step-off pipeline of `sim.engine`,
>= 2 the streaming pipeline of `sim.stream` (optionally with partial rollout).

Every policy starts from the pilot split (`oracle.pilot_split`, or `oracle.stream_pilot_split`
when streaming) except `static:R` (at R), `scripted` (its step-0 entry, or the pilot split),
`best-static` (its sweep's split) and `oracle` (its plan's first split). `best-static` and
`oracle` run as planned policies through the same controller and engine, so they pay exactly
the costs every other policy pays. `oracle` and `lend` exist for the one-step-off pipeline only.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.costs import naive_resize_cost
from dynaresize.costmodel.scenarios import Scenario
from dynaresize.errors import ConfigError
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.records import Recorder, safe_name
from dynaresize.sim.engine import PolicyResult, run_policy
from dynaresize.sim.oracle import (best_static, build_table, grid, oracle_plan, pilot_split, stream_best_static,
                                   stream_pilot_split)
from dynaresize.sim.resize import canonical_timing
from dynaresize.sim.stream import run_stream

DEFAULT_POLICIES = ("static-profiled", "best-static", "hysteresis", "greedy", "lend", "oracle")
STREAM_DEFAULT_POLICIES = ("static-profiled", "best-static", "hysteresis", "greedy")
KNOWN = ("hysteresis", "static-profiled", "best-static", "greedy", "lend", "oracle", "scripted", "static")
ONE_STEP_OFF_ONLY = ("lend", "oracle")
STREAM_BATCH_SAMPLES = 4_000_000  # samples' worth of batch arrays a streaming run keeps (~100 MB)


def default_policies(staleness: int = 1) -> tuple[str, ...]:
    return DEFAULT_POLICIES if staleness <= 1 else STREAM_DEFAULT_POLICIES


def check_policy_names(names: list[str], staleness: int = 1) -> None:
    bad = [n for n in names if n not in KNOWN and not re.fullmatch(r"static:\d+", n)]
    if bad:
        raise ConfigError([f"policies={','.join(bad)}: unknown (known: {', '.join(KNOWN)}, static:R)"])
    if len(set(names)) != len(names):
        raise ConfigError([f"policies={','.join(names)}: a policy is listed twice"])
    if staleness >= 2:
        only = [n for n in names if n in ONE_STEP_OFF_ONLY]
        if only:
            raise ConfigError([f"policies={','.join(only)}: one-step-off pipeline only (staleness 1); with "
                               f"staleness {staleness} a step's rollout overlaps others, so lending inside a step "
                               "and the oracle's per-step program do not apply"])


def check_pipeline(staleness: int, partial: bool, accumulate: bool = True, admit: bool = True) -> None:
    errors = []
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
        errors.append(f"staleness={staleness!r}: must be an integer >= 1 (1 = one-step-off)")
    elif partial and staleness < 2:
        errors.append("partial=True: partial rollout needs staleness >= 2 (in the one-step-off pipeline no newer "
                      "weights arrive while a request runs)")
    elif staleness < 2 and not (accumulate and admit):
        off = [name for name, on in (("accumulate", accumulate), ("admit", admit)) if not on]
        errors.append(f"{'/'.join(off)}=False: streaming-pipeline switches (staleness >= 2); the one-step-off "
                      "pipeline trains a step whose samples are all in and runs one batch per replica")
    elif partial and not admit:
        errors.append("admit=False with partial=True: partial rollout admits the next share under any version, "
                      "so it includes same-version admission")
    if errors:
        raise ConfigError(errors)


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
             staleness: int = 1, partial: bool = False, accumulate: bool = True, admit: bool = True,
             out_dir: str | Path | None = None, progress: bool = False,
             figures: Callable[[dict, dict, Path], list] | None = None,
             on_progress: Callable[[int], None] | None = None, notes: dict | None = None) -> dict:
    """Run every policy on the scenario; returns the summary (also written to out_dir).
    `accumulate` and `admit` switch the streaming pipeline's two overlaps (`sim.stream`);
    `notes` are further summary fields (e.g. where a workload's filtered share came from)."""
    check_pipeline(staleness, partial, accumulate, admit)
    pipe = {"staleness": staleness, "partial": partial}
    if staleness >= 2:
        pipe |= {"accumulate": accumulate, "admit": admit}
    check_policy_names(policies, staleness)
    stream = staleness >= 2
    K, N = scenario.num_steps, scenario.num_devices
    cache = max(4, min(K, STREAM_BATCH_SAMPLES // max(scenario.samples_per_step, 1))) if stream else 4
    stages = scenario.stages(batch_cache=cache)
    bounds = scenario.bounds(cfg)
    if stream:
        pilot = stream_pilot_split(stages, bounds, K, cfg.profile_steps)
    else:
        pilot = pilot_split(stages, bounds, K, cfg.profile_steps)
    need_table = any(p in ("best-static", "oracle") for p in policies)
    splits = grid(bounds, include=(pilot,))
    total_work = K * len(policies) + ((len(splits) if stream else K) if need_table else 0)
    bar = _progress(total_work, progress)
    tick = (lambda _k: (bar.update(1) if bar else None, on_progress(1) if on_progress else None))
    table = sweep = None
    reference = None
    if need_table and stream:
        sweep = stream_best_static(scenario, stages, bounds, splits, staleness, partial, on_run=tick,
                                   accumulate=accumulate, admit=admit)
        r1, total1 = best_static(build_table(stages, splits, N, K))  # the one-step-off pipeline's
        reference = {"rollout_devices": r1, "total_time_s": total1,
                     "samples_per_s": scenario.total_samples() / total1 if total1 > 0 else 0.0}
    elif need_table:
        table = build_table(stages, splits, N, K, on_step=tick)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    runs: dict[str, PolicyResult] = {}
    for name in policies:
        policy, start, extra = _build(name, cfg, bounds, scenario, stages, pilot, table, sweep, staleness)
        path = out / safe_name(name) / "records.jsonl" if out is not None else None
        if path is not None and path.exists():
            path.unlink()
        with Recorder(path) as rec:
            rec.emit("config", config={"policy": name, "workload": scenario.name, "devices": N, "steps": K,
                                       "model": scenario.model.name, "seed": scenario.seed, "start_rollout": start,
                                       "bounds": {"min_rollout": bounds.min_rollout, "min_train": bounds.min_train,
                                                  "move_unit": bounds.move_unit},
                                       **pipe, "policy_config": cfg.__dict__ | {"name": name}})
            if stream:
                res = run_stream(scenario, stages, policy, bounds, start_rollout=start, staleness=staleness,
                                 partial=partial, accumulate=accumulate, admit=admit,
                                 reversal_window=cfg.horizon_steps, recorder=rec, on_step=tick)
            else:
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
           "resize_cost_model": resize_cost_table(scenario, bounds, pilot), **pipe,
           "static_sweep": _static_sweep(table, sweep, scenario), "results": results, **(notes or {})}
    if reference is not None:
        doc["best_static_staleness_1"] = reference  # same workload and devices, one-step-off
    if out is not None:
        (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
        if figures is not None:  # e.g. report.sim_figures.write_sim_figures (the command picks it)
            doc["plots"] = [str(p) for p in figures(runs, doc, out)]
    return doc


def _static_sweep(table, sweep, scenario: Scenario) -> list[dict] | None:
    """samples/s of every fixed split the best-static sweep tried (None when it did not run)."""
    n = scenario.total_samples()
    if sweep is not None:
        totals, bound = sweep[2], sweep[3]
        return [{"rollout_devices": r, "total_time_s": totals.get(r), "lower_bound_s": bound[r],
                 "samples_per_s": n / totals[r] if r in totals and totals[r] > 0 else None}
                for r in sorted(bound)]
    if table is not None:
        totals = dict(zip(table.splits, table.static_total().tolist()))
        return [{"rollout_devices": r, "total_time_s": t, "samples_per_s": n / t if t > 0 else 0.0}
                for r, t in sorted(totals.items())]
    return None


def _build(name: str, cfg: PolicyConfig, bounds, scenario: Scenario, stages, pilot: int, table, sweep=None,
           staleness: int = 1):
    K, N = scenario.num_steps, scenario.num_devices
    if name == "best-static":
        r, total = (sweep[0], sweep[1]) if sweep is not None else best_static(table)
        return Planned("best-static", [r] * K), r, {"rollout_devices": r, "predicted_total_s": total}
    if name == "oracle":
        path, total = oracle_plan(table, stages, N)
        return Planned("oracle", path), path[0], {"predicted_total_s": total}
    starts_at_pilot = name in ("hysteresis", "static-profiled", "greedy", "lend")
    policy = make_policy(replace(cfg, name=name), bounds, num_steps=K, simulator=True,
                         pilot_rollout=pilot if starts_at_pilot else None, staleness=staleness)
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
    eta = doc.get("staleness", 1)
    pipe = ("one-step-off pipeline (staleness 1)" if eta <= 1 else
            f"streaming pipeline, staleness {eta}" + (", partial rollout" if doc.get("partial") else ""))
    lines = [f"workload {doc['workload']}, {doc['devices']} devices, {doc['steps']} steps, model {doc['model']}, "
             f"seed {doc['seed']}, pilot split {doc['pilot_rollout']} rollout devices; {pipe}", head, "-" * len(head)]
    for r in results:
        rel = f"{r['samples_per_s'] / base:.3f}x" if base else "-"
        lines.append(f"{r['policy']:<18}{r['samples_per_s']:>11.2f}{rel:>9}{r['total_time_s'] / 3600:>9.2f}"
                     f"{r['idle_fraction']:>7.1%}{r['tail_idle_fraction']:>7.1%}{r['resizes']:>9}{r['reversals']:>5}"
                     f"{r['rollout_devices_final']:>7}")
    ref = doc.get("best_static_staleness_1")
    if ref:
        lines.append(f"best-static of the one-step-off pipeline (staleness 1): {ref['samples_per_s']:.2f} samples/s at "
                     f"{ref['rollout_devices']} rollout devices; "
                     + ", ".join(f"{r['policy']} {r['samples_per_s'] / ref['samples_per_s']:.3f}x" for r in results))
    cost = doc.get("resize_cost_model", {})
    parts = [f"{k} critical {v['critical_s']:.2f}s total {v['total_s']:.2f}s" for k, v in cost.items()]
    if parts:
        lines.append("resize cost (one move unit): " + "; ".join(parts))
    return "\n".join(lines)
