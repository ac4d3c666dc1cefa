"""The results of `dynaresize bench resize` (commands/bench_resize.py): the summary of every
recorded resize (medians per direction and staging bound, per op, critical and background, and
the naive path's phases), its table on the console and its op-timeline figure.

Reads what the bench measured, never measures: the headline is the primary (configured
default) staging bound; warm-up round trips are recorded but left out of the medians.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
PARAM_BYTES_PER_ELEM = 4  # fp32 master weights


def median_or_nan(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _by(items: list[dict], key: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for it in items:
        out.setdefault(it[key], []).append(it)
    return out


def _op_medians(resizes: list[dict], critical: bool) -> dict[str, float]:
    """Median over resizes of each op's span (first start to last end over its devices)."""
    per: dict[str, list[float]] = {}
    for r in resizes:
        spans: dict[str, list[float]] = {}
        for op in r["ops"]:
            if op["critical"] == critical:
                s = spans.setdefault(op["name"], [op["t0"], op["t1"]])
                s[0], s[1] = min(s[0], op["t0"]), max(s[1], op["t1"])
        for name, (a, b) in spans.items():
            per.setdefault(name, []).append(b - a)
    return {name: median_or_nan(v) for name, v in per.items()}


def summarize(bench: Any, numel: int, bounds, primary: int, start_s: float, warm: dict | None,
               preserved: bool, repeats: int) -> dict:
    every = [r for r in bench.resizes if r["path"] == "optimized"]  # warm-ups too: bounds and groups
    opt = [r for r in every if not r["warmup"]]
    naive = [r for r in bench.resizes if r["path"] == "naive"]
    head = [r for r in opt if r["staging_bytes"] == primary]
    opt_dir, naive_dir = _by(head, "direction"), _by(naive, "direction")
    crit_opt, crit_naive = median_or_nan([r["critical_s"] for r in head]), median_or_nan([r["critical_s"] for r in naive])
    state_s = (median_or_nan([n.phase_s().get("save_checkpoint", 0.0) for n in bench.naive])
               + (warm["reload_and_engines_s"] + warm["load_weights_s"] if warm else float("nan")))
    per_bound = []
    for b in bounds:
        rs, all_rs = [r for r in opt if r["staging_bytes"] == b], [r for r in every if r["staging_bytes"] == b]
        per_bound.append({"staging_bound_bytes": b,
                          "peak_staging_bytes": max((r["peak_staging_bytes"] for r in all_rs), default=0),
                          "critical_s_median": median_or_nan([r["critical_s"] for r in rs]),
                          "total_s_median": median_or_nan([r["total_s"] for r in rs]), "num_resizes": len(rs),
                          "within_bound": all(r["peak_staging_bytes"] <= b for r in all_rs)})
    max_train = bench.devices - bench.initial_rollout
    return {
        "devices": bench.devices, "model": bench.model, "num_params": numel, "repeats": repeats,
        "cluster_start_s": start_s, "staging_bound_bytes": primary,
        "param_shard_bytes_min": numel // max_train * PARAM_BYTES_PER_ELEM,
        "optimized": {
            "critical_s_median": crit_opt, "total_s_median": median_or_nan([r["total_s"] for r in head]),
            "groups_created_critical": sum(r["groups_created_critical"] for r in every),
            "warmup_critical_s": [r["critical_s"] for r in every if r["warmup"]],
            "peak_staging_bytes": max((r["peak_staging_bytes"] for r in every if r["staging_bytes"] == primary),
                                      default=0),
            "peak_staging_source": sorted({s for r in opt for s in r["peak_staging_source"]}),
            "by_direction": {d: {"critical_s_median": median_or_nan([r["critical_s"] for r in rs]),
                                 "total_s_median": median_or_nan([r["total_s"] for r in rs]), "num_resizes": len(rs),
                                 "critical_ops_s": _op_medians(rs, True), "background_ops_s": _op_medians(rs, False)}
                             for d, rs in sorted(opt_dir.items())},
        },
        "naive": {
            "critical_s_median": crit_naive,
            "groups_created_critical": sum(r["groups_created_critical"] for r in naive),
            "checkpoint_bytes": max((r["checkpoint_bytes"] for r in naive), default=0),
            "by_direction": {d: {"critical_s_median": median_or_nan([r["critical_s"] for r in rs]), "num_resizes": len(rs),
                                 "phases_s": {k: median_or_nan([r["phases_s"][k] for r in rs if k in r["phases_s"]])
                                              for k in rs[0]["phases_s"]}}
                             for d, rs in sorted(naive_dir.items())},
            "state_s": state_s, "process_s": crit_naive - state_s, "warm_reload": warm,
        },
        "speedup": crit_naive / crit_opt if crit_opt > 0 else float("inf"),
        "speedup_by_direction": {d: median_or_nan([r["critical_s"] for r in naive_dir[d]])
                                 / median_or_nan([r["critical_s"] for r in opt_dir[d]]) for d in naive_dir if d in opt_dir},
        "bounds": per_bound,
        "state_preserved": preserved,
        "resizes": [{k: v for k, v in r.items()} for r in bench.resizes],
    }


