"""The advantage estimators (`algorithm.adv_estimator`, rl/advantages.py): hand-worked examples,
and the same inputs through verl's formulas transcribed below.

The `verl_*` functions transcribe, for outcome rewards, the estimators of verl's
`verl/trainer/ppo/core_algos.py` (volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7:
`compute_grpo_outcome_advantage`, `compute_rloo_outcome_advantage`,
`compute_reinforce_plus_plus_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage`) and the `masked_mean`, `masked_var`,
`masked_whiten` they call from `verl/utils/torch_functional.py`: a (batch, response_length)
token-level reward tensor holding each sample's reward at its last response token, a response
mask, a group index per row; the result's first column read back per sample (outcome
advantages are constant over a sample's tokens when gamma is 1, checked too).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from dynaresize.rl.advantages import ADV_ESTIMATORS, compute_advantages

# ---------------------------------------------------------------- verl, transcribed


def _masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def _masked_var(values, mask):
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return var * (n / (n - 1))


def _masked_whiten(values, mask):
    mean, var = _masked_mean(values, mask), _masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _token_rewards(rewards, lengths, width):
    trr = torch.zeros(len(rewards), width, dtype=torch.float64)
    mask = torch.zeros(len(rewards), width, dtype=torch.float64)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        mask[i, :n] = 1
        trr[i, n - 1] = r
    return trr, mask


def verl_grpo(trr, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = trr.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean, id2std = {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(id2score[idx])
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * mask


def verl_rloo(trr, mask, index):
    scores = trr.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * mask


def verl_reinforce_plus_plus(trr, mask, gamma=1.0):
    returns = torch.zeros_like(trr)
    running = 0
    for t in reversed(range(trr.shape[1])):
        running = trr[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _masked_whiten(returns, mask) * mask


def verl_reinforce_plus_plus_baseline(trr, mask, index):
    width = trr.shape[-1]
    scores = trr.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, width]) * mask
    return _masked_whiten(scores, mask) * mask


def _verl(estimator, rewards, lengths, group):
    width = max(lengths) + 2
    trr, mask = _token_rewards(rewards, lengths, width)
    index = [i // group for i in range(len(rewards))]
    out = {"grpo": lambda: verl_grpo(trr, mask, index), "rloo": lambda: verl_rloo(trr, mask, index),
           "reinforce_plus_plus": lambda: verl_reinforce_plus_plus(trr, mask),
           "reinforce_plus_plus_baseline": lambda: verl_reinforce_plus_plus_baseline(trr, mask, index)}[estimator]()
    for i, n in enumerate(lengths):  # constant over the sample's tokens, zero after them
        assert torch.allclose(out[i, :n], out[i, 0].expand(n), atol=1e-12)
        assert torch.all(out[i, n:] == 0)
    return [float(out[i, 0]) for i in range(len(rewards))]


def _batch(seed, num_prompts=5, group=4, binary=False):
    rng = random.Random(seed)
    rewards = [float(rng.random() < 0.5) if binary else rng.uniform(-1, 2) for _ in range(num_prompts * group)]
    lengths = [rng.randint(1, 17) for _ in rewards]
    return rewards, lengths


# ---------------------------------------------------------------- against verl


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_estimator_equals_verls_core_algos_formula(estimator, seed):
    rewards, lengths = _batch(seed, binary=seed % 2 == 1)
    ours = compute_advantages(estimator, rewards, 4, num_tokens=lengths)
    theirs = _verl(estimator, rewards, lengths, 4)
    assert ours == pytest.approx(theirs, abs=1e-9, rel=1e-9)


def test_grpo_without_std_equals_verls_dr_grpo():
    rewards, lengths = _batch(7)
    width = max(lengths) + 1
    trr, mask = _token_rewards(rewards, lengths, width)
    theirs = verl_grpo(trr, mask, [i // 4 for i in range(len(rewards))], norm_adv_by_std_in_grpo=False)[:, 0]
    ours = compute_advantages("grpo", rewards, 4, norm_by_std=False)
    assert ours == pytest.approx(theirs.tolist(), abs=1e-12)


# ---------------------------------------------------------------- by hand


def test_hand_worked_grpo_and_rloo():
    # one group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.57735
    a = compute_advantages("grpo", [1, 0, 0, 1], 4)
    hi = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx([hi, -hi, -hi, hi]) and hi == pytest.approx(0.866024, abs=1e-6)
    # rloo: r minus the mean of the others: 1 - 1/3, 0 - 2/3
    assert compute_advantages("rloo", [1, 0, 0, 1], 4) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert compute_advantages("rloo", [3, 1, 2], 3) == pytest.approx([3 - 1.5, 1 - 2.5, 2 - 2.0])


def test_hand_worked_reinforce_plus_plus_whitens_over_tokens():
    # rewards 1 and 0, lengths 3 and 1: 4 tokens [1,1,1,0]; mean 0.75, unbiased var 0.25
    a = compute_advantages("reinforce_plus_plus", [1.0, 0.0], 2, num_tokens=[3, 1])
    assert a == pytest.approx([0.25 / 0.5, -0.75 / 0.5], abs=1e-6)
    # with the group baseline: [0.5, -0.5] over tokens [.5,.5,.5,-.5]: mean 0.25, var 0.25
    b = compute_advantages("reinforce_plus_plus_baseline", [1.0, 0.0], 2, num_tokens=[3, 1])
    assert b == pytest.approx([0.25 / 0.5, -0.75 / 0.5], abs=1e-6)
    # the REINFORCE++ advantage reads the whole step: another group changes this one's
    c = compute_advantages("reinforce_plus_plus", [1.0, 0.0, 5.0, 5.0], 2, num_tokens=[3, 1, 2, 2])
    assert c[:2] != pytest.approx(a)


def test_a_constant_group_gets_zero_from_every_group_estimator():
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        a = compute_advantages(est, [1, 1, 1, 1, 0, 1, 0, 1], 4, num_tokens=[2] * 8)
        assert a[:4] == pytest.approx([0.0] * 4, abs=1e-9), est
        assert any(abs(x) > 0.1 for x in a[4:]), est


def test_left_out_samples_are_in_no_statistic_and_get_zero():
    rewards, lengths = _batch(3)
    present = [i % 5 != 0 for i in range(len(rewards))]
    for est in ADV_ESTIMATORS:
        a = compute_advantages(est, rewards, 4, num_tokens=lengths, present=present)
        assert all(x == 0.0 for x, p in zip(a, present) if not p), est
    # REINFORCE++ on the present samples alone gives the same (the whitening ignores the others)
    a = compute_advantages("reinforce_plus_plus", rewards, 4, num_tokens=lengths, present=present)
    kept = [i for i, p in enumerate(present) if p]
    alone = compute_advantages("reinforce_plus_plus", [rewards[i] for i in kept], 1,
                               num_tokens=[lengths[i] for i in kept])
    assert [a[i] for i in kept] == pytest.approx(alone, abs=1e-12)
    # GRPO: a group's present samples alone, as a group of their own
    g = compute_advantages("grpo", rewards[:4], 4, present=present[:4])
    assert g[1:] == pytest.approx(compute_advantages("grpo", rewards[1:4], 3))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="adv_estimator 'gae'"):
        compute_advantages("gae", [1, 0], 2)
    with pytest.raises(ValueError, match="needs the token count"):
        compute_advantages("reinforce_plus_plus", [1, 0], 2)
    with pytest.raises(ValueError, match="do not split"):
        compute_advantages("rloo", [1, 0, 1], 2)
