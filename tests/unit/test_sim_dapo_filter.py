"""The `dapo-filter` workload: DAPO's dynamic sampling in the simulator (workload.batch_for_step,
costmodel.stages): generation batches until the step's groups are kept, rolled out one after
another, training on the kept groups only."""

from __future__ import annotations

import numpy as np
import pytest

from dynaresize.costmodel.costs import get_hardware, get_model
from dynaresize.costmodel.stages import StageModel
from dynaresize.workload import batch_for_step
from dynaresize.workload.lengths import WORKLOADS
from dynaresize.workload.trace import Batch

SPEC = WORKLOADS["dapo-filter"]


def test_the_filtered_share_rises_and_so_do_the_generation_batches():
    shares = [SPEC.filter_share(t) for t in (0, 100, 299)]
    assert shares[0] == pytest.approx(0.3) and shares[0] < shares[1] < shares[2] < 0.7
    batches = [batch_for_step("dapo-filter", t, 512, 0, samples_per_prompt=16) for t in range(0, 300, 10)]
    for b in batches:  # the train batch is fixed: 32 kept groups of 16
        assert int(b.trained.sum()) == 512 and b.num_samples == 512 * b.num_gen_batches
        assert b.trained.reshape(-1, 16).all(axis=1).sum() == 32  # whole groups
    early = np.mean([b.num_gen_batches for b in batches[:5]])
    late = np.mean([b.num_gen_batches for b in batches[-5:]])
    assert late > early >= 1.2
    again = batch_for_step("dapo-filter", 120, 512, 0, samples_per_prompt=16)
    assert np.array_equal(again.response_tokens, batches[12].response_tokens)
    assert np.array_equal(again.trained, batches[12].trained)
    # the unfiltered workload is untouched: one batch, no masks
    plain = batch_for_step("dapo-qwen3-8b", 120, 512, 0, samples_per_prompt=16)
    assert plain.gen_batch is None and plain.trained is None and plain.num_gen_batches == 1


def test_generation_batches_roll_out_one_after_another_and_only_kept_groups_train():
    b = next(x for x in (batch_for_step("dapo-filter", t, 512, 0, samples_per_prompt=16) for t in range(50))
             if x.num_gen_batches >= 2)
    parts = [Batch(b.response_tokens[b.gen_batch == i], b.prompt_tokens[b.gen_batch == i])
             for i in range(b.num_gen_batches)]
    kept = Batch(b.response_tokens[b.trained], b.prompt_tokens[b.trained])
    model, hw = get_model("qwen3-8b"), get_hardware("h20")
    whole = StageModel(model, lambda k: b, hw)
    alone = StageModel(model, lambda k: parts[k], hw)
    trained = StageModel(model, lambda k: kept, hw)
    for r in (2, 4, 6):
        ro = whole.rollout(0, r)
        assert ro.time_s == pytest.approx(sum(alone.rollout(i, r).time_s for i in range(len(parts))))
        assert ro.work_device_s == pytest.approx(sum(alone.rollout(i, r).work_device_s for i in range(len(parts))))
        times, _, _ = whole.replica_detail(0, r)
        assert float(times.max()) == pytest.approx(ro.time_s)
    assert whole.train(0, 4).time_s == pytest.approx(trained.train(0, 4).time_s)
    assert whole.seq_tokens(0) == trained.seq_tokens(0)


def test_streaming_and_the_runtime_refuse_the_modelled_filter(tmp_path):
    from dynaresize.cli import main

    assert main(["simulate", "--workload", "dapo-filter", "--devices", "8", "--staleness", "2", "--steps", "3",
                 "--out", str(tmp_path / "s"), "--quiet", "--no-plots"]) == 2


def test_a_run_takes_it_as_its_length_workload_only_filtering_by_it():
    from dynaresize.config_load import build_config, merge
    from dynaresize.driver.job import Job
    from dynaresize.errors import ConfigError
    from dynaresize.presets import preset

    cfg = build_config(merge(preset("cpu"), {"rollout": {"length_workload": "dapo-filter"}}))
    with pytest.raises(ConfigError, match="rollout.length_workload='dapo-filter': a workload whose filtered groups "
                                          "are modelled: run it with algorithm.filter_groups=true and "
                                          "algorithm.filter_metric=workload"):
        Job(cfg)
