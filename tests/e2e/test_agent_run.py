"""End to end: multi-turn, tool-using rollouts on the real runtime (Ray + gloo, CPU), issue 24.

- Deterministic mode, streaming (staleness 2): a run of the calculator task with a move each way
  (the rollout -> train one migrates trajectories in flight, with their history) equals a static
  run (both with a calculator that answers after `TOOL_LATENCY_S`, as a remote tool does: each
  trajectory waits on it up to three times, so rollout outlasts a training step whatever the
  machine's speed, and the first move finds trajectories in flight to hand on): the same tokens per trajectory (prompt turns and observations alike), final parameters
  within 1e-6, every trajectory one ledger entry with its turns and why it ended.
- `--preset agent` runs with resizes each way on the HF engine and on vLLM (slow), ledger ok.
- An environment that fails is handled as a reward error: scored 0 with the reason, or the run
  stops with the reason (`task.on_reward_error`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")

from dynaresize.config_load import build_config
from dynaresize.driver.run import run_job
from dynaresize.presets import preset
from dynaresize.records import read_records

from _runs import ray_local  # noqa: F401

pytestmark = pytest.mark.dist

STEPS = 5
TOOL_LATENCY_S = 1.5
SLOW_CALCULATOR = f'''
import time

from dynaresize.rl.agent_task import CalculatorEnv


class SlowCalculator(CalculatorEnv):
    def step(self, action):
        time.sleep({TOOL_LATENCY_S})
        return super().step(action)
'''
BROKEN_ENV = '''
class Env:
    def reset(self, sample):
        self.n = 0
        return None

    def step(self, action):
        self.n += 1
        if self.n == 2:
            raise RuntimeError("the tool server is down")
        return " again :", 0.5, False
'''


def _cfg(tmp: Path | None = None, **over):
    data = preset("agent")
    data.update(steps=STEPS, deterministic=True)
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "hf"}
    for key, value in over.items():
        section, _, name = key.partition("__")
        data[section] = {**data.get(section, {}), name: value} if name else value
    return build_config(data)


@pytest.fixture(scope="module")
def agent_pair(ray_local, tmp_path_factory):
    base = tmp_path_factory.mktemp("agent")
    env = base / "slow_calculator.py"
    env.write_text(SLOW_CALCULATOR)
    task = {**preset("agent")["task"], "env": f"{env}:SlowCalculator"}
    s1 = run_job(_cfg(train__staleness=2, task=task, policy={"name": "scripted", "schedule": "2:1,4:3"}),
                 base / "moves", progress=False)
    s2 = run_job(_cfg(train__staleness=2, task=task, policy={"name": "static:2"}), base / "static", progress=False)
    return base / "moves", s1, base / "static", s2


@pytest.mark.slow
def test_a_multi_turn_run_with_resizes_equals_a_static_run(agent_pair):
    from safetensors.torch import load_file

    out1, s1, out2, s2 = agent_pair
    for s in (s1, s2):
        assert s["ledger_ok"], s["ledger_problems"]
    assert s1["resizes_to_rollout"] == 1 and s1["resizes_to_train"] == 1
    resizes = list(read_records(out1 / "records.jsonl", "resize"))
    assert resizes[0]["requests_moved"] > 0  # trajectories handed on mid-way
    a = {s["sample_id"]: s for s in read_records(out1 / "records.jsonl", "sample")}
    b = {s["sample_id"]: s for s in read_records(out2 / "records.jsonl", "sample")}
    assert len(a) == STEPS * 16 and {k: v["token_sha1"] for k, v in a.items()} == {k: v["token_sha1"] for k, v in b.items()}
    assert {k: (v["turns"], v["stop_reason"]) for k, v in a.items()} == {k: (v["turns"], v["stop_reason"]) for k, v in b.items()}
    reasons = Counter(v["stop_reason"] for v in a.values())
    assert max(v["turns"] for v in a.values()) == 3 and reasons["max_turns"] > 0, reasons
    assert all(v["consumed_step"] == int(k.split("-")[0]) and v["reward_error"] is None for k, v in a.items())
    w1 = load_file(str(out1 / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(out2 / "checkpoint" / "model.safetensors"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6


@pytest.mark.slow
def test_a_failing_environment_scores_zero_with_the_reason_or_stops_the_run(ray_local, tmp_path):
    from dynaresize.driver.recovery import RunStopped
    from dynaresize.errors import RewardError

    env = tmp_path / "broken_env.py"
    env.write_text(BROKEN_ENV)
    over = dict(steps=1, task={"name": "agent-guess", "env": f"{env}:Env", "max_turns": 3, "max_total_tokens": 320,
                               "on_reward_error": "zero"}, policy={"name": "static:2"})
    summary = run_job(_cfg(**over), tmp_path / "zero", progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    samples = list(read_records(tmp_path / "zero" / "records.jsonl", "sample"))
    assert len(samples) == 16
    for s in samples:  # the first step gave 0.5, the second raised: scored 0, the reason kept, consumed
        assert s["reward"] == 0.0 and s["stop_reason"] == "env_error" and s["turns"] == 2
        assert "the tool server is down" in s["reward_error"] and s["consumed_step"] == 0
    over["task"] = {**over["task"], "on_reward_error": "fail"}
    with pytest.raises((RewardError, RunStopped), match=r"sample 0-\d+-\d+: environment .*broken_env.py:Env step raised "
                                          r"RuntimeError: the tool server is down"):
        run_job(_cfg(**over), tmp_path / "fail", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_the_agent_preset_runs_with_resizes_each_way(ray_local, tmp_path, engine):
    from dynaresize.cli import main

    out = tmp_path / engine
    assert main(["run", "--no-progress", "--preset", "agent", "--set", f"rollout.engine={engine}",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    moves = [(len(r["from"]["rollout"]), len(r["to"]["rollout"])) for r in read_records(out / "records.jsonl", "resize")]
    assert moves == [(2, 1), (1, 2)]
    samples = list(read_records(out / "records.jsonl", "sample"))
    assert len(samples) == 6 * 16 and all(1 <= s["turns"] <= 3 for s in samples)
    assert any(s["turns"] > 1 for s in samples)
