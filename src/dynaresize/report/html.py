"""`RUN_DIR/report.html`: one self-contained page about a run (or every policy of a simulation).

Sections per run: first the headline table (report/headline.py: throughput, gain over the
static split it started from and the simulator's prediction, resizes each way, idle and tail
idle, reward first -> last, ledger; the figures `dynaresize run` prints at its end), then split
over time, stage times, idle breakdown (tail vs other), reward (and eval when `eval` records
exist: a curve per metric and a table), the device timeline (real runs: `span` records), the
requests in flight per replica (only when `concurrency` records exist: a figure, a table row per
device), every resize with its ops (a table, and a Gantt chart for the first `MAX_GANTT`), faults,
and last the whole summary, every field, in a collapsed `<details>`.

Invariants: the page needs nothing beside it and no network: figures are PNG data URIs, the CSS
is inline, the one script is inline and only checks that every figure decoded (it writes the
verdict into `<div id="verdict">`, which the browser test reads, and into `<div id="first-shown">`
the id of the page's first table or figure and whether it is in the first screen). Every text
from the records is HTML-escaped.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Callable

from dynaresize.metrics import number, split_text, step_scalars
from dynaresize.report import run_figures as rf
from dynaresize.report.headline import HEADLINE_ID, headline_html
from dynaresize.report.load import RunRecords, load_runs
from dynaresize.report.mpl import figure_data_uri, file_data_uri

MAX_GANTT = 12  # per run; a simulation's policies get SIM_GANTT each
SIM_GANTT = 3

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .6em 0; font-size: 13px; }
table.headline { font-size: 15px; } table.headline td.num { font-weight: 600; white-space: nowrap; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 12px; } .crit { color: #C44E52; font-weight: 600; }
details { margin: .4em 0 1em; } summary { cursor: pointer; } .note { color: #666; }
#verdict, #first-shown { color: #888; font-size: 11px; margin-top: 3em; }
"""

# Runs after every image has loaded or failed: lists those that did not decode.
VERDICT_JS = """
window.addEventListener('load', function () {
  var bad = [], imgs = document.querySelectorAll('img.plot');
  imgs.forEach(function (i) { if (!i.complete || i.naturalWidth === 0) { bad.push(i.id); } });
  document.getElementById('verdict').textContent = bad.length
    ? 'figures failed: ' + bad.join(' ') : 'figures ok: ' + imgs.length + '/' + imgs.length;
  var first = document.querySelector('table, figure');
  document.getElementById('first-shown').textContent = first
    ? (first.id || first.tagName.toLowerCase()) + (first.getBoundingClientRect().top < window.innerHeight
       ? ' in the first screen' : ' below the first screen') : 'none';
});
"""


