"""Figures of a simulation: the allocation timeline and the throughput of each policy.

- `allocation.png`: rollout devices over wall time, one panel per policy (step function; a
  resize shows as a jump), with each step's time on a second axis.
- `throughput.png`: samples/s per policy (bars), with idle and tail-idle fractions annotated.

Matplotlib with the Agg backend (no display needed). Reads only results and the summary.
"""

from __future__ import annotations

from pathlib import Path


def write_sim_figures(runs: dict, doc: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths: list[Path] = []
    names = list(runs)
    title = f"{doc['workload']} · {doc['devices']} devices · {doc['steps']} steps · {doc['model']}"
    if doc.get("staleness", 1) >= 2:
        title += f" · staleness {doc['staleness']}" + (" · partial rollout" if doc.get("partial") else "")

    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.7 * len(names) + 1.0), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        tl = runs[name].timeline
        if not tl:
            continue
        t = [row[1] / 3600 for row in tl] + [tl[-1][2] / 3600]
        r = [row[3] for row in tl]
        ax.step(t, r + [r[-1]], where="post", color="#4C72B0", lw=1.5)
        ax.set_ylabel("rollout\ndevices", fontsize=8)
        ax.set_ylim(0, doc["devices"])
        ax.set_title(f"{name}: {runs[name].resizes} resizes", fontsize=9, loc="left")
        ax2 = ax.twinx()
        ax2.plot([row[1] / 3600 for row in tl], [row[2] - row[1] for row in tl], color="#DD8452", lw=0.6, alpha=0.7)
        ax2.set_ylabel("step s", fontsize=8, color="#DD8452")
        ax2.tick_params(labelsize=7)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("wall time (h)")
    fig.suptitle(f"Allocation over time — {title}", fontsize=10)
    paths.append(_save(fig, out / "allocation.png"))

    results = doc["results"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(results)), 4))
    xs = range(len(results))
    vals = [r["samples_per_s"] for r in results]
    bars = ax.bar(xs, vals, color=["#55A868" if r["policy"] == "hysteresis" else "#8C8C8C" for r in results])
    for b, r in zip(bars, results):
        ax.annotate(f"{r['samples_per_s']:.2f}\nidle {r['idle_fraction']:.0%}\ntail {r['tail_idle_fraction']:.0%}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [r["policy"] for r in results], rotation=20, fontsize=8)
    ax.set_ylabel("samples / s")
    ax.set_ylim(0, max(vals) * 1.3 if vals else 1)
    ax.set_title(f"Throughput — {title}", fontsize=10)
    paths.append(_save(fig, out / "throughput.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
