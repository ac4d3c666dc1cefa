"""The seed paper's experiment (DynaResize, arXiv 2607.22614) in the simulator: every figure of
docs/seed-experiment.md.

    .venv/bin/python scripts/seed_experiment.py --out runs/seed-experiment

The regime: 8 x H20 (`h20`), Qwen3-8B (`qwen3-8b`), verl's Qwen3-8B DAPO recipe batch and
lengths (`dapo-qwen3-8b`: 32 prompts x 16 samples per step, 8k cap), 300 steps, the predefined
Train:Rollout splits 6:2, 4:4, 2:6 (`policy.allowed_rollout=2,4,6`). It prints, and writes to
OUT/seed.json and OUT/seed.md:

1. the main table: each predefined static split, best-static (the best of them in hindsight),
   hysteresis free (any split the bounds allow) and on the predefined splits, and the oracle on
   the predefined splits; at staleness 1 (one-step-off) and 0 (serial), with our modelled switch
   cost and with the paper's (~3 minutes exposed: 187 s, its overlapped figure);
2. one change at a time, from the issue's setting (7b on H100, `longtail-drift`, 2 prompts per
   device, any split) to the paper's regime, and from the paper's regime to other assumptions:
   hysteresis and oracle against the best static split of the same setting.

Columns: throughput relative to the best static split (its total time / the run's), total
hours, switches, payback steps (median over switches: steps until the step-time saving over
staying at the old split, summed from the switch on, covers the switch's critical path; `never`
when some switch does not pay back within the run), the share of switch time hidden (background
seconds / all seconds of the switches' op chains).

Everything runs the product's own simulator (`sim.engine.run_policy`, `sim.oracle`) and policies
(`policy.make_policy`); the knobs this script adds are model-preset replacements (switch cost,
decode cost) stated where they are made. Takes ~40 s on one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.scenarios import Scenario, workload_scenario
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.sim.engine import run_policy
from dynaresize.sim.oracle import build_table, oracle_plan, pilot_split
from dynaresize.sim.resize import canonical_timing

PREDEFINED = (2, 4, 6)  # rollout devices of Train:Rollout 6:2, 4:4, 2:6 on 8 devices
PAPER_SWITCH_S = 187.0  # the paper's switch, overlapped (255 s -> 187 s; third-party notes [S])
PAPER = {"throughput": 1.665, "time_change": -0.33, "payback_steps": 11, "hidden_share": 0.27}  # [S]


@dataclass(frozen=True)
class Setting:
    """One simulated job: the scenario's knobs, the pipeline and the switch cost."""

    label: str
    workload: str = "dapo-qwen3-8b"
    accelerator: str = "h20"
    model: str = "qwen3-8b"
    prompts_per_step: int | None = None  # None: the workload's own (dapo-qwen3-8b: 32), else 2 per device
    predefined: bool = True
    staleness: int = 1
    switch_s: float | None = None  # None: our modelled switch; else its critical path in seconds
    decode_cost: float = 1.0  # x the modelled per-token decode time (weight, KV reads and compute)
    steps: int = 300
    devices: int = 8
    seed: int = 0

    def scenario(self) -> Scenario:
        sc = workload_scenario(self.workload, num_devices=self.devices, num_steps=self.steps, model=self.model,
                               seed=self.seed, prompts_per_step=self.prompts_per_step,
                               accelerator=self.accelerator)
        m = sc.model
        if self.decode_cost != 1.0:
            m = replace(m, decode_eff=m.decode_eff * self.decode_cost, mfu_decode=m.mfu_decode / self.decode_cost)
        if self.switch_s is not None:
            m = with_switch_critical(m, sc, self.switch_s)
        return replace(sc, model=m)


