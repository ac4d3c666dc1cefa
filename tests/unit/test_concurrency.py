"""`pipeline.concurrency`: requests in flight per replica as a compact step function.

Hand-checked cases (clipping, simultaneous admit/finish, idle time), then compaction: the
time-weighted mean, the peak and the idle time stay exact however many change points merge.
"""

from __future__ import annotations

import random

import pytest

from dynaresize.pipeline.concurrency import concurrency_summary, tail_slots_idle


def _area(summary: dict) -> float:
    starts = summary["t_s"]
    ends = starts[1:] + [starts[0] + summary["window_s"]]
    return sum((e - s) * n for s, e, n in zip(starts, ends, summary["in_flight"]))


def test_two_overlapping_requests_by_hand():
    # window [0, 10]: A on [0, 6), B on [2, 4): 1, 2, 1, then 0 from 6 to 10
    s = concurrency_summary([(0.0, 6.0), (2.0, 4.0)], 0.0, 10.0)
    assert s["t_s"] == [0.0, 2.0, 4.0, 6.0]
    assert s["in_flight"] == [1, 2, 1, 0]
    assert s["peak"] == 2 and s["requests"] == 2 and s["window_s"] == 10.0
    assert s["mean_in_flight"] == pytest.approx((6 + 2) / 10)
    assert s["idle_s"] == pytest.approx(4.0)
    assert tail_slots_idle(s, 2) == pytest.approx(2 * 10 - 8)  # 20 slot-seconds, 8 used


def test_intervals_are_clipped_to_the_window_and_empty_ones_dropped():
    s = concurrency_summary([(-5.0, 3.0),     # in flight when the window opens
                             (7.0, 99.0),     # still in flight when it closes
                             (-4.0, -1.0),    # over before the window
                             (10.0, 12.0),    # starts at its end: empty
                             (1.0, 1.0)],     # zero length
                            0.0, 10.0)
    assert s["t_s"] == [0.0, 3.0, 7.0] and s["in_flight"] == [1, 0, 1]
    assert s["requests"] == 2 and s["peak"] == 1
    assert s["idle_s"] == pytest.approx(4.0) and s["mean_in_flight"] == pytest.approx(0.6)


def test_a_finish_and_an_admission_at_the_same_time_is_no_change_point():
    s = concurrency_summary([(0.0, 5.0), (5.0, 8.0), (1.0, 2.0)], 0.0, 8.0)
    assert s["t_s"] == [0.0, 1.0, 2.0] and s["in_flight"] == [1, 2, 1]
    assert s["idle_s"] == 0.0 and s["mean_in_flight"] == pytest.approx(9 / 8)


def test_no_requests_and_an_empty_window():
    s = concurrency_summary([], 2.0, 5.0)
    assert s["t_s"] == [2.0] and s["in_flight"] == [0] and s["requests"] == 0
    assert s["idle_s"] == 3.0 and s["mean_in_flight"] == 0.0 and s["peak"] == 0
    assert tail_slots_idle(s, 4) == pytest.approx(12.0)
    z = concurrency_summary([(1.0, 3.0)], 2.0, 2.0)
    assert z == {"t_s": [2.0], "in_flight": [0], "mean_in_flight": 0.0, "peak": 0, "window_s": 0.0,
                 "idle_s": 0.0, "requests": 0}


@pytest.mark.parametrize("intervals, t0, t1, max_points", [
    ([(1.0, 0.0)], 0.0, 2.0, 64),               # finished before admitted
    ([(float("nan"), 1.0)], 0.0, 2.0, 64),
    ([], 3.0, 2.0, 64),                          # window backwards
    ([], 0.0, 1.0, 2),                           # too few points to keep the peak
])
def test_bad_input_is_a_value_error(intervals, t0, t1, max_points):
    with pytest.raises(ValueError):
        concurrency_summary(intervals, t0, t1, max_points=max_points)


