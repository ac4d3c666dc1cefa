"""Issue 20: the seed paper's experiment. Predefined splits (`policy.allowed_rollout`), the `h20`
and `qwen3-8b` presets, the `dapo-qwen3-8b` workload, the serial pipeline (staleness 0) in the
simulator, and scripts/seed_experiment.py on a short run. Pure and fast (no Ray)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.config_load import apply_overrides, build_config
from dynaresize.costmodel.costs import (HARDWARE_PRESETS, get_hardware, get_model, min_train_devices,
                                        rollout_constants)
from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.emulate.model import emulated_bounds, parse, run_bounds
from dynaresize.errors import ConfigError
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.sim.engine import run_policy
from dynaresize.sim.oracle import best_static, build_table, grid, oracle_plan, pilot_split
from dynaresize.types import Bounds
from dynaresize.workload import lengths_for_step

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ predefined splits


def test_bounds_allow_only_the_predefined_splits():
    b = Bounds(num_devices=8, min_rollout=1, min_train=2, allowed_rollout=(2, 4, 6, 7))
    assert b.splits() == (2, 4, 6)  # 7 leaves one trainer: the other bounds still apply
    assert b.allowed(4) and not b.allowed(3)
    assert "allowed_rollout=2,4,6,7" in b.why_not(3)
    assert "min_train" in b.why_not(7)
    assert b.nearest(5.2) == 6 and b.nearest(3) == 2  # ties go to the smaller pool
    assert grid(b, include=(3,)) == (2, 4, 6)  # the sweeps never enumerate another split
    assert Bounds(num_devices=8).splits() == tuple(range(1, 8))  # empty: every split


def test_allowed_rollout_config_parses_and_names_bad_values():
    cfg = build_config(apply_overrides({}, ["cluster.devices=8", "policy.allowed_rollout=2,4,6"]))
    assert cfg.policy.allowed_rollout == (2, 4, 6)
    assert build_config(apply_overrides({}, ["cluster.devices=8", "policy.allowed_rollout=4"])).policy.allowed_rollout == (4,)
    for value, fragment in (("6,2", "ascending"), ("0,2", ">= 1"), ("2,8", "< devices 8")):
        with pytest.raises(ConfigError, match=rf"policy\.allowed_rollout='{value}'.*{fragment}"):
            build_config(apply_overrides({}, ["cluster.devices=8", f"policy.allowed_rollout={value}"]))


def test_runtime_refuses_a_start_outside_the_predefined_splits():
    from dynaresize.driver.run import Run

    run = Run.__new__(Run)
    run.cfg = build_config(apply_overrides({}, ["cluster.devices=8", "cluster.rollout_devices=3",
                                                "policy.allowed_rollout=2,4,6"]))
    with pytest.raises(ConfigError, match="cluster.rollout_devices=3.*allowed_rollout=2,4,6"):
        run._controller({})
    run.cfg = build_config(apply_overrides({}, ["cluster.devices=8", "cluster.rollout_devices=4",
                                                "policy.allowed_rollout=2,4,6"]))
    ctl, assignment = run._controller({})
    assert assignment.num_rollout == 4 and ctl.bounds.splits() == (2, 4, 6)


def test_scenario_and_emulator_bounds_carry_the_predefined_splits():
    cfg = PolicyConfig(allowed_rollout=(2, 4, 6))
    sc = workload_scenario("dapo-qwen3-8b", num_devices=8, num_steps=4, model="qwen3-8b", accelerator="h20")
    assert sc.bounds(cfg).splits() == (2, 4, 6)
    assert emulated_bounds(parse("h20:qwen3-8b"), cfg, 8).splits() == (2, 4, 6)
    run = build_config(apply_overrides({}, ["cluster.devices=8", "policy.allowed_rollout=2,4,6"]))
    assert run_bounds(run).splits() == (2, 4, 6)
    with pytest.raises(ConfigError, match="devices=8"):  # min_train 2 (the memory floor) leaves no 7
        workload_scenario("dapo-qwen3-8b", num_devices=8, num_steps=4, model="qwen3-8b",
                          accelerator="h20").bounds(PolicyConfig(allowed_rollout=(7,)))


def test_simulate_cli_sweeps_only_the_predefined_splits(tmp_path):
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "dynaresize", "simulate", "--workload", "dapo-qwen3-8b", "--devices", "8",
           "--steps", "12", "--model", "qwen3-8b", "--accelerator", "h20", "--policies", "best-static,hysteresis",
           "--set", "policy.allowed_rollout=2,4,6", "--out", str(out), "--no-plots", "--quiet"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    doc = json.loads((out / "summary.json").read_text())
    assert [r["rollout_devices"] for r in doc["static_sweep"]] == [2, 4, 6]
    assert doc["samples_per_step"] == 512  # the recipe's 32 prompts x 16 samples
    bad = subprocess.run(cmd[:-4] + ["--set", "policy.allowed_rollout=6,2", "--out", str(out), "--no-plots"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "allowed_rollout='6,2'" in bad.stderr


# ------------------------------------------------------------------ presets and workload


def test_h20_and_qwen3_8b_presets():
    hw, m = get_hardware("h20"), get_model("qwen3-8b")
    assert (hw.hbm_bytes, hw.hbm_bw, hw.peak_flops, hw.nvlink_bw) == (96e9, 4.0e12, 148e12, 450e9)
    assert "h20" in HARDWARE_PRESETS and parse("h20:qwen3-8b").spec == "h20:qwen3-8b"
    # Qwen3-8B config.json: the parameter count follows from its shapes (untied embeddings, q/k norms)
    v, h, layers, heads, kv, hd, inter = m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, \
        m.head_dim, 12288
    per_layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter + 2 * h + 2 * hd
    assert m.num_params == pytest.approx(2 * v * h + layers * per_layer + h, rel=1e-3)
    assert (layers, h, heads, kv, hd, v) == (36, 4096, 32, 8, 128, 151936)
    assert m.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert min_train_devices(m, hw) == 2  # 8.19e9 x 14 B does not fit 70% of one 96 GB device
    c = rollout_constants(m, hw)
    assert c.t_weights == pytest.approx(1.7 * 2 * 8.19e9 / 4.0e12)
    assert c.t_flop == pytest.approx(2 * 8.19e9 / (148e12 * m.mfu_decode))  # H20: 148 TFLOPS bf16 dense


def test_dapo_workload_follows_the_recipe_and_grows():
    sc = workload_scenario("dapo-qwen3-8b", num_devices=8, num_steps=300, model="qwen3-8b", accelerator="h20")
    assert sc.samples_per_step == 32 * 16 and sc.hardware.name == "h20"
    early = np.concatenate([lengths_for_step("dapo-qwen3-8b", t, 512, 0) for t in range(5)])
    late = np.concatenate([lengths_for_step("dapo-qwen3-8b", t, 512, 0) for t in range(295, 300)])
    assert early.max() <= 8192 and late.max() == 8192  # the recipe's max_response_length
    assert np.median(late) > 1.8 * np.median(early)
    assert workload_scenario("dapo-qwen3-8b", num_devices=8, num_steps=3, prompts_per_step=8).samples_per_step == 128


# ------------------------------------------------------------------ serial pipeline (staleness 0)


def _small(steps: int = 24):
    sc = workload_scenario("dapo-qwen3-8b", num_devices=8, num_steps=steps, model="qwen3-8b", accelerator="h20",
                           prompts_per_step=8)
    return sc, sc.stages(), sc.bounds(PolicyConfig(allowed_rollout=(2, 4, 6)))


@pytest.mark.parametrize("serial", [False, True])
def test_engine_matches_the_table_for_static_splits(serial):
    sc, stages, b = _small()
    table = build_table(stages, b.splits(), 8, sc.num_steps, serial=serial)
    for j, r in enumerate(b.splits()):
        res = run_policy(sc, stages, Planned("s", [r] * sc.num_steps), b, start_rollout=r, reversal_window=5,
                         serial=serial)
        assert res.total_time_s == pytest.approx(table.static_total()[j], rel=1e-9)
    if serial:  # a serial step is rollout + train + sync of the same batch
        k = 3
        expect = stages.rollout(k, 2).time_s + stages.train(k, 6).time_s + stages.sync_s
        assert table.step_s()[k, 0] == pytest.approx(expect)
        assert (table.prologue == 0).all()


def test_serial_is_slower_and_the_oracle_beats_every_static():
    sc, stages, b = _small()
    one = build_table(stages, b.splits(), 8, sc.num_steps)
    ser = build_table(stages, b.splits(), 8, sc.num_steps, serial=True)
    assert (ser.static_total() > one.static_total()).all()
    path, total = oracle_plan(ser, stages, 8)
    assert total <= best_static(ser)[1] + 1e-6 and set(path) <= {2, 4, 6}
    res = run_policy(sc, stages, Planned("oracle", path), b, start_rollout=path[0], reversal_window=5, serial=True)
    assert res.total_time_s == pytest.approx(total, rel=1e-6)
    # the serial pilot minimises the sum of the stages over the first steps
    r = pilot_split(stages, b, sc.num_steps, 3, serial=True)
    sums = {s: sum(stages.rollout(k, s).time_s + stages.train(k, 8 - s).time_s for k in range(3)) for s in b.splits()}
    assert r == min(sums, key=sums.get)


def test_hysteresis_keeps_to_the_predefined_splits_and_adds_serial_stages():
    sc, stages, b = _small(40)
    cfg = replace(PolicyConfig(), name="hysteresis", allowed_rollout=(2, 4, 6))
    for staleness in (0, 1):
        pol = make_policy(cfg, b, num_steps=sc.num_steps, simulator=True, pilot_rollout=6, staleness=staleness)
        assert pol.model.serial is (staleness == 0)
        res = run_policy(sc, stages, pol, b, start_rollout=6, reversal_window=20, serial=staleness == 0)
        assert {t[3] for t in res.timeline} <= {2, 4, 6}
        assert res.resizes >= 1  # 2:6 is far too few trainers: it leaves it
    pol = make_policy(cfg, b, num_steps=sc.num_steps, staleness=0)
    a = np.array([10.0, 20.0])
    assert np.allclose(pol.model._combine(a, a[::-1], 1.0), [30.0, 30.0])


# ------------------------------------------------------------------ the script


def test_seed_script_short_run():
    spec = importlib.util.spec_from_file_location("seed_experiment", ROOT / "scripts" / "seed_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    s = mod.Setting("t", steps=30, switch_s=mod.PAPER_SWITCH_S)
    sc = s.scenario()
    t = mod._switch_s(sc)
    assert t["6:2->4:4"]["critical_s"] == pytest.approx(187.0) and t["4:4->6:2"]["critical_s"] == pytest.approx(187.0)
    res = mod.run_setting(replace(s, switch_s=None), mod.MAIN_POLICIES)
    runs = res["runs"]
    assert runs["best-static"]["vs_best_static"] == pytest.approx(1.0)
    assert runs["oracle"]["vs_best_static"] >= 1.0 - 1e-9
    assert max(runs[f"static:{r}"]["vs_best_static"] for r in (2, 4, 6)) == pytest.approx(1.0)
    assert set(runs["hysteresis-predefined"]["rollout_devices"]) <= {2, 4, 6}
    assert "| paper" in mod.main_table([res])
