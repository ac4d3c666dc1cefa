"""Tasks, and a single-process GRPO loop in which the tiny model's toy-task reward rises."""

from __future__ import annotations

import statistics

import pytest
import torch

from dynaresize.config import ModelConfig, TaskConfig
from dynaresize.errors import DataError, UserError
from dynaresize.rl.data import prompts_for_step, reward_fields
from dynaresize.rl.grpo import TrainSample, group_advantages, micro_batch_loss, micro_batches, total_response_tokens
from dynaresize.rl.models import build_model, build_tokenizer, encode_prompt
from dynaresize.rl.rewards import score
from dynaresize.rl.seeds import sample_seed
from dynaresize.rl.tasks import TOY_TASK, decode_response, load_task, toy_count_reward, toy_prompts
from dynaresize.roles.base import GenRequest
from dynaresize.roles.rollout_hf import HFRolloutEngine


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_toy_reward_counts_words_of_the_named_letter():
    assert toy_count_reward("p", " bako tedu bibi", {"letter": "b"}) == pytest.approx(2 / 3)
    assert toy_count_reward("p", " bako tedu bibi", {"letter": "t"}) == pytest.approx(1 / 3)
    assert toy_count_reward("p", "   ", {"letter": "b"}) == 0.0
    assert toy_count_reward("p", "b b b", {"letter": "b"}) == 1.0


def test_toy_prompts_fixed_same_length_and_name_their_letter():
    tok = build_tokenizer(2048)
    prompts = toy_prompts()
    assert prompts == toy_prompts()  # the same list in every process
    assert len(prompts) == 256 and {r["letter"] for r in prompts} == {"b"}
    assert len({len(encode_prompt(tok, r["prompt"])) for r in prompts}) == 1  # batch unpadded
    two = toy_prompts(letters="bk")
    assert {r["letter"] for r in two} == {"b", "k"}
    assert all(f"starting with {r['letter']} " in r["prompt"] for r in two)
    with pytest.raises(ValueError, match="letters"):
        toy_prompts(letters="ba")


def test_load_task_builtin_and_user(tmp_path):
    task = load_task(TaskConfig())
    assert task.name == TOY_TASK and task.reward_fn is toy_count_reward
    assert load_task(TaskConfig(name="toy-count:bk")).prompts == toy_prompts(letters="bk")
    with pytest.raises(UserError, match="unknown task"):
        load_task(TaskConfig(name="nope"))
    with pytest.raises(UserError, match="toy-count:xq"):
        load_task(TaskConfig(name="toy-count:xq"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(UserError, match="task.reward"):
        load_task(TaskConfig(prompts_file=str(prompts)))
    reward = tmp_path / "r.py"
    reward.write_text("def exact(prompt, response, fields):\n    return float(response.strip() == fields['answer'])\n")
    task = load_task(TaskConfig(prompts_file=str(prompts), reward=f"{reward}:exact"))
    assert task.prompts == [{"prompt": "1+1=", "answer": "2"}]
    assert task.reward_fn("1+1=", " 2", reward_fields(task.prompts[0])) == 1.0
    prompts.write_text("")
    with pytest.raises(DataError, match="no prompts"):
        load_task(TaskConfig(prompts_file=str(prompts), reward=f"{reward}:exact"))


def test_mini_grpo_loop_reward_rises():
    """8 prompts x 4 samples x 48 tokens, lr 2e-3, 12 on-policy steps, fixed seed, no Ray."""
    cfg, seed, num_steps, group = ModelConfig(), 0, 12, 4
    tok = build_tokenizer(cfg.vocab_size)
    task = load_task(TaskConfig())
    model = build_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    engine = HFRolloutEngine(cfg, temperature=1.0, batch_rows=32)  # one batch per step: fastest
    curve = []
    for step in range(num_steps):
        engine.set_weights(model.state_dict(), version=step)
        chosen = prompts_for_step(task.prompts, step, 8, seed)
        requests = [GenRequest((step, p, s), encode_prompt(tok, rec["prompt"]), 48, sample_seed(seed, step, p, s))
                    for p, rec in chosen for s in range(group)]
        results = engine.generate(requests)
        rewards = [score(task.reward_fn, chosen[r.sample_id[1]][1]["prompt"], decode_response(tok, r.response_ids),
                         reward_fields(chosen[r.sample_id[1]][1]), "fail")[0] for r in results]
        advantages = group_advantages(rewards, group)
        if step == 0:  # dense enough: the random model's groups already carry signal
            assert sum(1 for a in advantages if a != 0.0) >= len(advantages) // 2
        samples = [TrainSample(r.sample_id, q.prompt_ids, r.response_ids, r.logprobs, a)
                   for q, r, a in zip(requests, results, advantages)]
        total = total_response_tokens(samples)
        opt.zero_grad()
        for mb in micro_batches(samples, 4):
            micro_batch_loss(model, mb, total_response_tokens=total, clip_eps=0.2).backward()
        opt.step()
        curve.append(statistics.mean(rewards))
    print("toy-count reward curve:", " ".join(f"{r:.3f}" for r in curve))
    assert statistics.mean(curve[-3:]) > statistics.mean(curve[:3])
