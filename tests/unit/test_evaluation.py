"""Evaluation pieces that need no Ray: pass@k, held-out prompts, the schedule, the eval record."""

from __future__ import annotations

import json
from math import comb

import pytest

from dynaresize.config_load import build_config
from dynaresize.driver.evaluation import EVAL_STEP, Evaluator, held_out_prompts, pass_at_k, pass_ks
from dynaresize.driver.job import Job
from dynaresize.errors import ConfigError, UserError
from dynaresize.metrics import eval_scalars
from dynaresize.records import make_record
from dynaresize.rl.data import prompts_for_step
from dynaresize.rl.tasks import toy_held_out_prompts, toy_prompts
from dynaresize.roles.base import GenResult


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # k = 1: the fraction correct
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # k = n: any correct
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


def test_toy_held_out_prompts_are_never_training_prompts():
    held = toy_held_out_prompts(64)
    assert held == toy_held_out_prompts(64)  # fixed, the same in every process
    assert len({r["prompt"] for r in held}) == 64
    train = toy_prompts()
    sampled = {rec["prompt"] for step in range(200) for _, rec in prompts_for_step(train, step, 8, seed=3)}
    assert sampled == {r["prompt"] for r in train}  # 200 steps of 8 see every training prompt ...
    assert not sampled & {r["prompt"] for r in held}  # ... and no held-out one
    two = toy_held_out_prompts(6, letters="bk")
    assert [r["letter"] for r in two] == ["b", "k"] * 3


def _cfg(**eval_fields):
    return build_config({"steps": 5, "rollout": {"max_new_tokens": 8}, "eval": eval_fields})


def test_schedule_every_n_steps_and_after_the_last():
    ev = Evaluator(_cfg(every_steps=2, num_prompts=2), Job(_cfg()))
    assert [s for s in range(5) if ev.due(s)] == [1, 3, 4]
    off = Evaluator(_cfg(), Job(_cfg()))
    assert not off.enabled and not any(off.due(s) for s in range(5)) and off.prompts == []


def test_requests_are_outside_training_ids_and_seeds_repeat(tmp_path):
    cfg = _cfg(every_steps=1, num_prompts=3, samples_per_prompt=2)
    ev = Evaluator(cfg, Job(cfg))
    groups = ev._requests()
    assert [[r.sample_id for r in g] for g in groups] == [[(EVAL_STEP, p, s) for s in range(2)] for p in range(3)]
    assert groups == ev._requests()  # the same seeds at every evaluation
    assert len({r.seed for g in groups for r in g}) == 6


def test_prompts_file_first_n_and_the_task_reward(tmp_path):
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"write words starting with b , for example {w} :", "letter": "b"})
                         + "\n" for w in ("bako", "bemi", "bute")))
    assert len(held_out_prompts(_cfg(every_steps=1, prompts_file=str(f), num_prompts=2))) == 2
    assert len(held_out_prompts(_cfg(every_steps=1, prompts_file=str(f), num_prompts=0))) == 3


def test_score_gives_mean_reward_and_pass_at_k_and_the_scalars():
    cfg = _cfg(every_steps=1, num_prompts=2, samples_per_prompt=4, correct_threshold=0.5)
    job = Job(cfg)
    ev = Evaluator(cfg, job)
    tok = job.tokenizer
    good, bad = tok(" bako bemi")["input_ids"], tok(" tedu bemi tedu")["input_ids"]  # rewards 1 and 1/3
    # prompt 0: one correct sample of four; prompt 1: none
    responses = {(0, 0): good, (0, 1): bad, (0, 2): bad, (0, 3): bad, (1, 0): bad, (1, 1): bad, (1, 2): bad,
                 (1, 3): bad}
    results = [GenResult(sample_id=(EVAL_STEP, p, s), response_ids=list(ids), logprobs=[0.0] * len(ids), version=3,
                         duration_s=0.0) for (p, s), ids in responses.items()]
    rec = ev.score(2, results)
    assert rec["version"] == 3 and rec["num_correct"] == 1 and rec["num_samples"] == 8
    assert rec["reward_mean"] == pytest.approx((1 + 7 / 3) / 8)
    assert rec["pass_at_1"] == pytest.approx((0.25 + 0) / 2)
    assert rec["pass_at_2"] == pytest.approx((0.5 + 0) / 2)
    assert rec["pass_at_4"] == pytest.approx((1 + 0) / 2)
    full = make_record("eval", **rec, eval_s=1.0)
    assert set(eval_scalars(full)) == {"eval/reward_mean", "eval/reward_std", "eval/pass_at_1", "eval/pass_at_2",
                                       "eval/pass_at_4"}
    with pytest.raises(RuntimeError, match="incomplete"):
        ev.score(2, results[:-1])


