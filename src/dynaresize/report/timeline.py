"""Device timeline PNG of a real run: one row per device, stage and resize spans over time.

Read only: draws `span` records (rollout / train / sync / idle work per device) and `op`
records (resize operations; critical ones hatched) and marks each resize decision with a line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "weight_sync": "#55A868", "eval": "#8172B3"}


def write_timeline(records: Iterable[dict], path: str | Path, title: str = "dynaresize run") -> Path:
    from dynaresize.report.mpl import save_figure

    return save_figure(timeline_figure(records, title), path)


def timeline_figure(records: Iterable[dict], title: str = "dynaresize run"):
    """The device timeline as a matplotlib Figure (the caller saves or embeds it)."""
    from dynaresize.report.mpl import pyplot

    plt = pyplot()
    from matplotlib.patches import Patch

    records = list(records)
    spans = [r for r in records if r["kind"] == "span"]
    ops = [r for r in records if r["kind"] == "op"]
    resizes = [r for r in records if r["kind"] == "resize"]
    devices = sorted({int(r["device"]) for r in spans + ops}) or [0]
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(devices)))
    for r in spans:
        color = COLORS.get(r["name"].split(":")[0], "#999999")
        ax.barh(int(r["device"]), r["end_s"] - r["start_s"], left=r["start_s"], height=0.6,
                color=color, edgecolor="none")
    for r in ops:
        ax.barh(int(r["device"]) + 0.35, max(r["end_s"] - r["start_s"], 1e-3), left=r["start_s"], height=0.2,
                color="#C44E52" if r["critical"] else "#BBBBBB", hatch="///" if r["critical"] else None,
                edgecolor="black", linewidth=0.3)
    for r in resizes:
        if "t_s" in r:
            ax.axvline(r["t_s"], color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(devices, [f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start")
    ax.set_title(title)
    used = {r["name"].split(":")[0] for r in spans}
    handles = [Patch(color=c, label=n) for n, c in COLORS.items() if n in used]
    handles += [Patch(facecolor="#C44E52", hatch="///", label="resize op (critical)"),
                Patch(facecolor="#BBBBBB", label="resize op (background)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