def with_switch_critical(model, sc: Scenario, critical_s: float):
    """The model with a switch whose critical path is `critical_s` both ways (a move of 2
    devices between 6:2 and 4:4): the difference goes on the engine wake (train -> rollout) and
    the engine release (rollout -> train), both critical ops of our plan. The background ops
    (optimizer shards, freeing memory, pre-warming groups) keep our costs."""
    n, hw = sc.num_devices, sc.hardware
    up = canonical_timing(model, n, 2, 4, hw).critical_s
    down = canonical_timing(model, n, 4, 2, hw).critical_s
    return replace(model, engine_wake_s=model.engine_wake_s + critical_s - up,
                   engine_release_s=model.engine_release_s + critical_s - down)


def run_setting(s: Setting, policies: tuple[str, ...]) -> dict:
    """Each policy of `policies` on the setting: static:R, best-static, hysteresis (free),
    hysteresis-predefined, oracle (on the setting's splits); returns {policy: metrics}."""
    sc = s.scenario()
    serial = s.staleness == 0
    stages = sc.stages()
    # a user who knows a switch costs minutes says so: the hysteresis prior is the switch's cost
    cfg = PolicyConfig() if s.switch_s is None else PolicyConfig(move_cost_prior_s=s.switch_s)
    free = sc.bounds(cfg)
    pre = sc.bounds(replace(cfg, allowed_rollout=PREDEFINED)) if s.predefined else free
    K, N = sc.num_steps, sc.num_devices
    table = build_table(stages, free.splits(), N, K, serial=serial)  # every split: static baselines, paybacks
    col = {r: j for j, r in enumerate(table.splits)}
    step_at = table.step_s()
    totals = table.static_total()
    best = min(pre.splits(), key=lambda r: (totals[col[r]], r))
    best_free = min(free.splits(), key=lambda r: (totals[col[r]], r))
    runs: dict[str, dict] = {}
    for name in policies:
        if name.startswith("static:"):
            r = int(name.split(":")[1])
            policy, bounds, start = Planned(name, [r] * K), pre, r
        elif name == "best-static":
            policy, bounds, start = Planned(name, [best] * K), pre, best
        elif name == "best-static-free":  # the best of every split the bounds allow, predefined or not
            policy, bounds, start = Planned(name, [best_free] * K), free, best_free
        elif name == "oracle":
            sub = build_table(stages, pre.splits(), N, K, serial=serial)
            path, _ = oracle_plan(sub, stages, N)
            policy, bounds, start = Planned(name, path), pre, path[0]
        else:  # hysteresis (free) or hysteresis-predefined
            bounds = pre if name.endswith("predefined") else free
            start = pilot_split(stages, bounds, K, cfg.profile_steps, serial=serial)
            policy = make_policy(replace(cfg, name="hysteresis"), bounds, num_steps=K, simulator=True,
                                 pilot_rollout=start, staleness=s.staleness)
            policy.name = name
        res = run_policy(sc, stages, policy, bounds, start_rollout=start, reversal_window=cfg.horizon_steps,
                         serial=serial)
        runs[name] = _metrics(res, step_at, col)
    base = totals[col[best]] if "best-static" not in runs else runs["best-static"]["total_time_s"]
    base_free = totals[col[best_free]] if "best-static-free" not in runs else runs["best-static-free"]["total_time_s"]
    for name, m in runs.items():
        m["vs_best_static"] = base / m["total_time_s"]  # the best of the setting's splits (predefined)
        m["vs_best_static_free"] = base_free / m["total_time_s"]  # the best of any split
    return {"setting": s.__dict__, "best_static_rollout": best, "best_static_free_rollout": best_free, "runs": runs,
            "switch_critical_s": _switch_s(sc), "samples_per_step": sc.samples_per_step}


def _switch_s(sc: Scenario) -> dict:
    up = canonical_timing(sc.model, sc.num_devices, 2, 4, sc.hardware)
    down = canonical_timing(sc.model, sc.num_devices, 4, 2, sc.hardware)
    return {"6:2->4:4": {"critical_s": up.critical_s, "total_s": up.total_s},
            "4:4->6:2": {"critical_s": down.critical_s, "total_s": down.total_s}}


