"""The pieces of multi-turn tasks that need no engine: the example environments and the tool
helper, loading an environment by name, the config's refusals, the job's scoring of
trajectories (environment rewards, failures as reward errors, the ledger's turns and reasons,
the loss mask on train samples), and the GRPO loss over the model's tokens only."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dynaresize.config_load import build_config, merge
from dynaresize.errors import ConfigError, RewardError, UserError
from dynaresize.presets import preset
from dynaresize.rl import grpo
from dynaresize.rl.agent_task import CalculatorEnv, GuessEnv, calculator
from dynaresize.rl.env import check_step, load_env, parse_tool_call, run_call

TINY = {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 600}}


def test_the_calculator_env_scores_only_a_right_answer_after_a_tool_call():
    env = CalculatorEnv()
    assert env.reset({"prompt": "q", "answer": 408}) is None
    obs, reward, done = env.step("408")  # right, but no tool was called
    assert (obs, reward, done) == (None, 0.0, True)
    env.reset({"prompt": "q", "answer": 408})
    obs, reward, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert obs == [{"role": "tool", "content": "408"}] and (reward, done) == (0.0, False)
    assert env.step("so it is 408")[1:] == (1.0, True)
    env.reset({"prompt": "q", "answer": 408})
    assert env.step("bako kedo")[1:] == (0.0, False)  # neither a call nor a number: a reminder
    obs, _, _ = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>')
    assert obs[0]["content"].startswith("error: ValueError")
    obs, _, _ = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert "no tool 'search'" in obs[0]["content"]


def test_tool_calls_parse_or_say_why_not():
    assert parse_tool_call("no call") is None
    assert parse_tool_call('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>') == ("f", {"x": 1})
    assert "not JSON" in parse_tool_call("<tool_call>{oops</tool_call>")
    assert "names no tool" in parse_tool_call('<tool_call>{"arguments": {}}</tool_call>')
    assert calculator("(2+3)*4") == "20" and calculator("7/2") == "3.5"


def test_the_guessing_game_has_two_turns():
    env = GuessEnv()
    env.reset({"prompt": "q", "secret": 6})
    obs, reward, done = env.step("3")
    assert "higher" in obs and (reward, done) == (0.0, False)
    assert env.step("6")[1:] == (0.5, True)
    env.reset({"prompt": "q", "secret": 6})
    assert env.step("6")[1:] == (1.0, True)


def test_environments_load_by_name_and_may_be_async(tmp_path):
    f = tmp_path / "my_env.py"
    f.write_text("class Env:\n    async def reset(self, sample):\n        return 'hi'\n"
                 "    async def step(self, action):\n        return None, 1, True\n\nclass NotOne:\n    pass\n")
    cls = load_env(f"{f}:Env")
    env = cls()
    assert run_call(env.reset, {}) == "hi" and check_step(run_call(env.step, "x")) == (None, 1.0, True)
    with pytest.raises(UserError, match="task.env .*NotOne.*missing: reset, step"):
        load_env(f"{f}:NotOne")
    with pytest.raises(UserError, match="task.env 'nowhere:Env': module 'nowhere' not found"):
        load_env("nowhere:Env")
    assert asyncio.iscoroutinefunction(cls.step)


@pytest.mark.parametrize("base,over,fragment", [
    ("cpu", {"task": {"max_turns": 2}}, "task.max_turns=2: only read by a multi-turn task"),
    ("agent", {"task": {"reward": "m:f"}}, "task.reward='m:f': unused with a multi-turn task"),
    ("agent", {"rollout": {"synthetic_lengths": True}}, "rollout.synthetic_lengths=True"),
    ("agent", {"eval": {"every_steps": 2}}, "eval.every_steps=2: evaluation of a multi-turn"),
    ("agent", {"task": {"env": "noclass"}}, "task.env='noclass': must be module:Class or file.py:Class"),
])
def test_the_config_refuses_what_a_multi_turn_task_cannot_use(base, over, fragment):
    data = merge(merge(preset(base), TINY), over)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        build_config(data)


def _scored(on_error: str, errors: dict):
    from dynaresize.driver.job import Job
    from dynaresize.driver.ledger import Ledger
    from dynaresize.roles.base import GenResult

    cfg = build_config(merge(merge(preset("agent"), TINY), {"task": {"on_reward_error": on_error}}))
    job = Job(cfg)
    results = []
    for g in job.requests(0):
        for r in g:
            assert r.env_sample is not None and "answer" in r.env_sample
            p, s = r.sample_id[1], r.sample_id[2]
            err = errors.get(r.sample_id)
            results.append((0, GenResult(sample_id=r.sample_id, response_ids=[5, 6, 7, 8], logprobs=[-1.0, 0.0, 0.0, -2.0],
                                         version=0, duration_s=0.0, loss_mask=(1, 0, 0, 1), turns=2,
                                         env_reward=0.0 if err else float(s % 2), stop_reason="env_error" if err
                                         else "max_turns", env_error=err)))
    ledger = Ledger(staleness=1)
    return job.score(0, results, ledger), ledger


def test_the_job_scores_trajectories_by_their_environment_and_keeps_their_mask():
    bad = (0, 0, 0)
    errors = {}
    scored, ledger = _scored("zero", errors)
    assert [s.loss_mask for s in scored.samples] == [(1, 0, 0, 1)] * 16
    assert scored.rewards == [float(sid[2] % 2) for sid in sorted(ledger.entries)]
    e = ledger.entries[bad]
    assert (e.turns, e.stop_reason, e.reward_error) == (2, "max_turns", None)
    errors = {bad: "environment x step raised KeyError: 'k'"}
    sid0 = sorted(ledger.entries)[0]
    scored, ledger = _scored("zero", errors)
    e = ledger.entries[sid0]
    assert e.reward == 0.0 and e.stop_reason == "env_error" and "raised KeyError" in e.reward_error
    assert e.reward_error.startswith(f"sample {sid0[0]}-{sid0[1]}-{sid0[2]}: environment x")
    with pytest.raises(RewardError, match="environment x step raised KeyError"):
        _scored("fail", {sid0: "environment x step raised KeyError: 'k'"})
    assert grpo.total_response_tokens(scored.samples) == 16 * 2  # the model's tokens only


def _sample(mask, logprobs, adv=1.0):
    return grpo.TrainSample(sample_id=(0, 0, 0), prompt_ids=[3, 4, 5], response_ids=[6, 7, 8, 9],
                            rollout_logprobs=logprobs, advantage=adv, loss_mask=mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_loss_counts_the_models_tokens_only(mode):
    from dynaresize.config import ModelConfig
    from dynaresize.rl.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=600))
    kw = dict(denominator=1.0, clip_eps=0.2, kl_coef=0.1, loss_agg_mode=mode, entropy_coef=0.01)
    with torch.no_grad():
        logp = grpo.response_logprobs(model, [_sample((), [0.0] * 4)])[0]
    ref = [logp.tolist()[i] - 0.3 for i in range(4)]
    masked = _sample((1, 0, 0, 1), [-2.0, 0.0, 0.0, -1.5])
    other_obs = _sample((1, 0, 0, 1), [-2.0, -9.0, 3.0, -1.5])  # observation tokens' log-probs: not looked at
    stats: dict = {}
    a = grpo.micro_batch_loss(model, [masked], ref_logprobs=[ref], stats=stats, **kw)
    b = grpo.micro_batch_loss(model, [other_obs], ref_logprobs=[[ref[0], 5.0, -5.0, ref[3]]], **kw)
    assert torch.equal(a, b) and stats["num_tokens"] == 2
    # the same as a sample of the model's tokens alone, scored at their positions by hand
    ratio = torch.exp(logp[[0, 3]] - torch.tensor([-2.0, -1.5]))
    pg = torch.maximum(-ratio, -torch.clamp(ratio, 0.8, 1.2))
    delta = torch.tensor([ref[0], ref[3]]) - logp[[0, 3]]
    tok = pg + 0.1 * (torch.exp(delta) - delta - 1.0)
    with torch.no_grad():
        ents: list = []
        grpo.response_logprobs(model, [masked], entropies=ents)
    tok = tok - 0.01 * ents[0][[0, 3]]
    want = tok.sum() if mode == "token-mean" else tok.sum() / 2
    assert abs(float(a.detach()) - float(want.detach())) < 1e-5
    full = grpo.micro_batch_loss(model, [_sample((), [-2.0, 0.0, 0.0, -1.5])], ref_logprobs=[ref], **kw)
    assert abs(float(full.detach()) - float(a.detach())) > 1e-4  # the mask changes the loss
    with pytest.raises(ValueError, match="loss mask of 3 for 4 tokens"):
        grpo.micro_batch_loss(model, [_sample((1, 0, 1), [0.0] * 4)], ref_logprobs=[ref], **kw)
