"""GRPO math: advantages, micro-batch composition, and a loss normalised by the whole step."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.grpo import (TrainSample, group_advantages, micro_batch_loss, micro_batches,
                                response_logprobs, total_response_tokens)
from dynaresize.rl.models import build_model

CFG = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def _samples(model, num_prompts=3, group=4, seed=0) -> list[TrainSample]:
    """Samples with varied lengths; rollout log-probs near (not at) the model's own."""
    rng = random.Random(seed)
    draft = []
    for p in range(num_prompts):
        prompt = [2] + [rng.randrange(4, CFG.vocab_size) for _ in range(rng.randint(2, 7))]
        for s in range(group):
            resp = [rng.randrange(4, CFG.vocab_size) for _ in range(rng.randint(1, 9))]
            draft.append(TrainSample((5, p, s), prompt, resp, [0.0] * len(resp), 0.0))
    with torch.no_grad():
        lps = response_logprobs(model, draft)
    rewards = [rng.random() for _ in draft]
    advs = group_advantages(rewards, group)
    return [TrainSample(d.sample_id, d.prompt_ids, d.response_ids,
                        [x + rng.uniform(-0.3, 0.3) for x in lp.tolist()], a)
            for d, lp, a in zip(draft, lps, advs)]


def test_group_advantages_normalise_per_prompt():
    rewards = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.2, 0.4, 0.6, 0.8]
    adv = group_advantages(rewards, 4)
    assert adv[4:8] == [0.0] * 4  # equal rewards: no signal
    for g in (0, 8):
        grp = adv[g:g + 4]
        assert abs(sum(grp)) < 1e-9
        assert math.isclose(math.sqrt(sum(a * a for a in grp) / 4), 1.0, rel_tol=1e-4)
    # Order within a group follows the rewards; a shift or scale of a group changes nothing.
    assert adv[8] < adv[9] < adv[10] < adv[11]
    shifted = group_advantages([r * 3 + 7 for r in rewards[8:]], 4)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(shifted, adv[8:]))
    with pytest.raises(ValueError):
        group_advantages(rewards[:5], 4)


def test_micro_batches_fixed_by_sample_id(model):
    samples = _samples(model)
    shuffled = samples[:]
    random.Random(3).shuffle(shuffled)
    a, b = micro_batches(samples, 5), micro_batches(shuffled, 5)
    assert [[s.sample_id for s in mb] for mb in a] == [[s.sample_id for s in mb] for mb in b]
    assert [len(mb) for mb in a] == [5, 5, 2]
    flat = [s.sample_id for mb in a for s in mb]
    assert flat == sorted(flat)


@pytest.mark.parametrize("micro_batch_size", [1, 3, 5])
def test_sum_of_micro_batch_losses_equals_full_batch_loss(model, micro_batch_size):
    samples = _samples(model)
    total = total_response_tokens(samples)
    assert total == sum(len(s.response_ids) for s in samples)
    full = micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2)
    parts = [micro_batch_loss(model, mb, total_response_tokens=total, clip_eps=0.2)
             for mb in micro_batches(samples, micro_batch_size)]
    assert abs(float(sum(parts).detach()) - float(full.detach())) < 1e-6
    # Gradients too: the step gradient is the plain sum of the micro-batch gradients.
    model.zero_grad()
    full.backward()
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for part in parts:
        part.backward()
    for gf, p in zip(g_full, model.parameters()):
        assert torch.allclose(gf, p.grad, atol=1e-6, rtol=0)
    model.zero_grad()


def test_one_sample_loss_independent_of_its_micro_batch(model):
    samples = _samples(model)
    total = 100
    with torch.no_grad():
        alone = [float(micro_batch_loss(model, [s], total_response_tokens=total, clip_eps=0.2)) for s in samples]
        together = float(micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2))
    assert abs(sum(alone) - together) < 1e-6
    assert any(abs(x) > 1e-4 for x in alone)


def test_loss_on_policy_is_minus_mean_advantage_and_clipping(model):
    samples = _samples(model)
    with torch.no_grad():
        own = response_logprobs(model, samples)
    on_policy = [TrainSample(s.sample_id, s.prompt_ids, s.response_ids, lp.tolist(), s.advantage)
                 for s, lp in zip(samples, own)]
    total = total_response_tokens(on_policy)
    loss = micro_batch_loss(model, on_policy, total_response_tokens=total, clip_eps=0.2)
    expected = -sum(s.advantage * len(s.response_ids) for s in on_policy) / total
    assert abs(loss.item() - expected) < 1e-5
    # Rollout log-probs far below the current ones: ratio >> 1, clipped at 1+eps for A > 0.
    pos = [TrainSample(s.sample_id, s.prompt_ids, s.response_ids, (lp - 5.0).tolist(), 1.0)
           for s, lp in zip(samples, own)]
    stats: dict = {}
    clipped = micro_batch_loss(model, pos, total_response_tokens=total, clip_eps=0.2, stats=stats)
    assert abs(clipped.item() + 1.2) < 1e-5
    assert stats["clipped_tokens"] == stats["num_tokens"] == total
    clipped.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())
    model.zero_grad()


