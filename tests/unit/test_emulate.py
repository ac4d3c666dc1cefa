"""Emulated accelerators (emulate/model.py): parsing, config checks, durations equal to the
simulator's own functions, time scaling (the pacer and the run's clock), and the router's split."""

import math
from dataclasses import replace

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.config_load import build_config, merge
from dynaresize.costmodel import costs
from dynaresize.costmodel.stages import Batch, StageModel
from dynaresize.emulate.clock import EmulatedClock
from dynaresize.emulate.model import (DEFAULT_TIME_SCALE, Emulator, Target, covered_s, emulated_bounds, parse,
                                      run_bounds, time_scale_of)
from dynaresize.emulate.predict import predict, start_split
from dynaresize.errors import ConfigError
from dynaresize.presets import preset
from dynaresize.workload import get_workload, sample_lengths


def _emu(target="h100:7b", workload="longtail-drift", prompts=8, samples=4, steps=10, seed=3):
    return Emulator(parse(target), workload=workload, prompts_per_step=prompts, samples_per_prompt=samples, seed=seed,
                    num_steps=steps)


def _cfg(**cluster):
    data = merge(preset("cpu"), {"cluster": {"devices": 8, "rollout_devices": 4, **cluster}})
    return build_config(data)


# ------------------------------------------------------------------ parsing and config checks


def test_parse_names_accelerator_and_model():
    assert parse("h100:7b") == Target(accelerator="h100", model="7b")
    assert parse(" A100:70B ").spec == "a100:70b"
    for bad, needle in (("h100", "ACCEL:MODEL"), (":7b", "ACCEL:MODEL"), ("x100:7b", "unknown accelerator 'x100'"),
                        ("h100:9b", "unknown model '9b'"), ("none", "ACCEL:MODEL")):
        with pytest.raises(ValueError, match=needle):
            parse(bad)


def test_every_named_accelerator_is_a_hardware_preset():
    assert set(costs.HARDWARE_PRESETS) >= {"h100", "h200", "a100"}
    h100, h200, a100 = (costs.get_hardware(n) for n in ("h100", "h200", "a100"))
    assert h100 == costs.Hardware()  # the simulator's default device
    assert h200.hbm_bw > h100.hbm_bw > a100.hbm_bw and h200.hbm_bytes > h100.hbm_bytes
    assert a100.peak_flops < h100.peak_flops == h200.peak_flops
    with pytest.raises(ConfigError, match="accelerator='tpu'"):
        costs.get_hardware("tpu")


@pytest.mark.parametrize("cluster, needle", [
    ({"emulate": "x100:7b"}, "cluster.emulate='x100:7b': unknown accelerator"),
    ({"emulate": "h100:7b", "time_scale": 0}, "cluster.time_scale=0.0: must be > 0"),
    ({"time_scale": 5}, "cluster.time_scale=5.0: only used with cluster.emulate"),
    ({"emulate": "h100:7b", "rollout_devices": 7}, "cluster.rollout_devices=7: not a legal split for h100:7b"),
    ({"emulate": "h100:70b", "devices": 8}, "cluster.devices=8: too few for h100:70b"),
])
def test_config_errors_name_the_field_and_value(cluster, needle):
    with pytest.raises(ConfigError) as exc:
        _cfg(**cluster)
    assert any(needle in line for line in exc.value.errors), exc.value.errors