def test_compaction_by_hand_keeps_mean_and_peak():
    # 8 slots busy with short requests for 1 s (16 change points), then one long tail of 9 s
    burst = [(0.1 * i, 0.1 * i + 0.15) for i in range(8)]
    s = concurrency_summary(burst + [(0.0, 10.0)], 0.0, 10.0, max_points=4)
    exact = concurrency_summary(burst + [(0.0, 10.0)], 0.0, 10.0, max_points=1000)
    assert len(exact["t_s"]) > 4 and len(s["t_s"]) <= 4
    assert s["peak"] == exact["peak"] == 3 and max(s["in_flight"]) == 3
    assert s["mean_in_flight"] == exact["mean_in_flight"]
    assert _area(s) == pytest.approx(10 + 8 * 0.15)
    assert s["idle_s"] == exact["idle_s"] == 0.0
    # the tail (one request from 0.85 s to 10 s) stays an exact integer segment
    assert s["t_s"][-1] == pytest.approx(0.85) and s["in_flight"][-1] == 1


@pytest.mark.parametrize("seed", range(20))
def test_compaction_preserves_mean_peak_and_bounds(seed):
    rng = random.Random(seed)
    t0, t1 = rng.uniform(-5, 5), rng.uniform(20, 60)
    intervals = []
    for _ in range(rng.randint(40, 400)):
        a = rng.uniform(t0 - 5, t1)
        intervals.append((a, a + rng.expovariate(0.3)))
    max_points = rng.choice([3, 4, 8, 16, 64])
    exact = concurrency_summary(intervals, t0, t1, max_points=10 ** 6)
    s = concurrency_summary(intervals, t0, t1, max_points=max_points)
    assert len(s["t_s"]) == len(s["in_flight"]) <= max_points
    assert s["t_s"][0] == t0 and all(a < b for a, b in zip(s["t_s"], s["t_s"][1:])) and s["t_s"][-1] < t1
    assert s["peak"] == exact["peak"] == max(exact["in_flight"]) == max(s["in_flight"])
    assert s["mean_in_flight"] == exact["mean_in_flight"]
    assert _area(s) / s["window_s"] == pytest.approx(exact["mean_in_flight"], rel=1e-9)
    assert _area(exact) / exact["window_s"] == pytest.approx(exact["mean_in_flight"], rel=1e-9)
    assert s["idle_s"] == exact["idle_s"] and s["requests"] == exact["requests"]
    # with as many slots as the peak, the compact summary's empty slot-seconds are exact too
    assert tail_slots_idle(s, exact["peak"]) == pytest.approx(tail_slots_idle(exact, exact["peak"]), rel=1e-9)
    # the exact function changes at every point and holds whole counts
    assert all(isinstance(n, int) for n in exact["in_flight"])
    assert all(a != b for a, b in zip(exact["in_flight"], exact["in_flight"][1:]))


def test_records_of_a_summary_are_json_and_fit_the_schema():
    from dynaresize.records import make_record

    s = concurrency_summary([(0.0, 1.0), (0.5, float("inf"))], 0.0, 2.0)
    rec = make_record("concurrency", step=3, device=1, **s)
    assert rec["kind"] == "concurrency" and rec["in_flight"] == [1, 2, 1] and rec["window_s"] == 2.0


def test_every_record_kind_is_documented_with_its_fields():
    """docs/records.md's table names every SCHEMA kind with exactly its required fields, in order."""
    import re
    from pathlib import Path

    from dynaresize.records import SCHEMA

    doc = (Path(__file__).resolve().parents[2] / "docs" / "records.md").read_text()
    for kind, fields in SCHEMA.items():
        row = re.search(rf"^\| `{kind}` \| ([^|]*) \|", doc, re.MULTILINE)
        assert row, f"docs/records.md has no row for {kind!r}"
        assert re.findall(r"`([^`]+)`", row.group(1)) == list(fields), kind