def fmt_bytes(n: float) -> str:
    if n != n:  # nan: nothing measured
        return "-"
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def format_table(s: dict) -> str:
    o, n = s["optimized"], s["naive"]
    lines = [f"\nresize bench: {s['devices']} devices, {s['num_params'] / 1e6:.2f}M params, "
             f"staging bound {fmt_bytes(s['staging_bound_bytes'])} (param shard >= {fmt_bytes(s['param_shard_bytes_min'])})",
             f"{'path':10s} {'direction':16s} {'critical s':>10s} {'total s':>9s} {'n':>3s}"]
    for d, v in o["by_direction"].items():
        lines.append(f"{'optimized':10s} {d:16s} {v['critical_s_median']:10.3f} {v['total_s_median']:9.3f} {v['num_resizes']:3d}")
    for d, v in n["by_direction"].items():
        lines.append(f"{'naive':10s} {d:16s} {v['critical_s_median']:10.3f} {v['critical_s_median']:9.3f} {v['num_resizes']:3d}")
    sp = ", ".join(f"{d} {v:.1f}x" for d, v in s["speedup_by_direction"].items())
    lines += [f"speedup (naive / optimized critical, medians): {s['speedup']:.1f}x ({sp})",
              f"groups created on the critical path: optimized {o['groups_created_critical']}, naive {n['groups_created_critical']}",
              f"naive: {n['process_s']:.2f} s process restart vs {n['state_s']:.2f} s state (save + warm reload + sync)",
              "staging bound -> peak staging (critical s median, total s median):"]
    for b in s["bounds"]:
        lines.append(f"  {fmt_bytes(b['staging_bound_bytes']):>9s} -> {fmt_bytes(b['peak_staging_bytes']):>9s} "
                     f"({b['critical_s_median']:.3f} s, {b['total_s_median']:.3f} s){'' if b['within_bound'] else '  OVER BOUND'}")
    for d, v in o["by_direction"].items():
        lines.append(f"optimized {d} critical ops (median s): "
                     + ", ".join(f"{k} {x:.3f}" for k, x in v["critical_ops_s"].items()))
    for d, v in n["by_direction"].items():
        lines.append(f"naive {d} phases (median s): " + ", ".join(f"{k} {x:.2f}" for k, x in v["phases_s"].items()))
    lines.append(f"trainer state preserved across all moves: {s['state_preserved']}")
    return "\n".join(lines)


def plot_timeline(bench: Any, path: Path, primary: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opt = [r for r in bench.resizes if r["path"] == "optimized" and r["staging_bytes"] == primary and not r["warmup"]]
    shown = [rs[-1] for rs in _by(opt, "direction").values()] + [r for r in bench.resizes if r["path"] == "naive"][:1]
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2 + 2.2 * len(shown)), squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        ops = sorted(r["ops"], key=lambda op: (op["t0"], op["device"]))
        for i, op in enumerate(ops):
            ax.barh(i, max(op["t1"] - op["t0"], 1e-3), left=op["t0"], height=0.7,
                    color="#C44E52" if op["critical"] else "#8DA0CB", edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(ops)))
        ax.set_yticklabels([f"{op['name']} (d{op['device']})" if op["device"] >= 0 else op["name"] for op in ops],
                           fontsize=7)
        ax.invert_yaxis()
        ax.axvline(r["critical_s"], color="#C44E52", linestyle="--", linewidth=1)
        ax.set_title(f"{r['path']} {r['direction']}: critical {r['critical_s']:.2f} s (dashed), total "
                     f"{r['total_s']:.2f} s; red = critical op, blue = background op", fontsize=9)
        ax.set_xlabel("seconds since the resize decision")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ LoRA beside full training