class Page:
    """Accumulates HTML; figures get ids in order (fig-1, fig-2, ...)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.num_figures = 0

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, caption: str, make: Callable[[], Any] | None = None, *, uri: str | None = None) -> None:
        self.num_figures += 1
        src = uri if uri is not None else figure_data_uri(make())
        self.add(f'<figure><img class="plot" id="fig-{self.num_figures}" alt="{esc(caption)}" src="{src}">'
                 f"<figcaption>{esc(caption)}</figcaption></figure>")

    def html(self, title: str) -> str:
        return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
                + "\n".join(self.parts)
                + f'\n<div id="verdict">figures not checked yet ({self.num_figures})</div>'
                '\n<div id="first-shown">not checked yet</div>'
                f"\n<script>{VERDICT_JS}</script>\n</body></html>\n")


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """A table cell: numbers rounded, long lists shortened, nested data as compact JSON."""
    if isinstance(value, bool) or value is None:
        return esc(json.dumps(value))
    if isinstance(value, float):
        return esc(f"{value:.4g}")
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        shown = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value[:8])
        return esc(f"[{shown}]" if len(value) <= 8 else f"{len(value)} items: {shown}, ...")
    if isinstance(value, (list, dict)):
        return esc(json.dumps(value, default=str)[:300])
    return esc(value)


def table(head: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        cls = ' class="num"' if number(v) is not None else ""
        return f"<td{cls}>{fmt(v)}</td>"

    return ("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows) + "</table>")


def run_section(page: Page, run: RunRecords, *, max_gantt: int = MAX_GANTT, level: int = 2, index: int = 0) -> None:
    # a resumed run may record a step again (rolled back, then run again): its last record is its state
    steps = sorted({r["step"]: r for r in run.of("step")}.values(), key=lambda r: r["step"])
    resizes, ops, evals = run.of("resize"), run.of("op"), run.of("eval")
    h = f"h{level}"
    page.add(headline_html(run, table_id=HEADLINE_ID if index == 0 else f"{HEADLINE_ID}-{index + 1}"))
    page.add(f"<{h}>Split and stage times</{h}>")
    page.figure("Rollout and training devices per step", lambda: rf.split_figure(steps, resizes))
    page.figure("Rollout, training and weight-sync seconds per step", lambda: rf.stage_times_figure(steps))
    page.add(f"<{h}>Idle device time</{h}>")
    page.add(_idle_totals(steps))
    page.figure("Idle share of each step's device-seconds: tail vs other", lambda: rf.idle_figure(steps))
    page.add(f"<{h}>Reward{' and eval' if evals else ''}</{h}>")
    page.figure("Reward per step" + (" and eval metrics" if evals else ""), lambda: rf.reward_figure(steps, evals))
    if not evals:
        page.add('<p class="note">No eval records in this run.</p>')
    else:
        page.add(_eval_table(evals))
    if not run.simulated:
        from dynaresize.report.timeline import timeline_figure

        page.add(f"<{h}>Device timeline</{h}>")
        page.figure("Work per device over time (resize ops: red hatched critical, grey background)",
                    lambda: timeline_figure(run.records, title=run.name))
    _concurrency(page, run.of("concurrency"), resizes, h)
    _resizes(page, resizes, ops, max_gantt, h)
    _faults(page, run, h)
    summary = run.summary
    page.add(f"<{h}>Summary</{h}>")
    page.add(f'<details class="summary"><summary>Every field of the summary ({len(summary)})</summary>'
             + table(["field", "value"], [[k, v] for k, v in summary.items()]) + "</details>" if summary
             else '<p class="note">No summary record (the run has not finished).</p>')


def _concurrency(page: Page, records: list[dict], resizes: list[dict], h: str) -> None:
    """Requests in flight per rollout device (`concurrency` records): a figure and per device its
    time-weighted mean over every window recorded, its peak and its seconds with none in flight."""
    if not records:
        return
    page.add(f"<{h}>Requests in flight per replica</{h}>")
    page.figure("Requests in flight per rollout device over time (one step plot per device; dotted: a resize)",
                lambda: rf.concurrency_figure(records, resizes))
    rows = []
    for d in sorted({int(r["device"]) for r in records}):
        mine = [r for r in records if int(r["device"]) == d]
        window = sum(number(r.get("window_s")) or 0.0 for r in mine)
        area = sum((number(r.get("window_s")) or 0.0) * (number(r["mean_in_flight"]) or 0.0) for r in mine)
        rows.append([d, len(mine), window, area / window if window > 0 else None,
                     max(number(r["peak"]) or 0 for r in mine), sum(number(r.get("idle_s")) or 0.0 for r in mine)])
    page.add(table(["device", "windows", "seconds", "mean in flight", "peak", "idle s"], rows))


def _eval_table(evals: list[dict]) -> str:
    """One row per evaluation: its metrics (pass@k for every k it reports) and what it ran on."""
    passes = sorted({k for r in evals for k in r if k.startswith("pass_at_")},
                    key=lambda k: (len(k), k))  # pass_at_2 before pass_at_16
    cols = ["step", "version", "reward_mean", "reward_std", *passes, "num_prompts", "samples_per_prompt",
            "correct_threshold", "eval_s"]
    return table(cols, [[r.get(c) for c in cols] for r in evals])


def _faults(page: Page, run: RunRecords, h: str) -> None:
    faults, recoveries = run.of("fault"), run.of("recovery")
    if not faults and not recoveries:
        return
    page.add(f"<{h}>Faults ({len(faults)}) and recoveries ({len(recoveries)})</{h}>")
    if faults:
        cols = ["step", "device", "fault_kind", "point", "injected", "detect_s", "reason"]
        page.add(table(cols, [[r.get(c) for c in cols] for r in faults]))
    if recoveries:
        cols = ["step", "lost_devices", "num_devices", "recovery_s", "settle_s", "world_s", "restore_s", "generation"]
        page.add(table(cols, [[r.get(c) for c in cols] for r in recoveries]))


def _idle_totals(steps: list[dict]) -> str:
    window = sum((r["num_rollout"] + r["num_train"]) * (step_scalars(r).get("time/step_s") or 0.0) for r in steps)
    idle = sum(number(r["idle_device_s"]) or 0.0 for r in steps)
    tail = sum(number(r["tail_idle_device_s"]) or 0.0 for r in steps)
    if window <= 0:
        return ""
    return (f"<p>Over all steps: idle {idle / window:.1%} of device-seconds, of which tail idle "
            f"{tail / window:.1%} and other idle {(idle - tail) / window:.1%}.</p>")


def _resizes(page: Page, resizes: list[dict], ops: list[dict], max_gantt: int, h: str) -> None:
    page.add(f"<{h}>Resizes ({len(resizes)})</{h}>")
    if not resizes:
        page.add('<p class="note">No resize in this run.</p>')
        return
    by_id: dict[Any, list[dict]] = {}
    for op in ops:
        by_id.setdefault(op["resize_id"], []).append(op)
    rows = []
    for r in resizes:
        mine = by_id.get(r["resize_id"], [])
        rows.append([r["resize_id"], r["step"], split_text(r["from"]), split_text(r["to"]), r["moving"], r["to_role"],
                     r["critical_s"], r["total_s"], sum(1 for o in mine if o["critical"]),
                     sum(1 for o in mine if not o["critical"]), sum(o["bytes"] or 0 for o in mine),
                     r.get("reason", "")])
    page.add(table(["id", "after step", "from", "to", "moving", "to role", "critical s", "total s", "critical ops",
                    "background ops", "bytes", "reason"], rows))
    for i, r in enumerate(resizes):
        mine = sorted(by_id.get(r["resize_id"], []), key=lambda o: (o["start_s"], o["device"]))
        t0 = number(r.get("t_s"))
        t0 = t0 if t0 is not None else min((o["start_s"] for o in mine), default=0.0)
        page.add(f"<details{' open' if i < max_gantt else ''}><summary>Resize {esc(r['resize_id'])} after step "
                 f"{esc(r['step'])}: {esc(split_text(r['from']))} &rarr; {esc(split_text(r['to']))}, "
                 f"critical {r['critical_s']:.3f} s, total {r['total_s']:.3f} s</summary>")
        page.add(table(["op", "device", "start s", "duration s", "bytes", "path"],
                       [[o["name"], o["device"], o["start_s"] - t0, o["end_s"] - o["start_s"], o["bytes"],
                         "critical" if o["critical"] else "background"] for o in mine]))
        if i < max_gantt and mine:
            page.figure(f"Resize {r['resize_id']}: ops from the decision",
                        lambda r=r, mine=mine: rf.resize_figure(r, mine))
        page.add("</details>")
    if len(resizes) > max_gantt:
        page.add(f'<p class="note">Gantt charts for the first {max_gantt} resizes; the rest have their op tables.</p>')


def _sim_header(page: Page, doc: dict, root: Path) -> None:
    page.add(f"<p>Simulation: workload {esc(doc.get('workload'))}, {esc(doc.get('devices'))} devices, "
             f"{esc(doc.get('steps'))} steps, model {esc(doc.get('model'))}.</p>")
    keys = ["policy", "samples_per_s", "total_time_s", "idle_fraction", "tail_idle_fraction", "resizes",
            "reversals", "rollout_devices_final"]
    page.add(table(keys, [[r.get(k) for k in keys] for r in doc["results"]]))
    for name in ("allocation.png", "throughput.png"):
        if (root / name).is_file():
            page.figure(f"{name} (written by dynaresize simulate)", uri=file_data_uri(root / name))


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of `run_dir` (a run or a simulation directory); returns its path."""
    root = Path(run_dir)
    runs, sim_doc = load_runs(root)
    page = Page()
    title = f"dynaresize report: {root.resolve().name}"
    page.add(f"<h1>{esc(title)}</h1><p class=\"note\">From {esc(root.resolve())}.</p>")
    if sim_doc is None:
        run_section(page, runs[0])
    else:
        _sim_header(page, sim_doc, root)
        for i, run in enumerate(runs):
            page.add(f"<h2>Policy {esc(run.name)}</h2>")
            run_section(page, run, max_gantt=SIM_GANTT, level=3, index=i)
    path = Path(out) if out is not None else root / "report.html"
    path.write_text(page.html(title), encoding="utf-8")
    return path
