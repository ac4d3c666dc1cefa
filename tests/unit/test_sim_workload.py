"""The workload model: deterministic per sample id, bounded by the cap, shaped as documented,
keyed by absolute step (never by the run's length); `lengths_for_step` for models and traces."""

import json

import numpy as np
import pytest

from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.errors import ConfigError, TraceError
from dynaresize.workload import WORKLOADS, get_workload, lengths_for_step, sample_lengths, sample_lengths_array


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_lengths_in_range_and_deterministic(name):
    a = sample_lengths(name, 5, 8, 4, 48, seed=3)
    b = sample_lengths(name, 5, 8, 4, 48, seed=3)
    assert a == b
    assert len(a) == 8 and all(len(row) == 4 for row in a)
    assert all(1 <= x <= 48 and isinstance(x, int) for row in a for x in row)


def test_sample_does_not_depend_on_batch_shape():
    small = sample_lengths("longtail-drift", 7, 3, 2, 64, seed=1)
    big = sample_lengths("longtail-drift", 7, 10, 5, 64, seed=1)
    assert [row[:2] for row in big[:3]] == small


def test_seed_and_step_change_lengths():
    base = sample_lengths_array(get_workload("longtail-drift"), 1, 32, 8, 16384, seed=0)
    assert not np.array_equal(base, sample_lengths_array(get_workload("longtail-drift"), 1, 32, 8, 16384, seed=1))
    assert not np.array_equal(base, sample_lengths_array(get_workload("longtail-drift"), 2, 32, 8, 16384, seed=0))


def test_drift_grows_the_mean_and_short_tail_is_narrow():
    spec = get_workload("longtail-drift")
    early = sample_lengths_array(spec, 0, 512, 8, 16384, seed=0).mean()
    late = sample_lengths_array(spec, 299, 512, 8, 16384, seed=0).mean()
    assert late > 1.5 * early
    short = sample_lengths_array(get_workload("short-tail"), 10, 512, 8, 16384, seed=0)
    heavy = sample_lengths_array(get_workload("longtail-stationary"), 10, 512, 8, 16384, seed=0)
    assert short.max() / np.median(short) < heavy.max() / np.median(heavy)


def test_cap_raise_releases_the_tail_mid_run():
    spec = get_workload("cap-raise")
    before = sample_lengths_array(spec, 100, 512, 8, 16384, seed=0)
    after = sample_lengths_array(spec, 200, 512, 8, 16384, seed=0)
    assert before.max() <= 8192 < after.max()


def test_demo_is_u_shaped_over_its_horizon():
    h = get_workload("demo").horizon_steps
    means = [np.mean(sample_lengths("demo", s, 64, 8, 48, seed=0)) for s in range(h)]
    mid = min(means)
    assert means.index(mid) not in (0, h - 1)
    assert means[0] > mid * 1.3 and means[-1] > mid * 1.3


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_lengths_at_a_step_do_not_depend_on_the_run_length(name):
    """Step k's batch is the same in a 40-step and a 300-step simulation (and in a 1000-step one)."""
    runs = [workload_scenario(name, num_devices=8, num_steps=steps, seed=2) for steps in (40, 300, 1000)]
    for k in (0, 17, 39):
        first = runs[0].batch_of(k).response_tokens
        for sc in runs[1:]:
            assert np.array_equal(first, sc.batch_of(k).response_tokens), (name, k)
    # and the shape is the absolute-step one: the cap-raise happens at step 150 whatever the run length
    if name == "cap-raise":
        assert runs[0].batch_of(39).response_tokens.max() <= 8192 and runs[2].batch_of(200).response_tokens.max() > 8192


def test_lengths_for_step_matches_the_model_and_cuts_a_prompt_short():
    full = sample_lengths("longtail-drift", 12, 4, 16, 16384, seed=5)
    flat = [x for row in full for x in row]
    assert lengths_for_step("longtail-drift", 12, 64, 5) == flat
    assert lengths_for_step("longtail-drift", 12, 50, 5) == flat[:50]
    assert lengths_for_step("longtail-drift", 12, 8, 5, samples_per_prompt=4, max_tokens=64) == [
        x for row in sample_lengths("longtail-drift", 12, 2, 4, 64, seed=5) for x in row]
    assert lengths_for_step("longtail-drift", 13, 64, 5) != flat


def test_lengths_for_step_reads_a_trace_by_its_step_numbers(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"step": 0, "response_tokens": [10, 20, 30]}) + "\n"
                 + json.dumps({"step": 5, "response_tokens": [400, 1, 80, 7]}) + "\n")
    assert lengths_for_step(str(p), 5, 3, seed=0) == [400, 1, 80]
    assert lengths_for_step(str(p), 5, 3, seed=9) == [400, 1, 80]  # a trace ignores the seed
    assert lengths_for_step(str(p), 5, 4, seed=0, max_tokens=40) == [40, 1, 8, 1]  # x 40/400, rounded up
    with pytest.raises(TraceError, match="no line for step 3"):
        lengths_for_step(str(p), 3, 1, seed=0)
    with pytest.raises(TraceError, match="has 3 responses, 4 asked"):
        lengths_for_step(str(p), 0, 4, seed=0)
    with pytest.raises(ConfigError, match="nor a trace file"):
        lengths_for_step(str(tmp_path / "missing.jsonl"), 0, 1, seed=0)


def test_unknown_workload_is_a_config_error():
    with pytest.raises(ConfigError, match="nope"):
        sample_lengths("nope", 0, 1, 1, 8, seed=0)


def test_a_horizon_compresses_a_workloads_time_constants_and_nothing_else(tmp_path):
    from dynaresize.errors import ConfigError
    from dynaresize.workload import lengths_for_step

    n = 64
    # Step 0 is the same whatever the horizon (the drift starts at 0); later steps drift faster
    # under a shorter horizon; the workload's own horizon (300) is the default.
    assert lengths_for_step("longtail-drift", 0, n, 0, horizon_steps=40) == lengths_for_step("longtail-drift", 0, n, 0)
    assert lengths_for_step("longtail-drift", 30, n, 0, horizon_steps=300) == lengths_for_step("longtail-drift", 30, n, 0)
    assert sum(lengths_for_step("longtail-drift", 30, n, 0, horizon_steps=40)) > \
        1.3 * sum(lengths_for_step("longtail-drift", 30, n, 0))
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"step": 0, "response_tokens": [5, 6]}\n')
    with pytest.raises(ConfigError, match="only a named workload has a horizon"):
        lengths_for_step(str(trace), 0, 2, 0, horizon_steps=40)


def test_the_emulator_and_the_simulator_share_the_horizon():
    from dynaresize.config_load import build_config, merge
    from dynaresize.emulate.model import Emulator
    from dynaresize.presets import preset
    from dynaresize.workload import batch_for_step

    cfg = build_config(merge(preset("demo"), {"rollout": {"length_workload": "longtail-drift",
                                                             "length_horizon_steps": 40}}))
    emu = Emulator.from_config(cfg)
    n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    want = batch_for_step("longtail-drift", 20, n, cfg.seed, samples_per_prompt=cfg.rollout.samples_per_prompt,
                          horizon_steps=40)
    assert (emu.batch(20).response_tokens == want.response_tokens).all()
    assert (emu.scenario(6).batch_of(20).response_tokens == want.response_tokens).all()
    own = batch_for_step("longtail-drift", 20, n, cfg.seed, samples_per_prompt=cfg.rollout.samples_per_prompt)
    assert not (own.response_tokens == want.response_tokens).all()
