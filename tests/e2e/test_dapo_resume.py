"""DAPO's dynamic sampling through a resume and a fault (issue 33): a deterministic run with
filtering on that is stopped after 2 steps and resumed with `--resume --steps 4`, and one whose
rollout device is killed while it generates a step's generation batches (on the driver's thread,
overlapping training), each equal the uninterrupted run: the same generation batches, kept and
filtered groups per step, the same fate and tokens of every sample, parameters within 1e-6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from _runs import ray_local, records, samples  # noqa: F401,E402  (the module's Ray)

from dynaresize.config_load import build_config, merge  # noqa: E402
from dynaresize.presets import preset  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # three or four 2-4 step runs: ~3-5 min on 2 cores

FIELDS = ("gen_batches", "groups_kept", "groups_filtered", "groups_surplus")


def _cfg(**over):
    """tests/e2e/test_dapo.py's deterministic filtering job on 4 devices (2 rollout, 2 train)."""
    return build_config(merge(merge(preset("cpu"), {
        "steps": 4, "deterministic": True,
        "cluster": {"devices": 4, "rollout_devices": 2},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 512},
        "rollout": {"engine": "hf", "prompts_per_step": 3, "samples_per_prompt": 4, "max_new_tokens": 8,
                    "synthetic_lengths": True, "length_workload": "dapo-qwen3-8b", "gen_prompts_per_step": 2},
        "algorithm": {"filter_groups": True, "filter_metric": "reward"},
        "reward": {"overlong_buffer_len": 6},
        "train": {"lr": 1e-2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        "policy": {"name": "static"},
        "timeouts": {"collective_s": 5.0},
    }), over))


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory) -> Path:
    from dynaresize.driver.run import run_job

    out = tmp_path_factory.mktemp("dapo-ref") / "run"
    summary = run_job(_cfg(), out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    return out


def _steps(run_dir: Path) -> dict[int, list]:
    """Each step's filter fields (a resumed run's last record of a step is its state)."""
    return {r["step"]: [r[f] for f in FIELDS] for r in records(run_dir, "step")}


def _assert_same(run_dir: Path, ref: Path) -> None:
    from safetensors.torch import load_file

    assert _steps(run_dir) == _steps(ref)
    assert max(v[0] for v in _steps(ref).values()) >= 2 and sum(v[2] for v in _steps(ref).values()) > 0
    fate = lambda d: {k: (r["token_sha1"], r["consumed_step"], r["dropped"], r["reward"])  # noqa: E731
                      for k, r in samples(d).items()}
    got, want = fate(run_dir), fate(ref)
    assert got == want, sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:5]
    assert sum(r[1] is not None for r in want.values()) == 4 * 3 * 4
    a = load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    b = load_file(str(ref / "checkpoint" / "model.safetensors"))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"\nfiltering: gen_batches {[v[0] for v in _steps(ref).values()]}; max parameter difference {worst:.3g}")
    assert worst <= 1e-6


def test_a_resumed_filtering_run_equals_the_uninterrupted_one(reference, tmp_path):
    from dynaresize.cli import main
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    assert run_job(_cfg(steps=2), out, progress=False)["ledger_ok"]
    assert main(["run", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["resumed_from_step"] == 2
    _assert_same(out, reference)


def test_a_rollout_device_lost_while_filtering_recovers_and_equals_the_uninterrupted_run(reference, tmp_path):
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    summary = run_job(_cfg(faults=["kill:1@rollout:2"]), out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["faults_injected"] == 1 and summary["faults_recovered"] == 1 and summary["devices_final"] == 3
    _assert_same(out, reference)
