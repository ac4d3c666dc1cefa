"""Resume: `dynaresize run --resume RUN_DIR` continues a run from its last checkpoint on another
device count or split, appends to its records, keeps the ledger (nothing lost, nothing consumed
twice) and, in deterministic mode, ends with the tokens and final parameters of the
uninterrupted run. A corrupt or partial checkpoint is refused in one line, touching nothing.

Default suite: 4 -> 3 devices and the bad checkpoints. `make test-faults` adds 4 -> 2, 2 -> 4 and
a streaming run (staleness 2) stopped after a periodic checkpoint and resumed on 3 devices.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from _runs import assert_same_run, job_config, ray_local, records, reference_run, samples  # noqa: F401

pytestmark = pytest.mark.dist

FIRST_STEPS = 2


def _segment(root: Path, devices: int, rollout_devices: int) -> Path:
    """The first part of the job: its first FIRST_STEPS steps, ending with a final checkpoint."""
    from dynaresize.driver.run import run_job

    out = root / f"first-{devices}"
    summary = run_job(job_config(steps=FIRST_STEPS, cluster__devices=devices, cluster__rollout_devices=rollout_devices),
                      out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    return out


@pytest.fixture(scope="module")
def first4(ray_local, tmp_path_factory) -> Path:
    return _segment(tmp_path_factory.mktemp("resume"), 4, 2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _resume(out: Path, *argv: str) -> int:
    from dynaresize.cli import main

    return main(["run", "--resume", str(out), "--no-progress", *argv])


def _digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_workload_lengths(out: Path) -> None:
    """Synthetic lengths were on: every response has its workload length, keyed by absolute step,
    so resuming a 2-step run with --steps 4 continued the same job as the 4-step run."""
    from dynaresize.driver.job import Job
    from dynaresize.driver.ledger import sample_id_str

    job = Job(job_config())
    want = {sample_id_str(r.sample_id): r.forced_length for step in range(4) for g in job.requests(step) for r in g}
    assert all(v is not None for v in want.values()) and len(set(want.values())) > 1
    assert {k: r["num_tokens"] for k, r in samples(out).items()} == want


def _check_resumed(out: Path, before: bytes, devices: int) -> None:
    after = (out / "records.jsonl").read_bytes()
    assert after.startswith(before) and len(after) > len(before)  # appended, nothing rewritten
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert (summary["steps"], summary["devices"], summary["resumed_from_step"]) == (4, devices, FIRST_STEPS)
    (resume,) = records(out, "resume")
    assert (resume["step"], resume["num_devices"]) == (FIRST_STEPS, devices)
    consumed = [r for r in records(out, "sample") if r["consumed_step"] is not None]
    assert len(consumed) == len({r["sample_id"] for r in consumed}) == 4 * 16  # each sample consumed once
    assert json.loads((out / "checkpoint" / "latest.json").read_text())["step"] == 4
    assert len(list((out / "checkpoint").glob("step-*"))) == 1


def test_resume_on_three_devices_equals_the_uninterrupted_run(first4, tmp_path):
    out = _copy(first4, tmp_path / "run")
    before = (out / "records.jsonl").read_bytes()
    assert _resume(out, "--steps", "4", "--devices", "3", "--rollout-devices", "1") == 0
    _check_resumed(out, before, devices=3)
    assert_same_run(out, reference_run())
    _assert_workload_lengths(out)
    # every checkpoint's trainer shards were written by the trainers, not through the driver
    # (cluster/checkpoint_io.py), and the HF export by the first trainer
    assert [c["written_by"] for c in records(out, "checkpoint")] == ["trainers", "trainers"]
    assert (out / "checkpoint" / "model.safetensors").is_file() and (out / "checkpoint" / "config.json").is_file()


def test_corrupt_or_partial_checkpoint_is_refused_in_one_line(first4, tmp_path, capsys):
    cases = {
        "corrupt shard": lambda ck: _flip_byte(next((ck / "trainer").glob("shard-*"))),
        "partial (shard missing)": lambda ck: next((ck / "rollout").glob("shard-*")).unlink(),
        "no driver state": lambda ck: (ck / "driver.json").unlink(),
        "manifest cut short": lambda ck: _truncate(ck / "trainer" / "manifest.json"),
    }
    for i, (name, damage) in enumerate(cases.items()):
        out = _copy(first4, tmp_path / f"run{i}")
        damage(next((out / "checkpoint").glob("step-*")))
        tree = _digest_tree(out)
        capsys.readouterr()
        assert _resume(out, "--steps", "4") == 1, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("dynaresize: checkpoint error:") and "\n" not in err, (name, err)
        assert "Traceback" not in err
        assert _digest_tree(out) == tree, name  # nothing written, nothing removed


def test_resume_refuses_what_it_cannot_do(first4, tmp_path, capsys):
    out = _copy(first4, tmp_path / "run")
    tree = _digest_tree(out)
    assert _resume(out, "--steps", str(FIRST_STEPS)) == 2  # nothing left to run
    assert "nothing left to run" in capsys.readouterr().err
    assert _resume(out, "--steps", "4", "--seed", "3") == 2  # the run keeps its seed
    assert _resume(out, "--steps", "4", "--devices", "3", "--rollout-devices", "3") == 2  # a split bounds forbid
    assert "cluster.rollout_devices=3" in capsys.readouterr().err
    assert _resume(tmp_path / "nowhere", "--steps", "4") == 1
    assert _digest_tree(out) == tree


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.slow
def test_resume_on_two_devices_equals_the_uninterrupted_run(first4, tmp_path):
    out = _copy(first4, tmp_path / "run")
    before = (out / "records.jsonl").read_bytes()
    assert _resume(out, "--steps", "4", "--devices", "2") == 0
    _check_resumed(out, before, devices=2)
    assert_same_run(out, reference_run())


@pytest.mark.slow
def test_resume_from_two_to_four_devices_equals_the_uninterrupted_run(ray_local, tmp_path):
    out = _segment(tmp_path, 2, 1)
    before = (out / "records.jsonl").read_bytes()
    assert _resume(out, "--steps", "4", "--devices", "4", "--rollout-devices", "2") == 0
    _check_resumed(out, before, devices=4)
    assert_same_run(out, reference_run())
    (resume,) = records(out, "resume")
    assert resume["rollout_devices"] == 2  # the split it was asked for


@pytest.mark.slow
def test_resume_on_the_same_devices_keeps_the_policy_state(first4, tmp_path):
    out = _copy(first4, tmp_path / "run")
    assert _resume(out, "--steps", "4") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"] and summary["devices"] == 4
    assert_same_run(out, reference_run())
    assert len(samples(out)) == 4 * 16
    _assert_workload_lengths(out)


class _Crash(Exception):
    """The driver dies right after a periodic checkpoint (the test's stand-in for a killed process)."""


@pytest.mark.slow
def test_streaming_run_checkpointed_stopped_and_resumed_on_three_devices_equals_the_uninterrupted_run(
        ray_local, tmp_path, monkeypatch):
    """Staleness 2, checkpoint every 2 steps, a 4-step run stopped just after the checkpoint of
    step 2 (steps 2 and 3 in flight then), resumed on 3 of its 4 devices with 6 steps: the
    checkpoint kept the samples already generated (they are not generated again) and every weight
    version the steps in flight need; the run equals the uninterrupted 6-step run."""
    from dynaresize.driver.checkpointing import Checkpointer, load_resume_point
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    periodic = Checkpointer.periodic

    def crash_after(self, boundary):
        periodic(self, boundary)
        if boundary == 2:
            raise _Crash

    monkeypatch.setattr(Checkpointer, "periodic", crash_after)
    with pytest.raises(_Crash):
        run_job(job_config(train__staleness=2, checkpoint__every_steps=2), out, progress=False)
    monkeypatch.undo()
    point = load_resume_point(out)
    assert point.boundary == 2 and point.rollout_version == 0
    assert sorted(p.name for p in point.step_dir.iterdir() if p.name.startswith("rollout")) == ["rollout", "rollout-v1"]
    kept = {tuple(r.sample_id) for results in point.stream_samples.values() for _, r in results}
    assert kept and all(sid[0] >= 2 for sid in kept)  # samples of the steps in flight, generated before the stop
    assert _resume(out, "--steps", "6", "--devices", "3", "--rollout-devices", "1") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert_same_run(out, reference_run(staleness=2, steps=6), steps=6)
    resumed = [r for r in records(out, "sample") if r["consumed_step"] is not None
               and tuple(int(x) for x in r["sample_id"].split("-")) in kept]
    assert len(resumed) == len(kept) and all(r["reissued"] is None for r in resumed)
