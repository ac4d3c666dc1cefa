"""The math task offline (`--preset math`): the math-verify grader scores 1 for a correct answer
in each supported format and 0 otherwise when called through the reward pool from a Ray actor
(as on a worker), and the preset runs end to end on this CPU machine with resizes each way."""

from __future__ import annotations

import json

import pytest

from _runs import ray_local, records  # noqa: F401

pytestmark = pytest.mark.dist

# (ground truth, response, score): every supported answer format, right and wrong.
CASES = [
    ("14", "Tom has 12 - 5 + 7 = 14 apples.\n#### 14", 1.0),  # GSM8K's "####"
    ("14", "So the answer is \\boxed{14}.", 1.0),  # \boxed{}
    ("14", "14", 1.0),  # a plain number
    ("14", "He has 14 apples left.", 1.0),  # a plain number in a sentence
    ("3/8", "#### 3/8", 1.0),  # a fraction after ####
    ("3/8", "\\boxed{\\frac{3}{8}}", 1.0),  # a LaTeX fraction
    ("3/8", "The fraction is 6/16", 1.0),  # an equal fraction
    ("3/8", "0.375", 1.0),  # its decimal
    ("14", "#### 15", 0.0),
    ("14", "\\boxed{41}", 0.0),
    ("14", "12 + 2 = 14, so minus 1 is 13", 0.0),  # the last number counts
    ("3/8", "#### 8/3", 0.0),
    ("14", "bako bemi tedu", 0.0),  # no answer at all
    ("14", "", 0.0),
]


def test_the_grader_in_the_reward_pool_of_a_ray_actor(ray_local):
    import ray

    @ray.remote(num_cpus=0.5)
    class Grader:
        def grade(self, cases):
            from dynaresize.rl.reward_pool import RewardPool

            pool = RewardPool("dynaresize.rl.math_task:compute_score", "verl", workers=2, timeout_s=60.0)
            try:
                calls = [{"step": 0, "prompts": ["q"], "completions": [resp], "completion_ids": [[]],
                          "fields": [{"data_source": "dynaresize/arith", "ground_truth": gt}]} for gt, resp, _ in cases]
                return pool.run(calls)
            finally:
                pool.close()

    outcomes = ray.get(Grader.remote().grade.remote(CASES), timeout=300)
    for (gt, resp, want), (kind, result) in zip(CASES, outcomes):
        assert kind == "ok", (resp, result)
        assert result["values"] == [want], (gt, resp, result)
    assert [o[1]["metrics"]["answered"] for o in outcomes][-2:] == [[0.0], [0.0]]


@pytest.mark.slow  # ~31 s; its grader in the reward pool runs in the default suite (above)
def test_the_math_preset_runs_end_to_end_with_resizes_each_way(ray_local, tmp_path, monkeypatch, capsys):
    from dynaresize.cli import main

    monkeypatch.setenv("DYNARESIZE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "math"
    assert main(["run", "--no-progress", "--preset", "math", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "task arith: 512 problems" in err and "verl style" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["resizes_to_rollout"] >= 1 and summary["resizes_to_train"] >= 1, summary
    moves = [(len(r["from"]["rollout"]), len(r["to"]["rollout"])) for r in records(out, "resize")]
    assert moves == [(2, 1), (1, 2)]
    samples = records(out, "sample")
    assert len(samples) == 6 * 4 * 4 and all(s["reward"] in (0.0, 1.0) and s["reward_error"] is None for s in samples)
    assert (tmp_path / "cache" / "arith-v1-512-2024.parquet").is_file()