def test_kl_term(model):
    samples = _samples(model)
    total = total_response_tokens(samples)
    with torch.no_grad():
        own = [lp.tolist() for lp in response_logprobs(model, samples)]
    base = micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2).item()
    same_ref = micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2,
                                kl_coef=0.5, ref_logprobs=own).item()
    assert abs(same_ref - base) < 1e-6  # k3 is zero where the reference equals the policy
    far = [[x - 1.0 for x in lp] for lp in own]
    stats: dict = {}
    with_kl = micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2,
                               kl_coef=0.5, ref_logprobs=far, stats=stats).item()
    k3 = math.exp(-1.0) + 1.0 - 1.0  # exp(d) - d - 1 at d = -1
    assert abs(with_kl - base - 0.5 * k3) < 1e-5
    assert abs(stats["kl_sum"] - k3 * total) < 1e-3
    with pytest.raises(ValueError, match="ref_logprobs"):
        micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2, kl_coef=0.1)


def test_logprob_count_mismatch_is_an_error(model):
    s = _samples(model)[0]
    bad = TrainSample(s.sample_id, s.prompt_ids, s.response_ids, s.rollout_logprobs[:-1] or [], 1.0)
    with pytest.raises(ValueError, match="rollout log-probs"):
        micro_batch_loss(model, [bad], total_response_tokens=10, clip_eps=0.2)


def test_k1_estimator_and_entropy_stats(model):
    samples = _samples(model)
    total = total_response_tokens(samples)
    with torch.no_grad():
        own = [lp.tolist() for lp in response_logprobs(model, samples)]
    far = [[x - 1.0 for x in lp] for lp in own]
    stats: dict = {}
    micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2, kl_coef=0.5, ref_logprobs=far,
                     kl_estimator="k1", stats=stats)
    assert abs(stats["kl_sum"] - 1.0 * total) < 1e-3  # log pi - log ref = 1 on every token
    assert 0 < stats["entropy_sum"] / total <= math.log(CFG.vocab_size) + 1e-4
    with pytest.raises(ValueError, match="kl_estimator"):
        micro_batch_loss(model, samples, total_response_tokens=total, clip_eps=0.2, kl_estimator="k2")


def test_decoupled_loss_uses_proximal_ratio_and_capped_behaviour_weight(model):
    """With proximal log-probs (recomputed by the trainers) the ratio is against them and each
    token is weighted by exp(prox - behaviour), capped."""
    from dynaresize.rl.grpo import BEHAVIOUR_WEIGHT_CAP

    samples = _samples(model)
    total = total_response_tokens(samples)
    with torch.no_grad():
        own = [lp.tolist() for lp in response_logprobs(model, samples)]
    on_policy = [TrainSample(s.sample_id, s.prompt_ids, s.response_ids, lp, s.advantage) for s, lp in zip(samples, own)]
    plain = micro_batch_loss(model, on_policy, total_response_tokens=total, clip_eps=0.2).item()
    same = [s.with_logprobs(s.rollout_logprobs) for s in on_policy]
    assert abs(micro_batch_loss(model, same, total_response_tokens=total, clip_eps=0.2).item() - plain) < 1e-6
    # behaviour 0.5 nats below proximal: every token weighs exp(0.5); far below: the cap
    for gap, weight in ((0.5, math.exp(0.5)), (10.0, BEHAVIOUR_WEIGHT_CAP)):
        stale = [TrainSample(s.sample_id, s.prompt_ids, s.response_ids, [x - gap for x in lp], s.advantage,
                             prox_logprobs=lp) for s, lp in zip(samples, own)]
        stats: dict = {}
        got = micro_batch_loss(model, stale, total_response_tokens=total, clip_eps=0.2, stats=stats).item()
        assert abs(got - weight * plain) < 1e-5 and stats["clipped_tokens"] == 0
    with pytest.raises(ValueError, match="log-probs for"):
        on_policy[0].with_logprobs([0.0])
