"""DAPO on the driver: overlong shaping, group filtering, generation batches' prompt indices
(rl/dapo.py, driver/dynamic_sampling.py), on the real Job and Ledger with a stand-in rollout
(_dapo_fake.py: fixed texts by prompt index; the e2e run is tests/e2e/test_dapo.py)."""

from __future__ import annotations

import pytest
from _dapo_fake import FakeRun, scored_with_filter

from dynaresize.config_load import build_config, merge
from dynaresize.presets import preset
from dynaresize.rl.data import prompt_order
from dynaresize.rl.dapo import GroupFilter, gen_batch_order, is_constant, overlong_penalty

TINY = {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 600},
        "rollout": {"synthetic_lengths": False}}
FILTER = {"algorithm": {"filter_groups": True}}


def _cfg(*extra: dict):
    data = merge(preset("cpu"), TINY)
    for e in extra:
        data = merge(data, e)
    return build_config(data)


def test_overlong_penalty_is_verls_formula():
    # budget 20, buffer 4: 0 up to 16 tokens, then -f * (n - 16) / 4 down to -f at 20
    assert [overlong_penalty(n, max_tokens=20, buffer_len=4, factor=1.0) for n in (3, 16, 17, 18, 20)] == \
        [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(18, max_tokens=20, buffer_len=4, factor=0.5) == -0.25
    assert overlong_penalty(20, max_tokens=20, buffer_len=0, factor=1.0) == 0.0  # off
    with pytest.raises(ValueError):
        overlong_penalty(5, max_tokens=4, buffer_len=8, factor=1.0)


def test_group_filter_keeps_groups_with_signal_and_counts_batches():
    assert is_constant([1.0, 1.0]) and is_constant([0.5, None]) and not is_constant([0.0, 1.0, None])
    f = GroupFilter(step=3, target=2, max_batches=3, batches=1)
    f.add({0: [1.0, 1.0], 1: [0.0, 1.0]}, "acc")
    assert not f.full and not f.capped and f.filtered == {0: "filtered: group's acc is constant (1)"}
    f.batches = 2
    f.add({2: [0.0, 0.0], 3: [1.0, 0.0], 5: [0.0, 0.5]}, "acc")
    assert f.full and f.chosen == [1, 3] and f.surplus == [5]
    g = GroupFilter(step=3, target=2, max_batches=2, batches=2)
    g.add({0: [1.0, 1.0], 1: [1.0, 1.0]}, "acc")
    assert g.capped and "dynamic sampling of step 3: 2 generation batches" in g.cap_message()
    with pytest.raises(ValueError, match="filtered twice"):
        g.add({1: [0.0, 1.0]}, "acc")


def test_generation_batches_have_their_own_prompts_and_never_collide():
    job_cfg = _cfg(FILTER, {"rollout": {"gen_prompts_per_step": 3}})
    run = FakeRun(job_cfg)
    ids = [run.job.expected_ids(5, b) for b in (1, 2, 3)]
    assert ids[0] == ids[1][:len(ids[0])] and len(set(ids[2])) == len(ids[2]) == 3 * 3 * 4
    assert sorted({sid[1] for sid in ids[2]}) == list(range(9))  # batch b's prompt j is b*3 + j
    # batch 0 is the step's own prompts (the run's stream); later batches draw their own
    assert gen_batch_order(100, 5, 0, 3, 0) == prompt_order(100, 5, 3, 0)
    assert gen_batch_order(100, 5, 1, 3, 0) != gen_batch_order(100, 5, 0, 3, 0)
    assert gen_batch_order(100, 5, 1, 3, 0) != gen_batch_order(100, 6, 1, 3, 0)
    # seeds are the sample seeds of (step, prompt index, sample): distinct over the batches
    seeds = [r.seed for b in range(3) for g in run.job.requests(5, b) for r in g]
    assert len(set(seeds)) == len(seeds)
    run.job.close()


def test_without_filtering_the_steps_prompts_are_unchanged():
    off = FakeRun(_cfg())
    on = FakeRun(_cfg(FILTER))  # G = P: batch 0 is the same prompts
    assert [[r.sample_id for r in g] for g in off.job.requests(2)] == [[r.sample_id for r in g]
                                                                        for g in on.job.requests(2)]
    assert [g[0].prompt_ids for g in off.job.requests(2)] == [g[0].prompt_ids for g in on.job.requests(2)]
    off.job.close()
    on.job.close()


def test_a_step_generates_batches_until_its_groups_are_kept():
    ids, advs, drops, fields = scored_with_filter(_cfg(FILTER))
    # 8 prompts a batch, prompt p % 4 == 1 has signal (2 a batch; 2 with overlong-free reward): 4 batches
    assert fields == {"gen_batches": 4, "groups_kept": 8, "groups_filtered": 24, "groups_surplus": 0}
    assert sorted({sid[1] for sid in ids}) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert len(ids) == 8 * 4 and all(a != 0 for a in advs)
    assert len(drops) == 24 * 4 and all(why.startswith("filtered: group's reward is constant") for _, why in drops)


def test_overlong_shaping_is_in_the_reward_and_recorded(tmp_path):
    cfg = _cfg(FILTER, {"reward": {"overlong_buffer_len": 127}})  # budget 128: penalised from 1 token
    run = FakeRun(cfg)
    from dynaresize.driver.dynamic_sampling import DynamicSampling

    run.dyn = DynamicSampling(run)
    run._expect(0)
    scored = run.dyn.scored(0)
    run.job.close()
    e = run.ledger.entries
    some = [sid for sid in e if sid[1] % 4 == 2]
    for sid in some:
        n = e[sid].num_tokens
        assert e[sid].overlong_penalty == pytest.approx(-(n - 1) / 127)
        assert e[sid].reward == pytest.approx(1.0 + e[sid].overlong_penalty)
    # p % 4 == 2 (score 1, lengths differ) now has signal in the shaped reward: kept
    assert any(sid[1] % 4 == 2 for sid in (s.sample_id for s in scored.samples))
    # filtering on the score before shaping filters it again
    ids, _, drops, _ = scored_with_filter(build_config(merge(merge(merge(preset("cpu"), TINY), FILTER), {
        "algorithm": {"filter_metric": "score"}, "reward": {"overlong_buffer_len": 127}})))
    assert not any(sid[1] % 4 == 2 for sid in ids)
    assert any(why == "filtered: group's score is constant (1)" for _, why in drops)


def test_the_cap_stops_with_the_step_named():
    kind, message = scored_with_filter(_cfg(FILTER, {"algorithm": {"max_num_gen_batches": 2}}))
    assert kind == "FilterCapError"
    assert message.startswith("dynamic sampling of step 0: 2 generation batches (algorithm.max_num_gen_batches=2) "
                              "kept 4 of the 8 prompt groups")


def test_a_surplus_beyond_the_step_is_dropped_as_filtered():
    ids, _, drops, fields = scored_with_filter(_cfg(FILTER, {"rollout": {"prompts_per_step": 3,
                                                                          "gen_prompts_per_step": 8}}))
    # batches of 8 prompts keep 2 each (p % 4 == 1): the second batch brings the step 4 of its 3
    assert fields == {"gen_batches": 2, "groups_kept": 3, "groups_filtered": 12, "groups_surplus": 1}
    assert sorted({sid[1] for sid in ids}) == [1, 5, 9]
    assert [why for sid, why in drops if sid[1] == 13] == ["filtered: surplus group (step 0 had its 3 kept groups)"] * 4


def test_a_named_metric_the_reward_lacks_is_a_config_error():
    kind, message = scored_with_filter(_cfg(FILTER, {"algorithm": {"filter_metric": "acc"}}))
    assert kind == "ConfigError" and "algorithm.filter_metric='acc': sample 0-0-0 has no such metric" in message


def test_a_steps_further_batch_is_queued_ahead_of_later_steps():
    from dynaresize.pipeline.streamplan import StreamQueue

    q = StreamQueue(eta=2)
    q.release(3, ["a", "b"])
    q.release(4, ["c"])
    q.release_more(3, ["d", "e"])
    assert list(q.queue) == [(3, "a"), (3, "b"), (3, "d"), (3, "e"), (4, "c")]
    assert q.outstanding == {3: 4, 4: 1} and not q.complete(3)
    with pytest.raises(ValueError, match="step 7 is not released"):
        q.release_more(7, ["x"])
