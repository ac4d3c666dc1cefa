"""Shared pieces of the fault, resume and bad-input tests: a small deterministic job, Ray for a
module, the uninterrupted reference runs (made once per session), and run comparisons.

The job: 4 CPU devices (2 rollout, 2 train), 4 steps of 4 prompts x 4 samples, up to 16 new
tokens with synthetic lengths (the `demo` workload, keyed by absolute step: a run extended by
--resume with more steps continues the same job, which the resume tests check against the
uninterrupted run), deterministic mode, a scripted resize to 3 rollout devices decided after
step 1, and a collective timeout of 5 s so a stopped worker is found fast.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from dynaresize.config_load import build_config, merge
from dynaresize.presets import preset

COLLECTIVE_S = 5.0
STEPS = 4
SCHEDULE = "2:3"  # the resize is decided after step 1: device 2 leaves training


def job_data(**over) -> dict:
    data = preset("cpu")  # this machine's own speed: nothing paced
    data = merge(data, {
        "steps": STEPS, "deterministic": True,
        "cluster": {"devices": 4, "rollout_devices": 2},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 16,
                    "synthetic_lengths": True, "length_workload": "demo"},
        "policy": {"name": "scripted", "schedule": SCHEDULE},
        "timeouts": {"collective_s": COLLECTIVE_S},
    })
    for key, value in over.items():
        section, _, name = key.partition("__")
        data = merge(data, {section: {name: value}} if name else {section: value})
    return data


def job_config(**over):
    return build_config(job_data(**over))


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


_REFERENCE: dict[tuple, Path] = {}
_TMP = Path(tempfile.mkdtemp(prefix="dynaresize-ref-"))
atexit.register(shutil.rmtree, _TMP, True)


def reference_run(devices: int = 4, rollout_devices: int = 2, staleness: int = 1, steps: int = STEPS) -> Path:
    """The uninterrupted run of the job (made once per session; Ray must be up)."""
    from dynaresize.driver.run import run_job

    key = (devices, rollout_devices, staleness, steps)
    if key not in _REFERENCE:
        out = _TMP / f"ref-{devices}-{rollout_devices}-{staleness}-{steps}"
        summary = run_job(job_config(cluster__devices=devices, cluster__rollout_devices=rollout_devices,
                                     train__staleness=staleness, steps=steps), out, progress=False)
        assert summary["ledger_ok"], summary["ledger_problems"]
        _REFERENCE[key] = out
    return _REFERENCE[key]


def samples(run_dir: Path) -> dict[str, dict]:
    """The last `sample` record of each sample id (an id's last record is its state)."""
    out: dict[str, dict] = {}
    for line in (Path(run_dir) / "records.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "sample":
            out[rec["sample_id"]] = rec
    return out


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (Path(run_dir) / "records.jsonl").read_text().splitlines())
            if r["kind"] == kind]


def assert_same_run(run_dir: Path, ref_dir: Path, steps: int = STEPS) -> None:
    """Same consumed samples with the same tokens, and final parameters within 1e-6; the
    multiset of consumed response lengths per step equal (nothing dropped for being long)."""
    from safetensors.torch import load_file

    got = {k: r["token_sha1"] for k, r in samples(run_dir).items() if r["consumed_step"] is not None}
    want = {k: r["token_sha1"] for k, r in samples(ref_dir).items() if r["consumed_step"] is not None}
    assert len(want) == steps * 16
    assert got == want, sorted(k for k in want if got.get(k) != want[k])[:5]
    lengths = lambda d: sorted((r["consumed_step"], r["num_tokens"]) for r in samples(d).values()  # noqa: E731
                               if r["consumed_step"] is not None)
    assert lengths(run_dir) == lengths(ref_dir)
    w1 = load_file(str(Path(run_dir) / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(Path(ref_dir) / "checkpoint" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6