def test_bad_emulation_on_the_command_line_exits_2_without_traceback(capsys):
    from dynaresize.cli import main

    assert main(["run", "--emulate", "h100:7", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert "cluster.emulate='h100:7'" in err and "Traceback" not in err
    assert main(["compare", "--policies", "hysteresis", "--emulate", "none", "--out", "/nonexistent/x"]) == 2
    assert "compare needs an emulated accelerator" in capsys.readouterr().err


def test_time_scale_and_bounds():
    plain, emulated = _cfg(), _cfg(emulate="h100:7b", time_scale=4)
    assert time_scale_of(plain.cluster) == 1.0 and time_scale_of(emulated.cluster) == 4.0
    assert time_scale_of(_cfg(emulate="h100:7b").cluster) == DEFAULT_TIME_SCALE
    b = run_bounds(plain)
    assert (b.min_rollout, b.min_train, b.move_unit) == (1, 1, 1)
    b = run_bounds(emulated)  # a 7B's training state (16 B/param: 121.9 GB) needs three 80 GB devices
    assert (b.min_rollout, b.min_train, b.move_unit) == (1, 3, 1)
    m = costs.get_model("32b")
    big = emulated_bounds(parse("h100:32b"), PolicyConfig(), 16)  # TP2 replicas: the move unit
    assert big.move_unit == m.rollout_tp == big.min_rollout == 2
    assert big.min_train == costs.min_train_devices(m, costs.get_hardware("h100")) == 10  # 524.8 GB / 56 GB
    assert emulated_bounds(parse("h200:32b"), PolicyConfig(), 16).min_train < big.min_train  # more HBM
    assert emulated_bounds(parse("h100:7b"), PolicyConfig(min_train=4, move_unit=2), 8).min_train == 4  # the user's, above


# ------------------------------------------------------------------ durations = the simulator's


def test_lengths_are_the_workload_models_at_its_reference_cap():
    emu = _emu()
    spec = get_workload("longtail-drift")
    want = sample_lengths("longtail-drift", 5, 8, 4, spec.cap_tokens, 3)
    assert emu.lengths(5).tolist() == want
    batch = emu.batch(5)
    assert batch.response_tokens.tolist() == [x for row in want for x in row]
    assert (batch.prompt_tokens == spec.prompt_tokens).all()
    assert emu.sample_index((5, 2, 3)) == 2 * 4 + 3


@pytest.mark.parametrize("target", ["h100:7b", "a100:7b", "h200:32b"])
def test_durations_match_the_simulators_functions(target):
    emu = _emu(target)
    model, hw = costs.get_model(target.split(":")[1]), costs.get_hardware(target.split(":")[0])
    stages = StageModel(model, lambda b: Batch(emu.batch(b).response_tokens, emu.batch(b).prompt_tokens), hw)
    for step in (0, 4, 9):
        for n in (2, 5):
            assert emu.train_s(step, n) == stages.train(step, n).time_s
        b = emu.batch(step)
        seq = (b.response_tokens + b.prompt_tokens).astype(np.float64)
        by_hand = costs.train_device_s(model, float(seq.sum()), float((seq * seq).sum()), hw) / 5 + model.train_comm_s
        assert emu.train_s(step, 5) == pytest.approx(by_hand, rel=1e-12)
        for r in (2, 4, 6):
            assert emu.rollout_s(step, r) == stages.rollout(step, r).time_s
        assert emu.rollout_floor_s(step) == stages.data(step).floor_s
    assert emu.sync_s == costs.sync_s(model)
    assert emu.train_fixed_s == model.train_comm_s
    for name in costs.OP_COSTS:
        want = costs.op_cost(name, model, num_train_before=6, num_train_after=4, num_moving=2, hw=hw)[0]
        assert emu.op_s(name, num_train_before=6, num_train_after=4, num_moving=2) == want
    with pytest.raises(ValueError):
        emu.op_s("no_such_op", num_train_before=1, num_train_after=1, num_moving=1)


def test_the_same_job_is_slower_on_an_a100():
    fast, slow = _emu("h100:7b"), _emu("a100:7b")
    assert slow.train_s(3, 4) > 2 * fast.train_s(3, 4) - fast.train_fixed_s  # 312 vs 989 TFLOPS
    assert slow.rollout_s(3, 4) > 1.4 * fast.rollout_s(3, 4)  # 2.0 vs 3.35 TB/s decode


@pytest.mark.parametrize("target, num_rollout", [("h100:7b", 3), ("h100:7b", 5), ("h200:32b", 4), ("h200:32b", 5)])
def test_rollout_plan_is_the_simulators_replicas(target, num_rollout):
    emu = _emu(target, prompts=6, samples=4)
    tp = emu.model.rollout_tp
    plan = emu.rollout_plan(2, num_rollout)
    assert len(plan) == num_rollout
    served = sorted(i for positions, _ in plan for i in positions)
    assert served == list(range(24))  # every sample exactly once
    times, _, _ = emu.stages.replica_detail(2, num_rollout)
    n_rep = num_rollout // tp
    for slot, (positions, pace_s) in enumerate(plan):
        j = slot // tp
        if j >= n_rep:
            assert positions == () and pace_s == 0.0  # a device short of a whole replica
            continue
        assert pace_s == times[j]
        assert all(i % n_rep == j for i in positions)  # sample i -> replica i mod R/tp, as the simulator
    assert max(p for _, p in plan) == emu.rollout_s(2, num_rollout)


@pytest.mark.parametrize("target, num_rollout", [("h100:7b", 3), ("h100:7b", 5), ("h200:32b", 4)])
def test_stream_plan_is_the_streaming_engines_shares(target, num_rollout):
    """Streaming: shares of ceil(B / replicas) consecutive samples, each paced to its time on one
    replica (`StageModel.chunk`, as `sim.stream` dispatches them); a replica's devices split it.
    A step's training parts add up to its whole training time."""
    emu = _emu(target, prompts=6, samples=4)
    tp = emu.model.rollout_tp
    shares = emu.stream_shares(2, num_rollout)
    share = -(-24 // (num_rollout // tp))
    assert shares == [(lo, min(lo + share, 24)) for lo in range(0, 24, share)]
    plan = emu.stream_plan(2, num_rollout)
    assert len(plan) == len(shares) * tp
    assert sorted(i for positions, *_ in plan for i in positions) == list(range(24))
    lengths = emu.lengths_flat(2)
    for k, (lo, hi) in enumerate(shares):
        ch = emu.stages.chunk(2, lo, hi)
        for positions, pace_s, body_s, longest in plan[k * tp:(k + 1) * tp]:
            assert set(positions) <= set(range(lo, hi)) and (pace_s, body_s) == (ch.time_s, ch.body_s)
            assert body_s <= pace_s and lo <= longest < hi and lengths[longest] == lengths[lo:hi].max()
    parts = emu.train_part_s(2, list(range(10)), 4, last=False) + emu.train_part_s(2, list(range(10, 24)), 4, last=True)
    assert parts == pytest.approx(emu.train_s(2, 4), rel=1e-12)


def test_report_carries_the_engines_floor_and_the_fixed_train_time():
    from dynaresize.types import StepReport

    emu = _emu()
    r = StepReport(step=1, now_s=0.0, num_rollout=4, num_train=4, rollout_s=1e6, train_s=50.0)
    out = emu.report(r, 2)
    assert out.rollout_floor_s == emu.rollout_floor_s(2) and out.train_fixed_s == emu.train_fixed_s
    assert emu.report(r, None).rollout_floor_s == 0.0
    # one-step-off: the emulated batches' training demand (what the simulator's engine reports)
    tok = emu.report(replace(r, train_tokens=7, next_train_tokens=9), 2)
    assert (tok.train_tokens, tok.next_train_tokens) == (emu.stages.seq_tokens(1), emu.stages.seq_tokens(2))
    assert emu.stages.seq_tokens(2) == int(emu.batch(2).response_tokens.sum() + emu.batch(2).prompt_tokens.sum())


def test_prediction_runs_the_runtimes_policy_from_the_runtimes_split():
    cfg = build_config(merge(preset("demo"), {"steps": 6}))
    emu = Emulator.from_config(cfg)
    assert Emulator.from_config(_cfg()) is None
    res = predict(cfg, "static:3")
    assert res.start_rollout == 3 and res.resizes == 0 and [r[3] for r in res.timeline] == [3] * 6
    assert res.num_samples == 6 * cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    start = start_split(cfg)
    assert start == cfg.cluster.rollout_devices
    # the static run's total is the prologue plus each step's slower stage plus the sync
    k_total = emu.rollout_s(0, 3) + sum(max(emu.train_s(k, 3), emu.rollout_s(k + 1, 3) if k < 5 else 0.0)
                                        + (emu.sync_s if k < 5 else 0.0) for k in range(6))
    assert res.total_time_s == pytest.approx(k_total, rel=1e-9)


def test_streaming_prediction_is_the_runtimes_pipeline():
    """train.staleness >= 2: predict and best_static run the streaming engine as the runtime runs
    it (trainers accumulating as a step's samples arrive, one share per engine at a time)."""
    from dynaresize.emulate.predict import best_static
    from dynaresize.policy.baselines import Planned
    from dynaresize.sim.stream import run_stream

    cfg = build_config(merge(preset("demo"), {"steps": 6, "train": {"staleness": 2}}))
    emu = Emulator.from_config(cfg)
    sc = emu.scenario(cfg.cluster.devices)
    bounds = run_bounds(cfg)
    res = predict(cfg, "static:3")
    same = run_stream(sc, sc.stages(), Planned("s", [3] * 6), bounds, start_rollout=3, staleness=2,
                      admit=False)
    assert res.staleness == 2 and res.total_time_s == pytest.approx(same.total_time_s, rel=1e-12)
    split, rate = best_static(cfg)
    totals = {r: run_stream(sc, sc.stages(), Planned("s", [r] * 6), bounds, start_rollout=r, staleness=2,
                            admit=False).total_time_s for r in bounds.splits()}
    assert split == min(totals, key=lambda r: (totals[r], r))
    assert rate == pytest.approx(sc.total_samples() / totals[split])


# ------------------------------------------------------------------ time scaling


def test_pace_sleeps_to_the_scaled_time_and_flags_an_overrun():
    from dynaresize.cluster.pacing import pace

    now = {"t": 100.5}  # the call started at 100 and its real work ended at 100.5
    slept = []

    def sleep(s):
        slept.append(s)
        now["t"] += s

    out = pace({"t0": 100.0, "t1": 100.5}, 100.0, emulated_s=40.0, time_scale=20.0, clock=lambda: now["t"], sleep=sleep)
    assert slept == [pytest.approx(1.5)]  # 40 emulated s at 20x = 2 wall s, 0.5 of them real work
    assert out["t1"] == pytest.approx(102.0) and out["paced_s"] == pytest.approx(2.0) and not out["overrun"]
    now["t"] = 105.0  # the real work took 5 s: longer than the 2 s it is paced to
    out = pace({"t0": 100.0, "t1": 105.0}, 100.0, emulated_s=40.0, time_scale=20.0, clock=lambda: now["t"], sleep=sleep)
    assert len(slept) == 1 and out["overrun"] and out["t1"] == 105.0 and out["real_s"] == pytest.approx(5.0)


def test_clock_counts_paced_work_at_scale_and_the_rest_one_to_one():
    c = EmulatedClock(10.0)
    c.add(0.0, 10.0)
    c.add(20.0, 30.0)
    c.add(5.0, 15.0)  # overlapping work counts once
    assert c.work(0.0, 40.0) == 25.0 and c.span(0.0, 40.0) == 40.0 + 9.0 * 25.0
    assert c.span(12.0, 25.0) == 13.0 + 9.0 * 8.0
    assert c.span(15.0, 20.0) == 5.0  # no work: the driver's time, 1:1
    plain = EmulatedClock(1.0)
    plain.add(0.0, 10.0)
    assert plain.span(0.0, 40.0) == 40.0
    assert covered_s([(0, 2), (1, 3), (5, 6)]) == 4.0


def test_router_sends_each_device_its_replica_at_once():
    pytest.importorskip("ray")
    from dynaresize.cluster.pacing import DriverPacing, PacedRequests
    from dynaresize.roles.base import GenRequest

    cfg = build_config(merge(preset("cpu"), {"cluster": {"devices": 8, "rollout_devices": 4, "emulate": "h100:7b"},
                                             "rollout": {"prompts_per_step": 6, "samples_per_prompt": 4}}))
    pacing = DriverPacing(cfg)
    groups = [[GenRequest(sample_id=(2, p, s), prompt_ids=[1], max_new_tokens=4, seed=0) for s in range(4)]
              for p in range(6)]
    chunks = pacing.rollout_chunks(2, groups, 4)
    plan = pacing.emulator.rollout_plan(2, 4)
    assert len(chunks) == 4 and all(isinstance(c, PacedRequests) for c in chunks)
    for chunk, (positions, pace_s) in zip(chunks, plan):
        assert [pacing.emulator.sample_index(r.sample_id) for r in chunk] == list(positions)
        assert chunk.pace_s == pace_s
    # unpaced: the same shares (the runtime's dispatch path), only not paced
    unpaced = DriverPacing(build_config(merge(preset("cpu"), {"cluster": {"devices": 8, "rollout_devices": 4},
                                                              "rollout": {"prompts_per_step": 6, "samples_per_prompt": 4}})))
    plain = unpaced.rollout_chunks(2, groups, 4)
    assert [[r.sample_id for r in c] for c in plain] == [[r.sample_id for r in c] for c in chunks]
    assert not any(isinstance(c, PacedRequests) for c in plain) and unpaced.train_s(2, 4) is None
    assert math.isclose(pacing.train_s(2, 4), pacing.emulator.train_s(2, 4))
    evals = [[GenRequest(sample_id=(-1, p, s), prompt_ids=[1], max_new_tokens=4, seed=0) for s in range(4)]
             for p in range(2)]
    assert pacing.rollout_chunks(-1, evals, 4) == evals  # evaluation (step -1) is not modelled: unpaced
    stream = pacing.rollout_chunks(2, groups, 4, stream=True)  # the streaming pipeline's shares
    assert [[pacing.emulator.sample_index(r.sample_id) for r in c] for c in stream] == \
        [list(p) for p, *_ in pacing.emulator.stream_plan(2, 4)]
    # paced as the simulator times each share (the same cut as unpaced, pipeline.dispatch.stream_shares)
    assert [(c.pace_s, c.body_s) for c in stream] == \
        [pytest.approx((t, b)) for _, t, b, _ in pacing.emulator.stream_plan(2, 4)]
    assert [[r.sample_id for r in c] for c in unpaced.rollout_chunks(2, groups, 4, stream=True)] == \
        [[r.sample_id for r in c] for c in stream]


def test_emulate_flag_replaces_the_presets_emulation_and_its_time_scale():
    from dynaresize.cli import build_parser
    from dynaresize.commands.run import resolve_config

    parser = build_parser()

    def cluster(*argv):
        return resolve_config(parser.parse_args(["run", "--preset", "demo", *argv])).cluster

    demo = cluster()
    assert demo.emulate == "a100:7b" and demo.time_scale is not None  # the demo's own scale
    assert (cluster("--emulate", "h100:7b", "--devices", "16").time_scale, cluster("--emulate", "h100:7b").emulate) \
        == (None, "h100:7b")
    assert cluster("--emulate", "h100:7b", "--time-scale", "25").time_scale == 25.0
    unpaced = cluster("--emulate", "none")
    assert unpaced.emulate is None and unpaced.time_scale is None


def test_nothing_is_paced_unless_asked(tmp_path):
    """The default run and a config file without `cluster.emulate` run at this machine's speed;
    only the demo preset, `--emulate` or `cluster.emulate` pace the devices."""
    from dynaresize.cli import build_parser
    from dynaresize.commands.run import resolve_config

    parser = build_parser()
    (tmp_path / "job.toml").write_text("steps = 6\n[cluster]\ndevices = 4\nrollout_devices = 2\n")
    (tmp_path / "paced.toml").write_text("[cluster]\ndevices = 8\nrollout_devices = 4\nemulate = 'h100:7b'\n")

    def cluster(*argv):
        return resolve_config(parser.parse_args(["run", *argv])).cluster

    assert cluster().emulate is None and cluster().time_scale is None
    assert cluster("--config", str(tmp_path / "job.toml")).emulate is None
    assert cluster("--devices", "4", "--rollout-devices", "2", "--policy", "scripted", "--schedule", "3:3").emulate \
        is None
    assert cluster("--config", str(tmp_path / "paced.toml")).emulate == "h100:7b"
    assert cluster("--preset", "demo").emulate == "a100:7b"
    assert cluster("--devices", "8", "--emulate", "h100:7b").emulate == "h100:7b"


def test_moved_requests_are_paced_as_the_simulator_times_a_migration():
    """Requests moved off a leaving replica: from their first token, their time on one replica
    is `StageModel.chunk_at`; under partial rollout they keep the tokens the share had made."""
    emu = _emu(prompts=6, samples=4)
    moved = [3, 7, 11]
    ch = emu.stages.chunk_at(2, moved)
    time_s, body_s, top = emu.moved_share(2, moved)
    assert (time_s, body_s) == (ch.time_s, ch.body_s) and emu.lengths_flat(2)[top] == emu.lengths_flat(2)[moved].max()
    share = list(range(12))
    later, _, _ = emu.moved_share(2, moved, share=share, elapsed_s=0.5 * emu.stages.chunk(2, 0, 12).time_s)
    assert 0 < later < time_s  # the prefix is not decoded again


@pytest.mark.parametrize("target, num_rollout", [("h100:7b", 3), ("h200:32b", 4), ("h200:32b", 5)])
def test_streaming_items_are_the_simulators_shares_split_over_a_replicas_devices(target, num_rollout):
    """The router's streaming items when emulating (`DriverPacing.rollout_chunks(stream=True)`):
    the simulator's shares over num_rollout // tp replicas, each split over the replica's tp
    devices with the share's paced time (`Emulator.stream_plan`); an engine's admission limit
    is its part of the replica's slots."""
    pytest.importorskip("ray")
    from dynaresize.cluster.pacing import DriverPacing
    from dynaresize.roles.base import GenRequest

    cfg = build_config(merge(preset("cpu"), {"cluster": {"devices": 16, "rollout_devices": 4, "emulate": target},
                                             "rollout": {"prompts_per_step": 6, "samples_per_prompt": 4}}))
    pacing = DriverPacing(cfg)
    emu, tp = pacing.emulator, pacing.emulator.model.rollout_tp
    groups = [[GenRequest(sample_id=(2, p, s), prompt_ids=[1], max_new_tokens=4, seed=0) for s in range(4)]
              for p in range(6)]
    items = pacing.rollout_chunks(2, groups, num_rollout, stream=True)
    plan = emu.stream_plan(2, num_rollout)
    assert [[emu.sample_index(r.sample_id) for r in it] for it in items] == [list(p) for p, *_ in plan]
    assert [it.pace_s for it in items] == pytest.approx([t for _, t, _, _ in plan])
    for it, (positions, _, body_s, longest) in zip(items, plan):
        assert it.body_s == pytest.approx(body_s if longest in positions else it.pace_s)
    assert pacing.engine_slots(2) == max(1, emu.stages.slots(2) // tp)
