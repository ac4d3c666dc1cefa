"""The user's job as they already have it (issue 21): a verl-schema parquet file with chat
prompts and a verl `compute_score`, a TRL-style JSONL and TRL reward function, each run
unchanged through `dynaresize run`; rewards that raise or hang handled as configured, with the
sample id in the message; a bad dataset is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _runs import ray_local, records  # noqa: F401
from dynaresize.rl.dataset import write_parquet

pytestmark = pytest.mark.dist

VERL_REWARD = '''
import re


def extract_solution(solution_str):
    found = re.findall("#### (\\\\-?[0-9\\\\.\\\\,]+)", solution_str[-300:])
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function signature, as a user's file has it."""
    answer = extract_solution(solution_str)
    shaped = 0.1 * (len(solution_str) % 5) / 4  # some spread inside a group for the tiny model
    return {"score": 1.0 if answer == ground_truth else shaped, "answered": float(answer is not None)}
'''

TRL_REWARD = '''
async def accuracy_reward(completions, solution, kind, **kwargs):
    """TRL-style: one value per completion; None where the reward does not apply."""
    return [None if k == "chat" else float(c.strip() == s) + 0.01 * len(c) for c, s, k in zip(completions, solution, kind)]
'''

FLAKY_REWARD = '''
import time


def score(prompt, response, fields):
    if "HANG" in prompt:
        time.sleep(60)
    if "RAISE" in prompt:
        raise RuntimeError("grader crashed")
    return float(len(response) % 3)
