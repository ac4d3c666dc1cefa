"""Emulated dynamic sampling (issue 33): a run with `algorithm.filter_metric = workload` filters the
groups the length workload's model filters (driver/dynamic_sampling.workload_filter), so it
generates the simulator's generation batches, and the emulator paces each batch as the simulator
times it (emulate/model.Emulator.rollout_plan). Pure and fast: no Ray, no model."""

from __future__ import annotations

import pytest

from dynaresize.config_load import build_config, merge
from dynaresize.driver.dynamic_sampling import workload_filter
from dynaresize.emulate.model import Emulator
from dynaresize.errors import ConfigError
from dynaresize.pipeline.dispatch import batch_position, replica_shares
from dynaresize.presets import preset
from dynaresize.rl.dapo import GroupFilter

P, S = 8, 4
JOB = {"cluster": {"devices": 8, "rollout_devices": 2, "emulate": "h20:qwen3-8b"},
       "rollout": {"prompts_per_step": P, "samples_per_prompt": S, "max_new_tokens": 8, "engine": "hf",
                   "length_workload": "dapo-filter", "length_horizon_steps": 20},
       "algorithm": {"filter_groups": True, "filter_metric": "workload", "max_num_gen_batches": 10},
       "policy": {"name": "static", "allowed_rollout": [2, 4, 6]}}


def _cfg(**over):
    return build_config(merge(merge(preset("demo"), JOB), over))


def test_the_runtime_filters_the_groups_the_simulator_filters():
    cfg = _cfg()
    emu = Emulator.from_config(cfg)
    many = 0
    for step in range(12):
        batch = emu.batch(step)
        f = GroupFilter(step=step, target=P, max_batches=10, batches=0)
        while not f.full:  # driver/dynamic_sampling.complete: one batch after another until P kept
            f.batches += 1
            b = f.batches - 1
            f.add_decided(*workload_filter(cfg, step, set(range(b * P, (b + 1) * P))))
        assert f.batches == batch.num_gen_batches, step
        trained = {int(i) // S for i in range(batch.num_samples) if batch.trained[i]}
        assert set(f.chosen) == trained, step  # the same groups train, so training is paced alike
        assert all(why.startswith("filtered: the workload dapo-filter's model") for why in f.filtered.values())
        many += f.batches >= 2
    assert many >= 6  # the check means something: most steps take extra batches


@pytest.mark.parametrize("num_rollout", [2, 4, 6])
def test_each_generation_batch_is_paced_as_the_simulator_times_it(num_rollout):
    emu = Emulator.from_config(_cfg())
    for step in range(6):
        batch, n = emu.batch(step), P * S
        plan = {positions: t for positions, t in emu.rollout_plan(step, num_rollout) if positions}
        total = 0.0
        for b in range(batch.num_gen_batches):  # the runtime sends batch b's groups as one dispatch
            ids = [(step, b * P + j, s) for j in range(P) for s in range(S)]
            shares = [tuple(batch_position(ids[i], S) for i in share) for share in replica_shares(ids, num_rollout, S)]
            assert all(share in plan for share in shares), (step, b)  # pacing.rollout_chunks finds every share
            total += max(plan[share] for share in shares)
        assert sum(len(p) for p in plan) == batch.num_samples
        assert total == pytest.approx(emu.rollout_s(step, num_rollout))  # the simulator's stage time: the sum
    assert emu.batch(0).num_gen_batches >= 2


@pytest.mark.parametrize("over, field, words", [
    ({"algorithm": {"filter_metric": "reward"}}, "algorithm.filter_metric='reward'", "only `workload`"),
    ({"rollout": {"length_workload": "dapo-qwen3-8b"}}, "algorithm.filter_metric='workload'", "filtered share"),
    ({"rollout": {"gen_prompts_per_step": 4}}, "rollout.gen_prompts_per_step=4", "prompts_per_step (8)"),
    ({"algorithm": {"max_num_gen_batches": 8}}, "algorithm.max_num_gen_batches=8", "dapo-filter: 10"),
    ({"train": {"staleness": 2}}, "algorithm.filter_groups=True", "streaming"),
])
def test_what_emulated_filtering_cannot_pace_is_refused(over, field, words):
    with pytest.raises(ConfigError) as err:
        _cfg(**over)
    line = next(x for x in str(err.value).splitlines() if field in x)
    assert words in line, line


def test_the_workload_metric_runs_unpaced_too_and_needs_synthetic_lengths():
    cfg = build_config(merge(merge(preset("cpu"), JOB), {"cluster": {"emulate": None}}))
    assert cfg.algorithm.filter_metric == "workload" and cfg.cluster.emulate is None
    with pytest.raises(ConfigError, match="algorithm.filter_metric='workload': needs rollout.synthetic_lengths"):
        build_config(merge(merge(preset("cpu"), JOB), {"cluster": {"emulate": None},
                                                       "rollout": {"synthetic_lengths": False}}))
