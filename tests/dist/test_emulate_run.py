"""An emulated run on Ray: 8 device workers paced as H200s running a 7B, on this machine.

Every assertion is on the recorded (emulated) times and the overrun flags, never on the wall
clock, so the test means the same on a fast or a loaded machine: a stage call that overran its
paced time (the machine was too slow for the time scale) is flagged, and then only the flag's
consistency is checked for it.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from dynaresize.config_load import build_config, merge  # noqa: E402
from dynaresize.emulate.model import Emulator, run_bounds  # noqa: E402
from dynaresize.presets import preset  # noqa: E402
from dynaresize.records import read_records  # noqa: E402

# slow (~45 s: 8 paced workers); CI runs it, and the default suite's hysteresis run is emulated too
pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
TIME_SCALE = 2.0  # a ~6 s emulated rollout lasts ~3 wall s; training (~2 emulated s) ~1 wall s


def _config():
    return build_config(merge(preset("cpu"), {
        "steps": STEPS,
        "cluster": {"devices": 8, "rollout_devices": 4, "emulate": "h200:7b", "time_scale": TIME_SCALE},
        # The HF engine: 8 vLLM engines would not fit beside the rest (this test is about pacing).
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 4,
                    "length_workload": "short-tail", "engine": "hf"},
        "train": {"micro_batch_size": 16},
        "policy": {"name": "scripted", "schedule": "2:5"},  # one move to rollout, decided after step 1
    }))


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory):
    from dynaresize.driver.run import run_job

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        out = tmp_path_factory.mktemp("emulated") / "run"
        summary = run_job(_config(), out, progress=False)
    finally:
        ray.shutdown()
    return out, summary


def _close(measured: float, model: float) -> bool:
    """Equal up to the dispatch skew between devices: a few wall ms, counted at the time scale."""
    return abs(measured - model) <= 0.05 * model + 0.5


def test_summary_says_times_are_emulated(emulated_run):
    _, s = emulated_run
    assert s["ledger_ok"], s["ledger_problems"]
    assert s["emulate"] == "h200:7b" and s["time_scale"] == TIME_SCALE and "emulated seconds" in s["time_unit"]
    assert s["resizes_to_rollout"] == 1 and s["rollout_devices_final"] == 5
    out, _ = emulated_run
    steps = read_records(out / "records.jsonl", "step")
    idle = sum(r["idle_device_s"] for r in steps)  # the summary's idle is the steps' (metrics.py)
    assert s["idle_fraction"] == pytest.approx(idle / (8 * s["total_time_s"]))


def test_stages_last_their_modelled_time_unless_flagged(emulated_run):
    out, s = emulated_run
    emu = Emulator.from_config(_config())
    steps = sorted(read_records(out / "records.jsonl", "step"), key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(STEPS))
    checked = 0
    for r in steps:
        k, n, rollout = r["step"], r["num_train"], r["num_rollout"]
        assert r["overrun"] == (r["real_fraction"] > 1.0)
        assert r["sync_s"] >= 0.95 * emu.sync_s  # never shorter than modelled; longer is overhead
        if r["overrun"]:
            continue
        assert _close(r["train_s"], emu.train_s(k, n)), (k, r["train_s"], emu.train_s(k, n))
        if k + 1 < STEPS:
            assert _close(r["rollout_s"], emu.rollout_s(k + 1, rollout)), (k, r["rollout_s"])
            assert r["rollout_s"] > r["train_s"]  # a tail-bound rollout: the model's, not this CPU's
        checked += 1
    assert s["overrun_steps"] == sum(r["overrun"] for r in steps)
    assert checked >= 1, "every step overran: lower TIME_SCALE for this machine"


def test_resize_ops_last_at_least_their_modelled_cost(emulated_run):
    out, _ = emulated_run
    emu = Emulator.from_config(_config())
    (resize,) = list(read_records(out / "records.jsonl", "resize"))
    cfg = _config()
    assert run_bounds(cfg).allowed(5)
    before, after = len(resize["from"]["train"]), len(resize["to"]["train"])
    crit = {}
    for op in read_records(out / "records.jsonl", "op"):
        if op["resize_id"] == resize["resize_id"] and op["critical"]:
            crit[op["name"]] = max(crit.get(op["name"], 0.0), op["end_s"] - op["start_s"])
    model = {name: emu.op_s(name, num_train_before=before, num_train_after=after, num_moving=1) for name in crit}
    assert set(crit) == {"drop_from_train_group", "move_param_shards", "load_weights", "alloc_kv_cache",
                         "add_to_router"}
    for name in crit:
        assert crit[name] >= 0.95 * model[name], (name, crit[name], model[name])
    assert resize["critical_s"] >= 0.95 * sum(model.values())


def test_time_adds_up_and_the_paced_work_really_waited(emulated_run):
    out, s = emulated_run
    steps = list(read_records(out / "records.jsonl", "step"))
    assert all(r["overhead_s"] >= -1e-6 and r["work_s"] > 0 for r in steps)
    total = sum(r["work_s"] + r["overhead_s"] for r in steps)
    assert total == pytest.approx(s["steps_time_s"], rel=1e-6)
    assert s["total_time_s"] == pytest.approx(s["steps_time_s"])
    # Paced work counts TIME_SCALE emulated seconds per wall second it really took: the workers
    # slept, so the run lasted at least that long (and more: startup, overhead at 1:1).
    assert s["work_s"] / TIME_SCALE + s["overhead_s"] <= s["wall_time_s"]