'''

SMALL = ["--preset", "user", "--devices", "2", "--rollout-devices", "1", "--steps", "2", "--policy", "static",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.max_new_tokens=12", "--set", "rollout.engine=hf"]


def _run(tmp_path: Path, *argv: str) -> int:
    from dynaresize.cli import main

    return main(["run", "--no-progress", *SMALL, "--out", str(tmp_path / "r"), *argv])


def _samples(out: Path) -> dict[str, dict]:
    return {r["sample_id"]: r for r in records(out, "sample")}


def test_verl_parquet_and_compute_score_run_unchanged(ray_local, tmp_path, capsys):
    data = tmp_path / "train.parquet"
    write_parquet([{"data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": f"Tom has {a} apples and buys {a}. How many? "
                                                           "Let's think step by step and output the final "
                                                           "answer after \"####\"."}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
                    "extra_info": {"split": "train", "index": a}} for a in range(4)], data)
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    code = _run(tmp_path, "--set", f"task.dataset={data}", "--set", f"task.reward={tmp_path / 'reward.py'}:compute_score")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "train.parquet: 4 rows, verl schema" in err and "compute_score: verl style" in err  # the printout
    out = tmp_path / "r"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    samples = _samples(out)
    assert len(samples) == 2 * 2 * 4 and all(s["consumed_step"] is not None for s in samples.values())
    assert all(s["reward_error"] is None and 0.0 <= s["reward"] <= 1.0 for s in samples.values())
    assert len({s["reward"] for s in samples.values()}) > 1  # scored by the file's function, sample by sample
    assert json.loads((out / "config.json").read_text())["task"]["dataset"] == str(data)
    steps = records(out, "step")  # the dict's other key is a per-step metric, the mean of its samples
    for st in steps:
        mine = [s for s in samples.values() if s["consumed_step"] == st["step"]]
        assert 0.0 <= st["reward_metrics"]["answered"] <= 1.0 and st["reward_left_out"] == 0
        assert abs(st["reward_mean"] - sum(s["reward"] for s in mine) / len(mine)) < 1e-9


def test_trl_jsonl_and_reward_function_run_unchanged(ray_local, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {a} times 2?", "solution": str(2 * a), "kind": "math"} for a in range(3)]
    rows.append({"prompt": "Say hello.", "solution": "", "kind": "chat"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
    code = _run(tmp_path, "--set", f"task.dataset={data}",
                "--set", f"task.reward={tmp_path / 'trl_reward.py'}:accuracy_reward")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "4 rows, trl schema" in err and "accuracy_reward: trl style" in err
    summary = json.loads((Path(tmp_path) / "r" / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    samples = _samples(tmp_path / "r")
    left = {k: s for k, s in samples.items() if s["reward_error"]}
    assert len(left) == 4  # the chat row's group (2 steps x 2 prompts cover the 4 rows once)
    for sid, s in left.items():  # recorded, never lost: consumed by its step, with why
        assert s["reward_error"].startswith(f"left out: sample {sid}: reward function ")
        assert "returned None" in s["reward_error"] and s["consumed_step"] == int(sid.split("-")[0])
    assert all(s["reward"] >= 0.0 for k, s in samples.items() if k not in left)
    steps = records(tmp_path / "r", "step")  # left out: counted per step, outside the mean
    assert sum(st["reward_left_out"] for st in steps) == len(left)
    for st in steps:
        kept = [s["reward"] for k, s in samples.items() if s["consumed_step"] == st["step"] and k not in left]
        assert abs(st["reward_mean"] - sum(kept) / max(1, len(kept))) < 1e-9


@pytest.mark.slow  # ~23 s; raising and hanging rewards under on_reward_error are unit-tested (tests/unit/test_reward_pool.py)
def test_a_reward_that_raises_or_hangs_follows_on_reward_error(ray_local, tmp_path, capsys):
    data = tmp_path / "flaky.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("fine one", "HANG here", "RAISE here", "fine")))
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    common = ("--set", f"task.dataset={data}", "--set", f"task.reward={tmp_path / 'flaky.py'}:score",
              "--set", "task.reward_timeout_s=1")
    assert _run(tmp_path, *common, "--set", "task.on_reward_error=zero") == 0
    samples = _samples(tmp_path / "r")
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["ledger_ok"]
    bad = {k: s["reward_error"] for k, s in samples.items() if s["reward_error"]}
    assert len(bad) == 8 and all(samples[k]["reward"] == 0.0 for k in bad)
    assert all(e.startswith(f"sample {k}: reward function {tmp_path / 'flaky.py'}:score ") for k, e in bad.items())
    assert sum("timed out after 1 s (its reward worker was killed and replaced)" in e for e in bad.values()) == 4
    assert sum(e.endswith("raised RuntimeError: grader crashed") for e in bad.values()) == 4
    capsys.readouterr()

    fail = tmp_path / "fail"
    fail.mkdir()
    assert _run(fail, *common) == 1  # on_reward_error=fail (the default): the step stops cleanly
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("dynaresize: run stopped:") and "reward function" in line
    assert any(f"sample {s}-{p}-" in line for s in (0, 1) for p in (0, 1))  # the sample id of the first bad one
    assert json.loads((fail / "r" / "summary.json").read_text())["ledger_ok"]


@pytest.mark.parametrize("kind, needle", [
    ("parquet-row", ': row 2: missing field "reward_model.ground_truth"'),
    ("parquet-field", ': row 1: "prompt"[0].content must be a string'),
    ("jsonl-field", ':3: "prompt" must be a string or a list of chat messages, got int'),
    ("not-parquet", ": not a readable parquet file"),
])
def test_a_bad_dataset_is_one_line_exit_2_nothing_written(tmp_path, capsys, kind, needle):
    ok = {"data_source": "d", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
          "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}
    if kind == "jsonl-field":
        data = tmp_path / "bad.jsonl"
        data.write_text('{"prompt": "a"}\n\n{"prompt": 3}\n')
    else:
        data = tmp_path / "bad.parquet"
        if kind == "not-parquet":
            data.write_text("a,b\n1,2\n")
        elif kind == "parquet-row":
            write_parquet([ok, ok, {**ok, "reward_model": {"style": "rule", "ground_truth": None}}], data)
        else:
            write_parquet([ok, {**ok, "prompt": [{"role": "user", "content": None}]}], data)
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    code = _run(tmp_path, "--set", f"task.dataset={data}", "--set", f"task.reward={tmp_path / 'reward.py'}:compute_score")
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and str(data) in err, err
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # nothing written
