"""Bad input: each gives a clear one-line error (or a recorded refusal) and damages nothing.

- malformed config and fault specs: every error listed, exit 2;
- an empty or malformed prompt file: exit 2 with the file and line, before anything is written
  (also when resuming: the run directory stays byte for byte as it was);
- a reward function that raises or returns a non-number: with `task.on_reward_error=fail` the
  step stops cleanly (exit 1, one line) with a consistent checkpoint, and `--resume` finishes
  the run with nothing lost; with `zero` it scores 0 and the sample record says why;
- a scripted schedule the bounds forbid: refused with a reason in the records, the run goes on.
(A corrupt or partial checkpoint on resume: tests/e2e/test_resume.py.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from _runs import job_data, ray_local, records  # noqa: F401

pytestmark = pytest.mark.dist

REWARDS = '''
calls = {"n": 0}


def flaky(prompt, response, fields):
    """Raises on every 5th call, returns a string on every 7th, else a number."""
    calls["n"] += 1
    if calls["n"] % 5 == 0:
        raise ValueError("boom")
    if calls["n"] % 7 == 0:
        return "high"
    return float(len(response) % 3)


def fails_from_step_1(prompt, response, fields):
    calls["n"] += 1
    if calls["n"] > 16:  # 16 samples a step: step 0 scores, step 1 fails
        raise RuntimeError("reward service unavailable")
    return 1.0


def good(prompt, response, fields):
    return 1.0
'''


def _run(*argv: str) -> int:
    from dynaresize.cli import main

    preset = [] if "--resume" in argv else ["--preset", "cpu"]  # this machine's own speed (a resume keeps its config)
    return main(["run", "--no-progress", *preset, *argv])


def _config_file(tmp_path: Path, **over) -> Path:
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.json')))}.json"
    path.write_text(json.dumps(job_data(**over)))
    return path


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_malformed_config_and_faults_list_every_error(tmp_path, capsys):
    out = tmp_path / "r"
    code = _run("--out", str(out), "--set", "cluster.devices=x", "--set", "timeouts.collective_s=-1",
                "--inject", "kill:1@nowhere:2", "--inject", "explode:1@train:2")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    for needle in ("cluster.devices='x'", "collective_s=-1", "kill:1@nowhere:2", "explode:1@train:2"):
        assert needle in err, needle
    code = _run("--out", str(out), "--devices", "4", "--inject", "kill:7@train:1")
    assert code == 2 and "device 7 outside 0..3" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (("--set", "policy.min_train=2"), "cluster.rollout_devices=3: the starting split breaks"),
    (("--set", "policy.move_unit=2"), "not a multiple of move_unit 2"),
    (("--set", "rollout.length_workload=bogus"), "rollout.length_workload='bogus': neither a known workload"),
    (("--set", "train.dtype=bf16", "--deterministic"), "train.dtype='bf16': deterministic mode needs fp32"),
    # the loss variants (docs/training.md): each bad value names its field and value
    (("--set", "rollout.samples_per_prompt=1"), ("rollout.samples_per_prompt=1: must be >= 2 for GRPO: "
                                                 "train.norm_adv_by_std=True divides by the group's std")),
    (("--set", "train.loss_agg_mode=seq-mean"), "train.loss_agg_mode='seq-mean': must be one of token-mean"),
    (("--set", "train.clip_ratio_c=0.5"), "train.clip_ratio_c=0.5: must be > 1"),
    (("--set", "train.clip_ratio_high=-1"), "train.clip_ratio_high=-1.0: must be > 0"),
    (("--set", "train.clip_eps=0.1", "--set", "train.clip_ratio_low=0.2", "--set", "train.clip_ratio_high=0.28"),
     "train.clip_eps=0.1: unused when clip_ratio_low and clip_ratio_high are both set"),
    (("--set", "train.adv_std=biased"), "train.adv_std='biased': must be sample or population"),
    (("--set", "train.entropy_coef=-0.01"), "train.entropy_coef=-0.01: must be >= 0"),
    (("--set", "train.kl_penalty=reward"), "train.kl_penalty='reward': not supported"),
])
def test_what_the_run_cannot_start_with_is_a_config_error(tmp_path, capsys, args, needle):
    out = tmp_path / "r"
    code = _run("--out", str(out), *args)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if needle in line]) == 1  # one line
    assert not out.exists()


@pytest.mark.parametrize("content, needle", [
    ("", "no prompts (the file is empty)"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', ":2: bad JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', ':2: missing "prompt" field'),
])
def test_bad_prompt_file_exits_2_naming_the_line(tmp_path, capsys, content, needle):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = tmp_path / "r"
    code = _run("--out", str(out), "--set", f"task.prompts_file={prompts}",
                "--set", "task.reward=dynaresize.rl.tasks:toy_count_reward")
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and str(prompts) in err and "\n" not in err
    assert not out.exists()  # nothing was written


def test_failing_reward_stops_cleanly_then_resume_scores_bad_rewards_zero_and_refuses_a_forbidden_move(
        ray_local, tmp_path, capsys):
    """One job on 2 devices: step 1's reward fails (on_reward_error=fail): clean stop, checkpoint.
    Resumed with a flaky reward (raises or returns a string now and then) scored as zero, and a
    scripted move to 2 rollout devices that leaves none to train: refused, recorded; it finishes."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    out = tmp_path / "r"
    cfg = _config_file(tmp_path, steps=3, cluster={"devices": 2, "rollout_devices": 1},
                       policy={"name": "static"}, task={"reward": f"{rewards}:fails_from_step_1", "on_reward_error": "fail"})
    assert _run("--config", str(cfg), "--out", str(out)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dynaresize: run stopped:") and "reward service unavailable" in err
    assert "checkpoint of step 1" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] and summary["ledger_ok"], summary["ledger_problems"]
    dropped = {r["sample_id"]: r for r in records(out, "sample") if r["dropped"]}
    assert dropped and {s.split("-")[0] for s in dropped} == {"1"}  # step 0 consumed, step 1 not
    (stop,) = [r for r in records(out, "checkpoint") if r["cause"] == "stop"]
    assert stop["step"] == 1 and stop["written_by"] == "trainers"  # every trainer alive: they write it

    # a bad prompt file given on resume: exit 2 naming the line, the run directory untouched
    tree = _tree(out)
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "a"}\nnot json\n')
    code = _run("--resume", str(out), "--set", f"task.prompts_file={prompts}")
    assert code == 2 and f"{prompts}:2: bad JSON" in capsys.readouterr().err
    assert _tree(out) == tree

    before = (out / "records.jsonl").read_bytes()
    assert _run("--resume", str(out), "--set", f"task.reward={rewards}:flaky", "--set", "task.on_reward_error=zero",
                "--policy", "scripted", "--schedule", "2:2") == 0
    assert (out / "records.jsonl").read_bytes().startswith(before)  # appended; nothing rewritten
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["resizes"] == 0 and summary["stopped"] is None
    (refused,) = records(out, "refused")
    assert refused["requested_rollout"] == 2 and "min_train" in refused["reason"]
    said = [line for line in capsys.readouterr().err.splitlines() if "resize refused" in line]
    assert len(said) == 1 and "2 rollout devices" in said[0] and "min_train" in said[0]  # said, not only recorded
    last = {}
    for r in records(out, "sample"):
        last[r["sample_id"]] = r
    assert len(last) == 3 * 16 and all(r["consumed_step"] == int(k.split("-")[0]) for k, r in last.items())
    assert all(last[k]["seed"] == r["seed"] for k, r in dropped.items())  # regenerated with the same seeds
    errors = [r for r in last.values() if r["reward_error"]]
    assert any("raised ValueError: boom" in r["reward_error"] for r in errors)
    assert any("returned str, not a number" in r["reward_error"] for r in errors)
    assert all(r["reward"] == 0.0 for r in errors)
