"""`train.lora` through recovery and resume (HF engine, deterministic, 4 devices, a move each way):
snapshots, checkpoints and the pulls from them carry the adapter and its moments, and every
trainer rebuilt fills its base from the initial weights.

- A lost trainer (killed at step 2, while it is the only one) is restored in-run from the
  adapter snapshots, and the run equals the uninterrupted one (tokens, adapter).
- A 3-step run resumed to 5 steps (`--resume`: the trainer checkpoint is the adapter and its
  moments, the engines load the adapter from the rollout checkpoint) equals the 5-step run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import job_data, ray_local, samples  # noqa: E402,F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~2.5 min: three runs of 3-5 steps, a resume
STEPS = 5


def _config(steps: int = STEPS, **over):
    from dynaresize.config_load import build_config, merge

    data = merge(job_data(steps=steps), {"train": {"lora": {"rank": 4, "alpha": 8.0}, "lr": 2e-2},
                                         "policy": {"schedule": "2:3,4:2"}})
    return build_config(merge(data, over))


def _tokens(run_dir: Path) -> dict:
    return {k: r["token_sha1"] for k, r in samples(run_dir).items() if r["consumed_step"] is not None}


def _same_adapter(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    w1, w2 = (load_file(str(d / "checkpoint/adapter/adapter_model.safetensors")) for d in (a, b))
    assert w1.keys() == w2.keys() and w1
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):  # noqa: F811
    from dynaresize.driver.run import run_job

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = tmp_path_factory.mktemp("lora-ref") / "run"
    summary = run_job(_config(), out, progress=False)
    assert summary["ledger_ok"] and summary["resizes_to_rollout"] == 1
    return out


def test_a_lost_lora_trainer_is_restored_from_the_adapter_snapshot(reference, tmp_path):
    from dynaresize.driver.run import run_job

    summary = run_job(_config(faults=["kill:3@train:2"]), tmp_path / "run", progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert [r["lost_devices"] for r in summary["recoveries"]] == [[3]]
    assert _tokens(tmp_path / "run") == _tokens(reference) and len(_tokens(reference)) == STEPS * 16
    _same_adapter(tmp_path / "run", reference)


def test_a_resumed_lora_run_equals_the_uninterrupted_one(reference, tmp_path):
    from dynaresize.cli import main
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    assert run_job(_config(steps=3), out, progress=False)["ledger_ok"]
    assert main(["run", "--resume", str(out), "--no-progress", "--steps", str(STEPS)]) == 0
    assert _tokens(out) == _tokens(reference)
    _same_adapter(out, reference)