def bench_adapter_params(model: dict, rank: int, target_modules: tuple[str, ...]) -> int:
    """The adapter's parameters for the bench's built-in Qwen2 (`costmodel.lora`: MLP 4 x hidden,
    head dim hidden / heads)."""
    from dynaresize.costmodel import lora

    h, heads = model["hidden_size"], model["num_heads"]
    shape = lora.DecoderShape(num_layers=model["num_layers"], hidden_size=h, num_heads=heads,
                              num_kv_heads=model["num_kv_heads"], head_dim=h // heads, intermediate_size=4 * h)
    return lora.adapter_params(shape, rank, target_modules)


def _move_bytes(r: dict) -> int:
    """Bytes a resize moved: what every device of its ops received (the reshard's wire bytes)."""
    return int(sum(op.get("bytes", 0) for op in r["ops"]))


def _per_direction(resizes: list[dict]) -> dict[str, dict]:
    return {d: {"critical_s_median": median_or_nan([r["critical_s"] for r in rs]),
                "total_s_median": median_or_nan([r["total_s"] for r in rs]),
                "bytes_median": median_or_nan([_move_bytes(r) for r in rs]), "num_resizes": len(rs),
                "critical_ops_s": _op_medians(rs, True)}
            for d, rs in sorted(_by(resizes, "direction").items())}


def lora_summary(seg: dict, full: dict, primary: int) -> dict:
    """The summary's `lora` block: the LoRA segment's moves (commands/bench_resize.py `run_lora`)
    per direction beside the full-training moves at the same staging bound, with the adapter's
    size as the trainers count it and as `costmodel.lora` computes it."""
    full_moves = [r for r in full["resizes"] if r["path"] == "optimized" and not r["warmup"]
                  and r["staging_bytes"] == primary]
    lora_moves = [r for r in seg["resizes"] if not r["warmup"]]
    mine, theirs = _per_direction(lora_moves), _per_direction(full_moves)
    arith = bench_adapter_params(full["model"], seg["rank"], tuple(seg["target_modules"]))
    return {
        "rank": seg["rank"], "target_modules": seg["target_modules"], "staging_bound_bytes": primary,
        "adapter_params": seg["numel"], "adapter_params_arithmetic": arith, "num_params": full["num_params"],
        "by_direction": {d: {**v, "full_critical_s_median": theirs.get(d, {}).get("critical_s_median", float("nan")),
                             "full_total_s_median": theirs.get(d, {}).get("total_s_median", float("nan")),
                             "full_bytes_median": theirs.get(d, {}).get("bytes_median", float("nan"))}
                         for d, v in mine.items()},
        "warmup_critical_s": [r["critical_s"] for r in seg["resizes"] if r["warmup"]],
        "state_preserved": seg["state_preserved"],
        "resizes": seg["resizes"],
    }


def format_lora(s: dict) -> str:
    b = s["lora"]
    lines = [f"\nLoRA rank {b['rank']} ({','.join(b['target_modules'])}) beside full training, staging bound "
             f"{fmt_bytes(b['staging_bound_bytes'])}: adapter {b['adapter_params'] / 1e6:.3f}M params "
             f"(costmodel.lora: {b['adapter_params_arithmetic'] / 1e6:.3f}M) of {b['num_params'] / 1e6:.2f}M",
             f"{'direction':16s} {'critical s LoRA / full':>24s} {'total s LoRA / full':>22s} {'bytes/move LoRA / full':>26s}"]
    for d, v in b["by_direction"].items():
        lines.append(f"{d:16s} {v['critical_s_median']:11.3f} / {v['full_critical_s_median']:<10.3f} "
                     f"{v['total_s_median']:9.3f} / {v['full_total_s_median']:<10.3f} "
                     f"{fmt_bytes(v['bytes_median']):>12s} / {fmt_bytes(v['full_bytes_median']):<12s}")
    for d, v in b["by_direction"].items():
        lines.append(f"LoRA {d} critical ops (median s): " + ", ".join(f"{k} {x:.3f}" for k, x in v["critical_ops_s"].items()))
    lines.append(f"adapter state preserved across the LoRA moves: {b['state_preserved']}")
    return "\n".join(lines)
