"""Requests in flight on one rollout replica over a time window, as a compact step function.

The router knows, for each replica, when each request was admitted and when it finished;
`concurrency_summary` turns those intervals into what a `concurrency` record carries
(docs/records.md) and `dynaresize report` draws: the number of requests in flight from each
change point on. A replica whose slots empty while the step's last long response decodes shows
as a low tail; `tail_slots_idle` integrates the empty slots.

Pure: no Ray, torch, I/O or clock; the caller passes times (run-relative seconds).

Definitions. Intervals are clipped to the window [t0, t1]; one that is empty there (it ends at
or before t0, or starts at or after t1) is dropped, the others count in `requests`. A request
is in flight on [admitted, finished): at a time where one finishes and another is admitted
the count does not change. `t_s[i]` is the start of segment i, which lasts until `t_s[i+1]`
(the last until t1 = t_s[0] + window_s), with `in_flight[i]` requests in flight on it.

Invariants (tests/unit/test_concurrency.py):
- `t_s[0] == t0`, `t_s` strictly increasing and inside [t0, t1); one segment per point;
- `mean_in_flight` is the exact time-weighted mean of the count over the window, `peak` its
  largest value, `idle_s` the time with none in flight: all three from the exact step function,
  before any compaction;
- `len(t_s) <= max_points`. Compaction (only when the exact function has more change points)
  merges runs of consecutive segments into one whose value is their time-weighted mean, a float
  (a segment left alone keeps its integer count). So the integral of the compact function, and
  with it its time-weighted mean, stays the exact one (up to float rounding); the first segment
  at the peak is never merged, so `max(in_flight) == peak`. Which segments merge: walking in
  time order, a segment at least `window_s / max_points` long stays alone, and shorter ones
  gather until their run reaches that length; while that yields too many points the length
  doubles. Bursts of short segments (many admissions and finishes) thus merge first, long
  stretches such as a tail stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_POINTS = 3  # the peak segment and a merged run either side of it


def _step_function(intervals: Sequence[tuple[float, float]], t0: float,
                   t1: float) -> tuple[list[tuple[float, float, int]], int]:
    """The exact segments (start, end, count) over [t0, t1], and how many requests touch it."""
    delta: dict[float, int] = {}
    requests = 0
    for admitted, finished in intervals:
        admitted, finished = float(admitted), float(finished)
        if math.isnan(admitted) or math.isnan(finished) or finished < admitted:
            raise ValueError(f"bad request interval ({admitted}, {finished}): finished before admitted or NaN")
        start, end = max(admitted, t0), min(finished, t1)
        if end <= start:
            continue
        requests += 1
        delta[start] = delta.get(start, 0) + 1
        if end < t1:
            delta[end] = delta.get(end, 0) - 1
    count, segments = 0, []
    cuts = sorted(t for t, d in delta.items() if d != 0 and t < t1)
    if not cuts or cuts[0] > t0:
        cuts.insert(0, t0)
    for i, t in enumerate(cuts):
        count += delta.get(t, 0)
        end = cuts[i + 1] if i + 1 < len(cuts) else t1
        segments.append((t, end, count))
    return segments, requests


def _merge(segments: list[tuple[float, float, int]], peak_at: int, max_points: int,
           window_s: float) -> list[tuple[float, float, float | int]]:
    """Runs of consecutive segments merged to their time-weighted mean (see the module doc)."""
    threshold = window_s / max_points
    while True:
        groups: list[list[int]] = []
        run: list[int] = []
        run_s = 0.0
        for i, (start, end, _) in enumerate(segments):
            if i == peak_at or end - start >= threshold:
                if run:
                    groups.append(run)
                    run, run_s = [], 0.0
                groups.append([i])
                continue
            run.append(i)
            run_s += end - start
            if run_s >= threshold:
                groups.append(run)
                run, run_s = [], 0.0
        if run:
            groups.append(run)
        merged: list[tuple[float, float, float | int]] = []
        for group in groups:
            start, end = segments[group[0]][0], segments[group[-1]][1]
            if len(group) == 1:
                value: float | int = segments[group[0]][2]
            else:
                value = sum((segments[i][1] - segments[i][0]) * segments[i][2] for i in group) / (end - start)
            if merged and merged[-1][2] == value:  # equal neighbours: one segment
                merged[-1] = (merged[-1][0], end, value)
            else:
                merged.append((start, end, value))
        if len(merged) <= max_points:
            return merged
        threshold *= 2  # beyond window_s only [before peak], [peak], [after peak] remain


def concurrency_summary(intervals: Sequence[tuple[float, float]], t0: float, t1: float, *,
                        max_points: int = 64) -> dict:
    """The requests in flight over [t0, t1] given each request's (admitted, finished) times.

    Returns {"t_s", "in_flight", "mean_in_flight", "peak", "window_s", "idle_s", "requests"}
    (module doc). Raises ValueError for t1 < t0, a NaN, a request finished before it was
    admitted, or max_points < 3.
    """
    t0, t1 = float(t0), float(t1)
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise ValueError(f"bad window [{t0}, {t1}]")
    if max_points < MIN_POINTS:
        raise ValueError(f"max_points must be at least {MIN_POINTS}, got {max_points}")
    window_s = t1 - t0
    if window_s == 0:
        return {"t_s": [t0], "in_flight": [0], "mean_in_flight": 0.0, "peak": 0, "window_s": 0.0,
                "idle_s": 0.0, "requests": 0}
    segments, requests = _step_function(intervals, t0, t1)
    area = sum((end - start) * n for start, end, n in segments)
    peak = max(n for _, _, n in segments)
    idle_s = sum(end - start for start, end, n in segments if n == 0)
    if len(segments) > max_points:
        peak_at = next(i for i, (_, _, n) in enumerate(segments) if n == peak)
        segments = _merge(segments, peak_at, max_points, window_s)
    return {"t_s": [s[0] for s in segments], "in_flight": [s[2] for s in segments],
            "mean_in_flight": area / window_s, "peak": peak, "window_s": window_s, "idle_s": idle_s,
            "requests": requests}


def tail_slots_idle(summary: dict, slots: int) -> float:
    """Slot-seconds left empty in the summary's window: the integral of max(0, slots - in_flight).

    Exact on a compacted summary as long as no merged run ever held more than `slots` requests
    (an engine's own limit), since then the clipping at 0 never applies inside a run.
    """
    starts = summary["t_s"]
    ends = starts[1:] + [starts[0] + summary["window_s"]]
    return sum(max(0.0, slots - n) * (end - start) for start, end, n in zip(starts, ends, summary["in_flight"]))
