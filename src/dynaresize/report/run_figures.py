"""Figures of one run's records, for the HTML report: each function returns a matplotlib Figure.

Read only. x is the step number everywhere except the resize Gantt chart (seconds from the
resize decision) and the requests in flight per replica (seconds since the run started).
Derived quantities (step time, idle fractions) come from `metrics`, the definitions the
experiment trackers use too.
"""

from __future__ import annotations

from typing import Any

from dynaresize.metrics import eval_scalars, number, step_scalars
from dynaresize.report.mpl import pyplot
from dynaresize.report.timeline import COLORS

CRITICAL, BACKGROUND = "#C44E52", "#BBBBBB"


def _axes(height: float = 3.0, rows: int = 1) -> tuple[Any, Any]:
    fig, axes = pyplot().subplots(rows, 1, figsize=(10, height), sharex=True, squeeze=False)
    return fig, axes[:, 0]


def _finish(fig: Any, ax: Any, title: str, ylabel: str, xlabel: str = "step") -> Any:
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if xlabel == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def split_figure(steps: list[dict], resizes: list[dict]) -> Any:
    """Rollout and training devices per step; a dotted line after each step that decided a resize."""
    fig, (ax,) = _axes()
    xs = [r["step"] for r in steps]
    ax.step(xs, [r["num_rollout"] for r in steps], where="post", color=COLORS["rollout"], label="rollout devices")
    ax.step(xs, [r["num_train"] for r in steps], where="post", color=COLORS["train"], label="training devices")
    for r in resizes:
        ax.axvline(r["step"] + 0.5, color="black", linestyle=":", linewidth=0.8)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, "Split over time (dotted: a resize after that step)", "devices")


def stage_times_figure(steps: list[dict]) -> Any:
    fig, (ax,) = _axes()
    xs = [r["step"] for r in steps]
    for field, color in (("rollout_s", COLORS["rollout"]), ("train_s", COLORS["train"]),
                         ("sync_s", COLORS["weight_sync"])):
        ax.plot(xs, [number(r.get(field)) for r in steps], marker=".", color=color, label=field)
    ax.plot(xs, [step_scalars(r).get("time/step_s") for r in steps], color="black", linewidth=0.8,
            linestyle="--", label="step window")
    return _finish(fig, ax, "Stage times per step", "seconds")


def idle_figure(steps: list[dict]) -> Any:
    """Idle device-seconds as a share of each step's window: tail idle vs other idle."""
    fig, (ax,) = _axes()
    xs = [r["step"] for r in steps]
    scal = [step_scalars(r) for r in steps]
    tail = [s.get("idle/tail_fraction", 0.0) for s in scal]
    other = [max(0.0, s.get("idle/fraction", 0.0) - t) for s, t in zip(scal, tail)]
    ax.bar(xs, tail, color="#8172B3", label="tail idle (rollout devices waiting for the last response)")
    ax.bar(xs, other, bottom=tail, color="#CCB974", label="other idle (bubble, resize stalls)")
    ax.set_ylim(0, 1)
    return _finish(fig, ax, "Idle share of device time per step", "share of device-seconds")


def reward_figure(steps: list[dict], evals: list[dict]) -> Any:
    """Mean reward per step (band: +- std where recorded); eval metrics below when recorded."""
    fig, axes = _axes(3.0 + (2.2 if evals else 0.0), 2 if evals else 1)
    ax = axes[0]
    pts = [(r["step"], number(r.get("reward_mean")), number(r.get("reward_std"))) for r in steps]
    pts = [p for p in pts if p[1] is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color="#55A868", label="reward mean")
    band = [p for p in pts if p[2] is not None]
    if band:
        ax.fill_between([p[0] for p in band], [p[1] - p[2] for p in band], [p[1] + p[2] for p in band],
                        color="#55A868", alpha=0.2, label="+- std")
    _finish(fig, ax, "Reward", "reward")
    if not evals:
        return fig
    ev = axes[1]
    values = [(r["step"], eval_scalars(r)) for r in evals]
    for name in sorted({n for _, v in values for n in v}):
        pts = [(k, v[name]) for k, v in values if name in v]
        ev.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name.removeprefix("eval/"))
    return _finish(fig, ev, "Eval", "value")