def _metrics(res, step_at: np.ndarray, col: dict) -> dict:
    """Headline figures of one run, with the payback of each switch: steps from the switch until
    the summed saving over the old split's step times covers the switch's critical path."""
    tl = res.timeline  # (step, start, end, rollout devices)
    paybacks: list[float] = []
    for i in range(1, len(tl)):
        k, old, new = tl[i][0], tl[i - 1][3], tl[i][3]
        if old == new:
            continue
        stall = (tl[i][2] - tl[i][1]) - step_at[k, col[new]]  # the switch's exposed time in step k
        saved, m = 0.0, None
        for j in range(k, len(tl)):
            saved += step_at[j, col[old]] - step_at[j, col[new]]
            if saved >= stall:
                m = j - k + 1
                break
        paybacks.append(float("inf") if m is None else float(m))
    total = res.resize_total_s
    return {"total_time_s": res.total_time_s, "samples_per_s": res.samples_per_s, "switches": res.resizes,
            "payback_steps": statistics.median(paybacks) if paybacks else None,
            "payback_never": sum(1 for p in paybacks if p == float("inf")),
            "hidden_share": (total - res.resize_critical_s) / total if total > 0 else None,
            "idle_fraction": res.summary()["idle_fraction"],
            "rollout_devices": sorted({t[3] for t in tl})}


MAIN_POLICIES = ("static:2", "static:4", "static:6", "best-static", "best-static-free", "hysteresis",
                 "hysteresis-predefined", "oracle")


def main_settings() -> list[Setting]:
    return [Setting(f"staleness {eta}, switch {'ours' if sw is None else 'paper 187 s'}", staleness=eta, switch_s=sw)
            for eta in (1, 0) for sw in (None, PAPER_SWITCH_S)]


def ladder_settings() -> list[Setting]:
    """The issue's setting, then one thing at a time toward the paper's regime (each row keeps
    the ones above it), then from the paper's regime one other assumption at a time."""
    ours = dict(workload="longtail-drift", accelerator="h100", model="7b", prompts_per_step=16, predefined=False)
    rows = [Setting("issue's setting: 7b, H100, longtail-drift, 16 prompts, any split", **ours)]
    steps = [("+ H20", {"accelerator": "h20"}), ("+ Qwen3-8B", {"model": "qwen3-8b"}),
             ("+ recipe batch (32 prompts)", {"prompts_per_step": 32}),
             ("+ dapo-qwen3-8b lengths", {"workload": "dapo-qwen3-8b"}),
             ("+ predefined splits 2,4,6 (the paper's regime)", {"predefined": True})]
    cur = dict(ours)
    for label, change in steps:
        cur |= change
        rows.append(Setting(label, **cur))
    for label, change in (("paper regime, switch 187 s", {"switch_s": PAPER_SWITCH_S}),
                          ("paper regime, staleness 0", {"staleness": 0}),
                          ("paper regime, decode 3x our model", {"decode_cost": 3.0}),
                          ("paper regime, decode 3x, switch 187 s", {"decode_cost": 3.0, "switch_s": PAPER_SWITCH_S}),
                          ("paper regime, decode 3x, longtail-drift lengths",
                           {"decode_cost": 3.0, "workload": "longtail-drift"}),
                          ("paper regime, decode 3x, staleness 0", {"decode_cost": 3.0, "staleness": 0}),
                          ("paper regime, decode 3x, cap-raise lengths (8k -> 16k at step 150)",
                           {"decode_cost": 3.0, "workload": "cap-raise"})):
        rows.append(Setting(label, **(cur | change)))
    return rows


def stage_ratio(s: Setting, window: int = 20) -> dict:
    """How far the job's balance moves: rollout / training time at 4:4, mean over the first and
    the last `window` steps (both stages grow with the response tokens)."""
    sc = s.scenario()
    stages = sc.stages()
    K = sc.num_steps

    def ratio(ks) -> float:
        return float(np.mean([stages.rollout(k, 4).time_s / stages.train(k, 4).time_s for k in ks]))

    return {"first": ratio(range(window)), "last": ratio(range(K - window, K))}


