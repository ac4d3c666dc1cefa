"""The workload model: deterministic per sample id, bounded by the cap, shaped as documented."""

import numpy as np
import pytest

from dynaresize.errors import ConfigError
from dynaresize.sim.workload import WORKLOADS, get_workload, sample_lengths, sample_lengths_array


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_lengths_in_range_and_deterministic(name):
    a = sample_lengths(name, 5, 8, 4, 48, seed=3, num_steps=20)
    b = sample_lengths(name, 5, 8, 4, 48, seed=3, num_steps=20)
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


def test_demo_is_u_shaped():
    means = [np.mean(sample_lengths("demo", s, 64, 8, 48, seed=0, num_steps=12)) for s in range(12)]
    mid = min(means)
    assert means.index(mid) not in (0, 11)
    assert means[0] > mid * 1.3 and means[-1] > mid * 1.3


def test_unknown_workload_is_a_config_error():
    with pytest.raises(ConfigError, match="nope"):
        sample_lengths("nope", 0, 1, 1, 8, seed=0)