def resize_figure(resize: dict, ops: list[dict]) -> Any:
    """One resize's ops on a time axis from its decision: critical (hatched) vs background."""
    t0 = number(resize.get("t_s"))
    if t0 is None:
        t0 = min((op["start_s"] for op in ops), default=0.0)
    rows = sorted(ops, key=lambda op: (op["start_s"], op["device"]))
    fig, (ax,) = _axes(1.2 + 0.28 * max(1, len(rows)))
    for i, op in enumerate(rows):
        crit = bool(op["critical"])
        ax.barh(i, max(op["end_s"] - op["start_s"], 1e-4), left=op["start_s"] - t0, height=0.6,
                color=CRITICAL if crit else BACKGROUND, hatch="///" if crit else None, edgecolor="black",
                linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"device {op['device']}: {op['name']}" for op in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(resize["critical_s"], color=CRITICAL, linestyle="--", linewidth=0.8, label="critical path done")
    ax.axvline(resize["total_s"], color="black", linestyle=":", linewidth=0.8, label="all ops done")
    return _finish(fig, ax, f"Resize {resize['resize_id']} after step {resize['step']}: ops",
                   "", xlabel="seconds from the decision")



MAX_PANELS = 12  # more rollout devices than this: one strip per device, the count as a colour


def _windows(r: dict) -> tuple[list[float], list[float], list[float]]:
    """A concurrency record's segments: starts, ends (the last at its window's end), counts."""
    starts = [float(t) for t in r["t_s"]]
    window = number(r.get("window_s"))
    end = starts[0] + window if starts and window is not None else (starts[-1] if starts else 0.0)
    return starts, starts[1:] + [end], [number(n) or 0.0 for n in r["in_flight"]]


def concurrency_figure(records: list[dict], resizes: list[dict]) -> Any:
    """Requests in flight per rollout device over run time, from `concurrency` records: one small
    step-plot panel per device (above MAX_PANELS devices, one strip per device coloured by the
    count); each record's window is drawn on its own, so a gap between windows stays a gap.
    Dotted: a resize decision."""
    from matplotlib.ticker import MaxNLocator

    by_device: dict[int, list[dict]] = {}
    for r in records:
        if r["t_s"]:
            by_device.setdefault(int(r["device"]), []).append(r)
    devices = sorted(by_device) or [0]
    peak = max([number(r.get("peak")) or 0.0 for r in records] + [1.0])
    title = "Requests in flight per replica (dotted: a resize)"
    if len(devices) > MAX_PANELS:
        return _concurrency_strips(by_device, devices, peak, resizes, title)
    fig, axes = _axes(0.6 + 1.0 * len(devices), len(devices))
    for ax, d in zip(axes, devices):
        for r in by_device.get(d, []):
            starts, ends, counts = _windows(r)
            xs, ys = starts + ends[-1:], counts + counts[-1:]
            ax.step(xs, ys, where="post", color=COLORS["rollout"], linewidth=0.9)
            ax.fill_between(xs, ys, step="post", color=COLORS["rollout"], alpha=0.25, linewidth=0)
        for r in resizes:
            if number(r.get("t_s")) is not None:
                ax.axvline(r["t_s"], color="black", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, peak * 1.1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=3))
        ax.set_ylabel(f"device {d}", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    return fig


def _concurrency_strips(by_device: dict[int, list[dict]], devices: list[int], peak: float, resizes: list[dict],
                        title: str) -> Any:
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    plt = pyplot()
    cmap, norm = plt.get_cmap("viridis"), Normalize(0.0, peak)
    fig, (ax,) = _axes(1.2 + 0.16 * len(devices))
    for row, d in enumerate(devices):
        for r in by_device[d]:
            starts, ends, counts = _windows(r)
            ax.broken_barh([(s, e - s) for s, e in zip(starts, ends)], (row - 0.45, 0.9),
                           facecolors=[cmap(norm(n)) for n in counts], linewidth=0)
    for r in resizes:
        if number(r.get("t_s")) is not None:
            ax.axvline(r["t_s"], color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices], fontsize=6)
    ax.invert_yaxis()
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="requests in flight", pad=0.01)
    return _finish(fig, ax, title, "", xlabel="seconds since start")