def workload_facts(s: Setting, window: int = 10) -> dict:
    """The sampled lengths of the job's first and last `window` steps (median, mean, the share at
    the 8k cap) and how much its training time at 6:2 changes from step to step."""
    sc = s.scenario()
    out = {}
    for key, ks in (("first", range(window)), ("last", range(sc.num_steps - window, sc.num_steps))):
        a = np.concatenate([sc.batch_of(k).response_tokens for k in ks])
        out[key] = {"median": float(np.median(a)), "mean": float(a.mean()), "capped": float((a >= a.max()).mean())}
    stages = sc.stages()
    t = np.array([stages.train(k, sc.num_devices - 2).time_s for k in range(sc.num_steps)])  # at 6:2
    out["train_step_change"] = {"mean": float(np.mean(np.abs(np.diff(t)) / t[:-1])),
                                "max_s": float(np.abs(np.diff(t)).max())}
    return out


def switching_ceiling(splits: tuple[int, ...] = PREDEFINED, devices: int = 8) -> dict:
    """The most any switching schedule can beat the best static split by, in the most favourable
    model: each stage perfectly divisible (T_roll = W_r / R, T_train = W_t / (N - R), a step
    their max), free switches, phases of constant work. `two_phase`: for each swing of the
    rollout:training work ratio (last phase / first), the best gain over the first phase's ratio
    and the phases' shares of the run (a grid); `any_phases`: the best of 20,000 random jobs of
    2-4 phases (ratios in e^-7..e^7, seeded)."""
    sp = np.asarray(splits, dtype=np.float64)
    floor = 1.0 / (devices - sp)

    def gain(rhos, shares) -> float:
        t = np.maximum(np.asarray(rhos)[:, None] / sp[None, :], floor[None, :])
        return float((shares @ t).min() / (shares * t.min(axis=1)).sum())

    two = {}
    for swing in (1.5, 2.0, 4.0, 10.0, 100.0):
        two[swing] = max(gain([ra, ra * swing], np.array([f, 1 - f]))
                         for ra in np.exp(np.linspace(np.log(1e-4), np.log(1e2), 150))
                         for f in np.linspace(0.05, 0.95, 19))
    rng = np.random.default_rng(0)
    anyp = 0.0
    for _ in range(20000):
        n = int(rng.integers(2, 5))
        anyp = max(anyp, gain(np.exp(rng.uniform(-7, 7, n)), rng.dirichlet(np.ones(n))))
    return {"two_phase": two, "any_phases": anyp}


LADDER_POLICIES = ("best-static", "best-static-free", "hysteresis", "hysteresis-predefined", "oracle")


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _payback(m: dict) -> str:
    p = m["payback_steps"]
    if p is None:
        return "-"
    text = "never" if p == float("inf") else f"{p:.0f}"
    return text + (f" ({m['payback_never']} never)" if m["payback_never"] and p != float("inf") else "")


