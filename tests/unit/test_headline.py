"""The run's headline (`metrics.headline_rows`): the figures `dynaresize run` prints at its end
(`driver.console.closing_summary`) and `dynaresize report` puts first, from one function.

Checks each figure is derived from the summary and the simulator's prediction as stated, the time
unit follows the run (emulated, wall, simulated seconds), absent figures are left out rather than
invented, and the closing summary carries the headline rows in order.
"""

from __future__ import annotations

import pytest

from dynaresize.driver.console import closing_summary
from dynaresize.metrics import NO_PREDICTION_UNPACED, Prediction, headline_rows, time_unit_short

SUMMARY = {"steps": 4, "devices": 6, "rollout_devices_final": 3, "samples_per_s": 1.5, "total_time_s": 400.0,
           "idle_fraction": 0.338, "tail_idle_fraction": 0.064, "resizes": 3, "resizes_to_rollout": 2,
           "resizes_to_train": 1, "reward_first": 0.06445, "reward_last": 0.8395, "ledger_ok": True,
           "ledger_problems": [], "emulate": "a100:7b", "world_inits_max": 1, "groups_created": 4,
           "groups_created_critical": 0}
PRED = Prediction(start_rollout=4, static_samples_per_s=1.2, policy_samples_per_s=1.6, policy_resizes=5)


def _rows(*args, **kw) -> dict[str, tuple[str, str]]:
    return {f: (v, u) for f, v, u in headline_rows(*args, **kw)}


def test_an_emulated_runs_figures_against_the_simulators_prediction():
    rows = _rows(SUMMARY, PRED)
    assert list(rows) == ["throughput", "run time", "gain over static", "vs prediction", "resizes", "idle",
                          "tail idle", "reward", "ledger"]
    assert rows["throughput"] == ("1.500", "samples per emulated s")
    assert rows["run time"] == ("400.0", "emulated s of the steps (startup left out)")
    assert rows["gain over static"][0] == "1.25x" and "1.200 samples per emulated s" in rows["gain over static"][1]
    assert "(4 rollout)" in rows["gain over static"][1]
    assert rows["vs prediction"][0] == "0.938" and "(5 resizes)" in rows["vs prediction"][1]
    assert rows["resizes"] == ("3", "2 to rollout, 1 to train")
    assert rows["idle"][0] == "33.8%" and rows["tail idle"][0] == "6.4%"
    assert rows["reward"][0] == "0.064 -> 0.840" and rows["ledger"][0] == "ok"


def test_an_unpaced_run_is_in_wall_seconds_and_says_why_it_has_no_prediction():
    rows = _rows({**SUMMARY, "emulate": None}, no_prediction=NO_PREDICTION_UNPACED)
    assert rows["throughput"] == ("1.500", "samples per wall s") and rows["run time"] == ("400.0", "wall s")
    assert rows["gain over static"] == ("n/a", NO_PREDICTION_UNPACED) and "vs prediction" not in rows


def test_a_failed_ledger_shows_its_problems_and_absent_figures_are_left_out():
    rows = _rows({**SUMMARY, "ledger_ok": False, "ledger_problems": ["sample 0-1-2 consumed twice", "b", "c", "d"]})
    assert rows["ledger"] == ("FAILED", "sample 0-1-2 consumed twice; b; c")
    sim = _rows({k: SUMMARY[k] for k in ("samples_per_s", "total_time_s", "idle_fraction", "resizes")},
                simulated=True)
    assert list(sim) == ["throughput", "run time", "resizes", "idle"]  # no reward, ledger or prediction invented
    assert sim["throughput"][1] == "samples per simulated s" and sim["resizes"] == ("3", "each way not recorded")
    assert time_unit_short({"emulate": "h100:7b"}, simulated=True) == "simulated s"


@pytest.mark.parametrize("bad", [dict(static_samples_per_s=0.0), dict(policy_samples_per_s=-1.0),
                                 dict(start_rollout=-1), dict(policy_resizes=-2)])
def test_a_prediction_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        Prediction(**{**PRED.__dict__, **bad})


def test_the_closing_summary_carries_the_headline_rows_in_order():
    text = closing_summary(SUMMARY, "runs/demo", prediction=PRED, best_static=(3, 1.55))
    lines = text.splitlines()
    expected = [f"{f:<18}{v}  {u}" for f, v, u in headline_rows(SUMMARY, PRED)]
    start = lines.index(expected[0])
    assert lines[start:start + len(expected)] == expected
    assert lines[0] == "run directory     runs/demo"
    assert "ledger            ok" in text  # what a job's stdout is checked for (tests/e2e/test_job_submit.py)
    assert "best static       1.550" in text and "3 rollout" in text


def test_an_unpaced_runs_closing_summary_says_why_there_is_no_prediction():
    from dynaresize.commands.run import run_closing_summary
    from dynaresize.config_load import build_config

    cfg = build_config({"cluster": {"devices": 4, "rollout_devices": 2}})
    assert cfg.cluster.emulate is None
    text = run_closing_summary(cfg, {**SUMMARY, "emulate": None}, "runs/x")
    assert f"gain over static  n/a  {NO_PREDICTION_UNPACED}" in text and "vs prediction" not in text
