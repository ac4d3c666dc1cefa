"""The cost model's weight-sync term with delta sync (costmodel/costs.py): a step pays the bytes
of its changed values at the change fraction, a joining engine pays the full weights (in its
move's `load_weights`), and the simulator's stage model, the emulator that paces the runtime and
the policy's move cost use the same numbers."""

from __future__ import annotations

import math

import pytest

from dynaresize.config_load import build_config, merge
from dynaresize.costmodel import costs
from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.emulate.model import Emulator
from dynaresize.errors import ConfigError
from dynaresize.presets import preset
from dynaresize.roles.delta_sync import encoded_bytes


def test_delta_bytes_take_the_cheapest_encoding_as_the_runtime_does():
    n = 1 << 24
    for f in (0.0, 0.005, 0.02, 0.05, 0.3, 0.97, 1.0):
        runtime = min(encoded_bytes(n, int(f * n), 2).values())
        assert costs.delta_bytes(n, f) == pytest.approx(runtime, rel=1e-3, abs=8)
    assert costs.delta_bytes(100, 0.02) == pytest.approx(100 * 0.02 * 6)  # indices below 1/32
    assert costs.delta_bytes(100, 0.5) == pytest.approx(100 * (0.125 + 1.0))  # a bitmap
    assert costs.delta_bytes(100, 1.0) == 200  # dense


def test_a_step_pays_delta_and_a_joining_engine_pays_full():
    full = costs.get_model("7b")
    delta = costs.with_sync(full, "delta")
    assert delta.sync_changed_fraction == costs.DEFAULT_CHANGED_FRACTION == 0.02
    assert costs.sync_s(full) == pytest.approx(full.sync_alpha_s + full.weight_bytes / full.sync_bw)
    assert costs.sync_s(delta) == pytest.approx(full.sync_alpha_s + 7.62e9 * 0.12 / full.sync_bw)
    assert costs.sync_s(delta, full=True) == costs.sync_s(full)
    wake = costs.op_cost("load_weights", full, num_train_before=4, num_train_after=3, num_moving=1)[0]
    joined = costs.op_cost("load_weights", delta, num_train_before=4, num_train_after=3, num_moving=1)[0]
    assert wake == full.engine_wake_s
    assert joined == pytest.approx(wake + costs.sync_s(full) - costs.sync_s(delta))
    assert costs.with_sync(full, "delta", 0.1).sync_changed_fraction == 0.1
    with pytest.raises(ConfigError, match="changed_fraction=1.5"):
        costs.with_sync(full, "delta", 1.5)
    with pytest.raises(ConfigError, match="weight_sync='sparse'"):
        costs.with_sync(full, "sparse")


def _emulated(**rollout):
    return build_config(merge(preset("cpu"), {"cluster": {"devices": 8, "rollout_devices": 4, "emulate": "h100:7b"},
                                              "rollout": rollout}))


def test_the_emulator_and_the_simulator_agree_on_the_sync_term():
    assert costs.sync_mode_of(_emulated()) == "full"  # fp32 engines on the CPU
    assert costs.sync_mode_of(_emulated(dtype="bf16")) == "delta"
    assert costs.sync_mode_of(_emulated(dtype="bf16", weight_sync="full")) == "full"
    em = Emulator.from_config(_emulated(dtype="bf16"))
    sim = workload_scenario("longtail-drift", num_devices=8, num_steps=3, weight_sync="delta").stages()
    assert em.sync_s == sim.sync_s == costs.sync_s(costs.with_sync(costs.get_model("7b"), "delta"))
    em.sync_changed("delta", 0.013)  # what a run measured
    sim = workload_scenario("longtail-drift", num_devices=8, num_steps=3, weight_sync="delta",
                            changed_fraction=0.013).stages()
    assert em.sync_s == sim.sync_s < costs.sync_s(costs.get_model("7b"))
    moves = {m: costs.op_cost("load_weights", em.model, num_train_before=4, num_train_after=3, num_moving=1)[0]
             for m in ("em",)}
    assert math.isclose(em.op_s("load_weights", num_train_before=4, num_train_after=3, num_moving=1), moves["em"])
    assert Emulator.from_config(_emulated()).sync_s == costs.sync_s(costs.get_model("7b"))