def main_table(results: list[dict]) -> str:
    lines = ["| setting | policy | throughput vs best predefined static | vs best of any split | total h | time vs "
             "best predefined | switches | payback steps | hidden | splits used |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, m in res["runs"].items():
            label = {"best-static": f"best-static ({res['best_static_rollout']})",
                     "best-static-free": f"best-static, any split ({res['best_static_free_rollout']})"}.get(name, name)
            lines.append(f"| {res['setting']['label']} | {label} | {m['vs_best_static']:.3f}x | "
                         f"{m['vs_best_static_free']:.3f}x | {m['total_time_s'] / 3600:.2f} | "
                         f"{1 / m['vs_best_static'] - 1:+.1%} | {m['switches']} | {_payback(m)} | "
                         f"{_fmt(m['hidden_share'], '.0%')} | {','.join(map(str, m['rollout_devices']))} |")
    lines.append(f"| paper (arXiv 2607.22614, third-party notes [S]) | DynaResize vs optimal static | "
                 f"{PAPER['throughput']:.3f}x | - | - | -33% | - | ~{PAPER['payback_steps']} | "
                 f"{PAPER['hidden_share']:.0%} | 6:2 -> 4:4 |")
    return "\n".join(lines)


def ladder_table(results: list[dict]) -> str:
    lines = ["| change | best static: any split / predefined | hysteresis free vs best any | hysteresis vs best "
             "(setting's splits) | oracle vs best (setting's splits) | switches (hysteresis) |",
             "|---|---|---|---|---|---|"]
    for res in results:
        r = res["runs"]
        lines.append(f"| {res['setting']['label']} | {res['best_static_free_rollout']} / {res['best_static_rollout']} | "
                     f"{r['hysteresis']['vs_best_static_free']:.3f}x | {r['hysteresis-predefined']['vs_best_static']:.3f}x | "
                     f"{r['oracle']['vs_best_static']:.3f}x | {r['hysteresis-predefined']['switches']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, metavar="DIR", help="write seed.json and seed.md here")
    ap.add_argument("--steps", type=int, default=300, help="steps per run (default 300, the page's)")
    args = ap.parse_args(argv)
    main_res = [run_setting(replace(s, steps=args.steps), MAIN_POLICIES) for s in main_settings()]
    ladder_res = [run_setting(replace(s, steps=args.steps), LADDER_POLICIES) for s in ladder_settings()]
    base = main_res[0]["runs"]  # staleness 1, our switch
    vs = {r: base[f"static:{r}"]["total_time_s"] / base["hysteresis-predefined"]["total_time_s"] for r in PREDEFINED}
    paper = replace(main_settings()[0], steps=args.steps)
    ratios = {"paper regime": stage_ratio(paper), "decode 3x": stage_ratio(replace(paper, decode_cost=3.0)),
              "decode 3x, cap-raise": stage_ratio(replace(paper, decode_cost=3.0, workload="cap-raise"))}
    ceiling = switching_ceiling()
    lengths = workload_facts(paper)
    text = ("## Main table\n\n" + main_table(main_res) + "\n\n## One change at a time\n\n" + ladder_table(ladder_res)
            + "\n\n## Baseline\n\nhysteresis on the predefined splits (staleness 1, our switch) against each static "
            "split: " + ", ".join(f"{8 - r}:{r} {x:.3f}x" for r, x in vs.items())
            + "\n\n## Workload\n\ndapo-qwen3-8b, sampled (seed 0), first 10 -> last 10 steps: median "
            + f"{lengths['first']['median']:.0f} -> {lengths['last']['median']:.0f} tokens, mean "
            + f"{lengths['first']['mean']:.0f} -> {lengths['last']['mean']:.0f}, at the cap "
            + f"{lengths['first']['capped']:.1%} -> {lengths['last']['capped']:.1%}; training time at 6:2 changes by "
            + f"{lengths['train_step_change']['mean']:.0%} on average from one step to the next (at most "
            + f"{lengths['train_step_change']['max_s']:.0f} s)"
            + "\n\n## Balance drift\n\nrollout / training time at 4:4, first 20 -> last 20 steps: "
            + "; ".join(f"{k} {v['first']:.2f} -> {v['last']:.2f}" for k, v in ratios.items())
            + "\n\nceiling of any switching schedule over the best of splits 2,4,6 (divisible stages, free switches): "
            "two phases, by swing of the rollout:training work ratio: "
            + ", ".join(f"{k:g}x -> {v:.3f}x" for k, v in ceiling["two_phase"].items())
            + f"; 2-4 phases, best of 20,000 random jobs: {ceiling['any_phases']:.3f}x"
            + "\n\nswitch cost (2 devices): " + json.dumps(main_res[0]["switch_critical_s"]) + "\n")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "seed.json").write_text(json.dumps({"main": main_res, "ladder": ladder_res, "baseline": vs,
                                                   "balance": ratios, "ceiling": ceiling,
                                                   "lengths": lengths}, indent=1, default=str))
        (out / "seed.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