def test_config_is_checked():
    with pytest.raises(ConfigError) as e:
        _cfg(every_steps=-1, samples_per_prompt=0, num_prompts=-2)
    text = str(e.value)
    assert "eval.every_steps=-1" in text and "eval.samples_per_prompt=0" in text and "eval.num_prompts=-2" in text
    with pytest.raises(ConfigError, match="eval.prompts_file"):  # a user task has no built-in held-out part
        build_config({"task": {"prompts_file": "p.jsonl", "reward": "m:f"}, "eval": {"every_steps": 2}})
    with pytest.raises(UserError, match="held-out"):
        held_out_prompts(_cfg(every_steps=1, num_prompts=100000))


VERL_SCORE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "boom" in solution_str:
        raise RuntimeError("grader crashed")
    return {"score": 1.0 if ground_truth in solution_str else 0.0, "source_ok": float(data_source == "gsm8k")}
'''


def test_a_verl_parquet_eval_file_is_scored_in_the_reward_pool_in_the_rewards_own_style(tmp_path):
    """eval.prompts_file read as task.dataset is (verl's test.parquet), each sample scored by a
    verl-style compute_score in the job's reward pool; a raising reward follows on_reward_error."""
    from dynaresize.errors import RewardError
    from dynaresize.rl.dataset import write_parquet

    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"{a} plus {a}?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": a}}
            for a, w in ((1, "bako"), (2, "bemi"))]
    test = write_parquet(rows, tmp_path / "test.parquet")
    (tmp_path / "score.py").write_text(VERL_SCORE)

    def evaluator(on_error: str):
        cfg = build_config({"steps": 5, "rollout": {"max_new_tokens": 8},
                            "task": {"reward": f"{tmp_path / 'score.py'}:compute_score", "on_reward_error": on_error},
                            "eval": {"every_steps": 1, "prompts_file": str(test), "num_prompts": 0,
                                     "samples_per_prompt": 2}})
        job = Job(cfg)
        return Evaluator(cfg, job), job

    ev, job = evaluator("zero")
    try:
        assert [r["ground_truth"] for r in ev.prompts] == ["bako", "bemi"]  # verl's reward_model.ground_truth
        tok = job.tokenizer
        say = {(0, 0): " bako", (0, 1): " tedu", (1, 0): " bemi", (1, 1): " boom"}
        results = [GenResult(sample_id=(EVAL_STEP, p, s), response_ids=tok(text)["input_ids"], logprobs=[],
                             version=2, duration_s=0.0) for (p, s), text in say.items()]
        rec = ev.score(1, results)
        assert rec["num_correct"] == 2 and rec["num_reward_errors"] == 1 and rec["num_left_out"] == 0
        assert rec["reward_mean"] == pytest.approx(2 / 4)
    finally:
        job.close()
    ev, job = evaluator("fail")
    try:
        with pytest.raises(RewardError, match=r"eval after step 1: sample -1-1-1: reward function .*grader crashed"):
            ev.score(1, results)
    finally:
        job.close()
