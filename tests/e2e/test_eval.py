"""Evaluation on a real short run: the job of _runs.py (4 CPU devices, 4 deterministic steps, a
scripted resize after step 1) evaluating every 2 steps on 4 held-out prompts x 4 samples.

- `eval` records after steps 1 and 3 (the last), each of the weights just synced (version
  step+1), with mean reward and pass@1/2/4 over 16 samples, run on the rollout pool of that
  moment (after the resize: 3 rollout devices);
- the ledger holds the training samples only and proves them (`ledger_ok`);
- training is untouched: every training sample has the tokens of the same run without
  evaluation (the shared reference run) and the final parameters are equal.
"""

from __future__ import annotations

import json

import pytest

from _runs import assert_same_run, job_config, ray_local, records, reference_run, samples  # noqa: F401

pytestmark = pytest.mark.dist


@pytest.mark.slow  # ~35 s; the default suite's streaming static run evaluates too (test_staleness_run.py)
def test_eval_records_at_their_steps_and_training_unchanged(ray_local, tmp_path):  # noqa: F811
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    cfg = job_config(eval={"every_steps": 2, "num_prompts": 4, "samples_per_prompt": 4})
    summary = run_job(cfg, out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]

    evals = records(out, "eval")
    assert [(r["step"], r["version"]) for r in evals] == [(1, 2), (3, 4)]
    for r in evals:
        assert r["num_samples"] == 16 and r["samples_per_prompt"] == 4 and r["num_prompts"] == 4
        assert 0 <= r["pass_at_1"] <= r["pass_at_2"] <= r["pass_at_4"] <= 1
        assert 0 <= r["reward_mean"] <= 1 and r["eval_s"] > 0
    assert summary["eval"] == {k: v for k, v in evals[-1].items() if k.startswith(("reward_", "pass_at_"))}

    # on the rollout pool of the moment: after the resize decided after step 1, devices 0, 1, 2
    spans = [s for s in records(out, "span") if s["name"] == "eval"]
    assert {s["step"] for s in spans} == {1, 3} and {s["device"] for s in spans} <= {0, 1, 2}

    # eval samples are not training samples: the ledger has the 4 x 16 training ids only
    ids = set(samples(out))
    assert len(ids) == 64 and all(not i.startswith("-") for i in ids)
    assert json.loads((out / "summary.json").read_text())["ledger_ok"]
    assert_same_run(out, reference_run())  # same tokens per sample id, same final parameters
