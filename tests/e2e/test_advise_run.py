"""End to end, shadow mode: `dynaresize advise` on the run directory of a real static run (the
tiny model on Ray + gloo, this machine's own speed) reproduces that run's throughput over its
steps within 10%, from its own records only."""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray")

from dynaresize.cli import main as cli  # noqa: E402
from dynaresize.config_load import build_config, merge  # noqa: E402
from dynaresize.driver.run import run_job  # noqa: E402
from dynaresize.presets import preset  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a real run: ~1-2 minutes here, mostly engine start-up

STEPS = 8


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        out = tmp_path_factory.mktemp("advise") / "static"
        data = merge(preset("cpu"), {
            "steps": STEPS, "cluster": {"devices": 4, "rollout_devices": 2},
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 16,
                        "synthetic_lengths": True, "length_workload": "demo"},
            "policy": {"name": "static:2"},
        })
        summary = run_job(build_config(data), out, progress=False)
    finally:
        ray.shutdown()
    return out, summary


def test_advise_reproduces_a_static_runs_throughput(static_run, capsys, tmp_path):
    out, summary = static_run
    assert summary["resizes"] == 0
    assert cli(["advise", "--from", str(out), "--json", "--out", str(tmp_path / "a")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps_read"] == STEPS and doc["steps_used"] == STEPS
    assert doc["job"] == doc["job"] | {"devices": 4, "rollout_devices": 2, "samples_per_step": 16, "colocated": False}
    assert doc["lengths"]["source"] == "exact (sample records)"
    run_rate = STEPS * 16 / summary["steps_time_s"]  # the run's own throughput over its steps
    split = doc["logged_split"]
    print(f"run {run_rate:.2f} samples/s over its steps; advise: logged {split['samples_per_s_logged']:.2f}, "
          f"reproduced {split['samples_per_s_reproduced']:.2f}; verdict: {doc['verdict']}")
    assert split["samples_per_s_logged"] == pytest.approx(run_rate, rel=0.02)
    assert split["samples_per_s_reproduced"] == pytest.approx(run_rate, rel=0.10)
    assert {s["rollout"] for s in doc["static"]} == {1, 2, 3}
    assert doc["verdict"] and (tmp_path / "a" / "advise.png").is_file()
