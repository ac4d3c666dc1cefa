"""The streaming step's bookkeeping while its samples arrive (driver/accumulate.py): groups scored once
complete, micro-batches fixed by sample index and ready once their groups are, the merged step
equal to scoring it all at once."""

import random
import statistics
from types import SimpleNamespace

import pytest

from dynaresize.driver.accumulate import StepAccumulator
from dynaresize.driver.job import ScoredStep
from dynaresize.rl import grpo

STEP, PROMPTS, K, MBS = 3, 4, 3, 5


def _result(sid, n):
    return SimpleNamespace(sample_id=sid, response_ids=list(range(n)))


def _score(group):
    """A stand-in for Job.score on whole groups: reward = response length."""
    samples = [grpo.TrainSample(sample_id=r.sample_id, prompt_ids=[1], response_ids=r.response_ids,
                                rollout_logprobs=[0.0] * len(r.response_ids), advantage=0.0) for _, r in group]
    rewards = [len(r.response_ids) for _, r in group]
    return ScoredStep(samples=samples, rewards=[float(r) for r in rewards], num_tokens=sum(rewards),
                      longest_tokens=max(rewards), metric_values={"len": [float(r) for r in rewards]},
                      left_out=rewards.count(0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_micro_batches_are_fixed_by_index_and_ready_once_their_groups_are(seed):
    ids = [(STEP, p, s) for p in range(PROMPTS) for s in range(K)]
    rng = random.Random(seed)
    arrival = ids[:]
    rng.shuffle(arrival)
    acc = StepAccumulator(STEP, ids, micro_batch_size=MBS, samples_per_prompt=K)
    assert acc.num_micro_batches == 3 and not acc.done
    results, handed = [], []
    for i, sid in enumerate(arrival):
        results.append((i % 2, _result(sid, 1 + sid[1] * 3 + sid[2])))
        for group in acc.complete_groups(results):
            assert len(group) == K and len({r.sample_id[:2] for _, r in group}) == 1  # one whole group
            acc.add_scored(_score(group))
        for j, mb in acc.take_ready():
            # a micro-batch is the j-th slice of the sorted ids, handed out once all its groups are in
            assert [s.sample_id for s in mb] == sorted(ids)[j * MBS:(j + 1) * MBS]
            done_prompts = {sid[:2] for sid in arrival[:i + 1]
                            if sum(1 for x in arrival[:i + 1] if x[:2] == sid[:2]) == K}
            assert {s.sample_id[:2] for s in mb} <= done_prompts
            handed.append(j)
    assert sorted(handed) == [0, 1, 2] and acc.done
    whole = acc.scored_step()
    assert [s.sample_id for s in whole.samples] == sorted(ids)
    lengths = [1 + p * 3 + s for p in range(PROMPTS) for s in range(K)]
    assert whole.mean_reward == pytest.approx(sum(lengths) / len(lengths))
    assert whole.reward_std == pytest.approx(statistics.pstdev(lengths))  # over the parts' rewards together
    assert whole.reward_metrics == {"len": pytest.approx(sum(lengths) / len(lengths))}
    assert whole.num_tokens == sum(lengths) and whole.longest_tokens == max(lengths)
    assert acc.total_tokens == grpo.total_response_tokens(whole.samples)


def test_refuses_unknown_or_repeated_samples_and_an_early_token_count():
    ids = [(STEP, p, s) for p in range(2) for s in range(K)]
    acc = StepAccumulator(STEP, ids, micro_batch_size=MBS, samples_per_prompt=K)
    with pytest.raises(ValueError, match="samples scored"):
        acc.total_tokens
    with pytest.raises(ValueError, match="unexpected or repeated"):
        acc.complete_groups([(0, _result((STEP, 9, 0), 2))])
    acc2 = StepAccumulator(STEP, ids, micro_batch_size=MBS, samples_per_prompt=K)
    r = (0, _result(ids[0], 2))
    with pytest.raises(ValueError, match="unexpected or repeated"):
        acc2.complete_groups([r, r])
    with pytest.raises(ValueError, match="micro_batch_size"):
        StepAccumulator(STEP, ids, micro_batch_size=0, samples_per_prompt=K)
