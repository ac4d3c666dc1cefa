"""Rewards as users wrote them (rl/rewards.py) run in the reward pool (rl/reward_pool.py), and
what the job does with each sample's fate (driver/job.py): styles told from signatures, sync or
async, dict metrics, a deadline that kills and replaces a hung worker, TRL's None left out."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from dynaresize.config_load import build_config, merge
from dynaresize.driver.job import Job
from dynaresize.driver.ledger import Ledger
from dynaresize.errors import RewardError
from dynaresize.presets import preset
from dynaresize.rl import grpo
from dynaresize.rl.reward_pool import RewardPool
from dynaresize.rl.rewards import detect_style, invoke, load_reward
from dynaresize.roles.base import GenResult

REWARDS = '''
import asyncio, os, time
calls = {"n": 0}

def mine(prompt, response, fields):
    calls["n"] += 1
    return float(calls["n"])                     # the call's rank in this process

def slow(prompt, response, fields):
    if "hang" in response:
        time.sleep(60)
    if "boom" in response:
        raise ValueError("boom")
    if "die" in response:
        os._exit(3)
    if "nap" in response:
        time.sleep(1.0)
    return float(os.getpid())

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    ok = solution_str.strip() == str(ground_truth)
    return {"score": float(ok), "acc": ok, "pred": solution_str, "index": extra_info.get("index", -1)}

async def trl(prompts, completions, answer, completion_ids, log_metric, **kwargs):
    await asyncio.sleep(0)
    log_metric("group", 1.0)
    text = lambda c: c[0]["content"] if isinstance(c, list) else c
    return [None if "skip" in text(c) else float(text(c).strip() == a) for c, a in zip(completions, answer)]

def no_score(prompt, response, fields):
    return {"acc": 1.0}
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _call(text, fields=None, prompt="p"):
    return {"step": 0, "prompts": [prompt], "completions": [text], "completion_ids": [[1, 2]], "fields": [fields or {}]}


def test_styles_are_told_from_signatures_and_called_their_way(rewards_file):
    fns = {n: load_reward(f"{rewards_file}:{n}") for n in ("mine", "compute_score", "trl")}
    assert [detect_style(fns[n], n)[0] for n in fns] == ["dynaresize", "verl", "trl"]
    out = invoke(fns["compute_score"], "verl", _call(" 4", {"reward_model": {"ground_truth": "4"},
                                                           "extra_info": {"index": 7}}))
    assert out == {"values": [1.0], "problems": [None], "metrics": {"acc": [1.0], "index": [7.0]}}  # "pred": not a number
    group = {"step": 3, "prompts": [[{"role": "user", "content": "1+1?"}]] * 3, "completions": ["2", "3", "skip"],
             "completion_ids": [[1], [2], [3]], "fields": [{"answer": "2"}] * 3}
    out = invoke(fns["trl"], "trl", group)  # async, chat completions as assistant messages, None kept
    assert out == {"values": [1.0, 0.0, None], "problems": [None, None, None], "metrics": {"group": [1.0]}}
    bad = invoke(load_reward(f"{rewards_file}:no_score"), "dynaresize", _call("x"))
    assert bad["problems"] == ['returned a dict without a "score" key']


def test_the_pool_kills_and_replaces_a_hung_worker_and_reports_each_fate(rewards_file):
    pool = RewardPool(f"{rewards_file}:slow", "dynaresize", workers=2, timeout_s=1.0)
    try:
        pool.start()  # both workers up
        before = set(pool.pids())
        t0 = time.monotonic()
        out = pool.run([_call("ok"), _call("hang"), _call("boom"), _call("die"), _call("ok")])
        elapsed = time.monotonic() - t0
        assert elapsed < 8.0, elapsed  # one deadline (1 s) and a restart or two, never the 60 s sleep
        assert out[0][0] == "ok" and out[4][0] == "ok"
        assert out[1] == ("timeout", "timed out after 1 s (its reward worker was killed and replaced)")
        assert out[2] == ("error", "raised ValueError: boom")
        assert out[3][0] == "error" and "died (exit code 3)" in out[3][1]
        assert pool.replaced == 2 and len(set(pool.pids()) - before) == 2  # two new processes
        pids = pool.pids()
    finally:
        pool.close()
    pool = RewardPool(f"{rewards_file}:slow", "dynaresize", workers=2, timeout_s=30.0)
    try:  # two workers run two calls at once: two 1 s naps take about 1 s, on two processes
        pool.start()
        t0 = time.monotonic()
        naps = pool.run([_call("nap"), _call("nap")])
        assert time.monotonic() - t0 < 1.8 and len({o[1]["values"][0] for o in naps}) == 2, naps
        pids += pool.pids()
    finally:
        pool.close()
    for pid in pids:  # stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_one_worker_sees_the_calls_in_order_in_one_process(rewards_file):
    pool = RewardPool(f"{rewards_file}:mine", "dynaresize", workers=1, timeout_s=5.0)
    try:
        first = [o[1]["values"][0] for o in pool.run([_call("a")] * 3)]
        second = [o[1]["values"][0] for o in pool.run([_call("a")] * 2)]
    finally:
        pool.close()
    assert first + second == [1.0, 2.0, 3.0, 4.0, 5.0]  # module state persists across steps, as in-process


TINY = {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 600},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4}}


def _job(tmp_path, rewards_file, fn, rows, **task):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(merge(merge(preset("cpu"), TINY), {"task": {"dataset": str(data), "reward": f"{rewards_file}:{fn}",
                                                                   **task}}))
    return Job(cfg)


def _score(job, texts):
    """Job.score of step 0 with response i of each group decoding to texts[i]."""
    results = []
    for g in job.requests(0):
        for r in g:
            ids = job.tokenizer(texts[r.sample_id[2]])["input_ids"]
            results.append((0, GenResult(sample_id=r.sample_id, response_ids=list(ids), logprobs=[-1.0] * len(ids),
                                         version=0, duration_s=0.0)))
    ledger = Ledger(staleness=1)
    return job.score(0, results, ledger), ledger


def test_trl_none_is_left_out_of_its_group_and_recorded(tmp_path, rewards_file):
    job = _job(tmp_path, rewards_file, "trl", [{"prompt": "1+1=", "answer": "2"}])
    try:
        scored, ledger = _score(job, ["2", "3", "skip", "2"])
    finally:
        job.close()
    assert ledger.entries[(0, 0, 2)].reward_error.startswith("left out: sample 0-0-2: reward function ")
    assert [ledger.entries[(0, 0, s)].reward_error for s in (0, 1, 3)] == [None, None, None]
    adv = {s.sample_id: s.advantage for s in scored.samples}
    assert adv[(0, 0, 2)] == 0.0  # no policy gradient from it
    want = grpo.group_advantages([1.0, 0.0, 1.0], 3, std="sample")  # the group without it (train.adv_std's default)
    assert [adv[(0, 0, s)] for s in (0, 1, 3)] == pytest.approx(want)
    assert scored.left_out == 2 and scored.mean_reward == pytest.approx(2 / 3)  # two prompts: both groups
    assert scored.reward_metrics == {"group": 1.0}
    assert len(scored.samples) == 8  # every sample stays in the step's batch


def test_verl_dict_metrics_and_a_timeout_under_zero_and_fail(tmp_path, rewards_file):
    job = _job(tmp_path, rewards_file, "compute_score",
               [{"prompt": [{"role": "user", "content": "2+2?"}], "data_source": "x",
                 "reward_model": {"ground_truth": "4"}, "extra_info": {"index": 5}}])
    try:
        scored, ledger = _score(job, ["4", "5", "4", "four"])
        assert [ledger.entries[(0, 0, s)].reward for s in range(4)] == [1.0, 0.0, 1.0, 0.0]
        assert scored.reward_metrics == {"acc": 0.5, "index": 5.0}
    finally:
        job.close()
    for policy in ("zero", "fail"):
        job = _job(tmp_path, rewards_file, "slow", [{"prompt": "x"}], on_reward_error=policy, reward_timeout_s=0.5)
        try:
            if policy == "zero":
                scored, ledger = _score(job, ["ok", "hang", "ok", "boom"])
                err = {s: ledger.entries[(0, 0, s)].reward_error for s in range(4)}
                assert err[0] is None and err[2] is None
                assert err[1].startswith("sample 0-0-1: reward function ") and "timed out after 0.5 s" in err[1]
                assert err[3].startswith("sample 0-0-3: ") and err[3].endswith("raised ValueError: boom")
                assert ledger.entries[(0, 0, 1)].reward == 0.0 and not math.isnan(scored.mean_reward)
            else:
                with pytest.raises(RewardError, match="^sample 0-0-1: reward function .*timed out after 0.5 s"):
                    _score(job, ["ok", "hang", "ok", "ok"])
        finally:
            job.close()
