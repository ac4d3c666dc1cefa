"""Experiment trackers (dynaresize.tracking) fed synthetic records, read back with each tool's
own reader: TensorBoard's EventAccumulator, MLflow's search_runs on the run's SQLite store, W&B's
offline run files.

The records carry every field a step record may have (the trainer's metrics too), so every
scalar name docs/records.md documents must come out; a step without some fields just lacks
those scalars. Also: the `logging.backends` config errors, and a failing sink never stops the
recorder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from dynaresize.config_load import build_config
from dynaresize.errors import ConfigError
from dynaresize.metrics import RESIZE_SCALARS, STEP_SCALARS, TRAIN_FIELDS, resize_scalars, step_scalars
from dynaresize.records import Recorder, read_records
from dynaresize.tracking import check_backends, open_sinks

DOC = Path(__file__).resolve().parents[2] / "docs" / "records.md"
NAMES = [n for n, _, _ in STEP_SCALARS + RESIZE_SCALARS]


def _step(k: int, **over) -> dict:
    rec = {"kind": "step", "step": k, "t_start_s": 10.0 * k, "t_end_s": 10.0 * k + 4.0, "rollout_s": 2.5,
           "train_s": 3.0, "sync_s": 0.5, "num_rollout": 2 + k % 2, "num_train": 2 - k % 2, "idle_device_s": 6.0,
           "tail_idle_device_s": 2.0, "reward_mean": 0.1 * k, "reward_std": 0.05, "reward_left_out": k % 2,
           "response_len_mean": 20.0 + k, "gen_batches": 1 + k, "groups_kept": 4, "groups_filtered": 2 * k,
           "response_len_max": 40 + k, **{f: 0.01 * (i + 1) + k for i, f in enumerate(TRAIN_FIELDS)}}
    rec.update(over)
    return rec


RESIZE = {"kind": "resize", "resize_id": 0, "step": 1, "from": {"rollout": [0, 1], "train": [2, 3]},
          "to": {"rollout": [0, 1, 2], "train": [3]}, "moving": [2], "to_role": "rollout", "critical_s": 0.25,
          "total_s": 0.75, "reason": "scripted"}


def _feed(rec: Recorder, steps: int = 3) -> None:
    rec.emit("config", config={"steps": steps, "policy": {"name": "scripted"}, "faults": []})
    for k in range(steps):
        rec.emit("step", **{f: v for f, v in _step(k).items() if f != "kind"})
        if k == 1:
            rec.emit("resize", **{f: v for f, v in RESIZE.items() if f != "kind"})
            rec.emit("fault", step=1, device=2, fault_kind="kill", point="train", reason="injected")
    rec.emit("summary", summary={"steps": steps, "samples_per_s": 3.5, "ledger_ok": True, "faults_unfired": []})


def test_a_rewards_own_metrics_become_reward_scalars():
    out = step_scalars(_step(1, reward_metrics={"format": 0.75, "acc": 1, "note": "text", "bad": float("nan")}))
    assert out["reward/format"] == 0.75 and out["reward/acc"] == 1.0 and out["reward/left_out"] == 1.0
    assert "reward/note" not in out and "reward/bad" not in out  # only finite numbers
    assert not any(k.startswith("reward/") and k not in ("reward/mean", "reward/std", "reward/left_out")
                   for k in step_scalars(_step(1)))


def test_docs_name_every_scalar_and_every_documented_name_is_emitted():
    text = DOC.read_text()
    table = text[text.index("| scalar | record | from | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert documented == NAMES
    emitted = set(step_scalars(_step(2))) | set(resize_scalars(RESIZE))
    assert emitted == set(documented)


def test_scalars_are_derived_as_documented_and_absent_fields_are_skipped():
    s = step_scalars(_step(1))
    assert s["time/step_s"] == 4.0 and s["split/num_rollout"] == 3 and s["split/num_train"] == 1
    assert s["idle/fraction"] == pytest.approx(6.0 / (4 * 4.0)) and s["idle/tail_fraction"] == pytest.approx(2.0 / 16)
    bare = {k: v for k, v in _step(0).items() if k not in TRAIN_FIELDS + ("reward_std",)}
    bare.update(response_len_max=None, reward_mean=float("nan"))  # null / NaN in a record: skipped
    names = set(step_scalars(bare))
    assert not any(n.startswith("train/") for n in names)
    assert "reward/std" not in names and "reward/mean" not in names and "response_len/max" not in names
    assert "time/rollout_s" in names


def test_unknown_or_repeated_backend_is_a_config_error():
    with pytest.raises(ConfigError) as exc:
        build_config({"logging": {"backends": "tensorboard,nope,tensorboard"}})
    assert any("logging.backends='nope'" in e for e in exc.value.errors)
    assert any("named twice" in e for e in exc.value.errors)
    assert build_config({"logging": {"backends": "tensorboard,mlflow"}}).logging.backends == ("tensorboard", "mlflow")


def test_backend_named_but_not_installed_is_one_line_exit_2_before_anything_is_written(monkeypatch, tmp_path, capsys):
    import dynaresize.tracking as tracking
    from dynaresize.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as exc:
        check_backends(("jsonl", "tensorboard", "wandb"))
    assert exc.value.errors == ["logging.backends='wandb': the wandb package is not installed "
                                "(pip install 'dynaresize[wandb]')"]
    out = tmp_path / "r"
    assert main(["run", "--no-progress", "--out", str(out), "--set", "logging.backends=wandb"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["dynaresize: config error: " + exc.value.errors[0]]
    assert not out.exists()


def _tb_scalars(log_dir: Path) -> tuple[dict[str, dict[int, float]], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}, acc.Tags()


def _expected(steps: int = 3) -> dict[str, dict[int, float]]:
    want: dict[str, dict[int, float]] = {}
    for k in range(steps):
        for name, value in step_scalars(_step(k)).items():
            want.setdefault(name, {})[k] = value
    for name, value in resize_scalars(RESIZE).items():
        want.setdefault(name, {})[1] = value
    return want


def test_tensorboard_event_files_hold_every_scalar(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed (make setup installs it)")
    pytest.importorskip("tensorboard", reason="TensorBoard's reader is not installed (the dev extra has it)")
    with Recorder(tmp_path / "records.jsonl", sinks=open_sinks(["jsonl", "tensorboard"], tmp_path)) as rec:
        _feed(rec)
    got, tags = _tb_scalars(tmp_path / "tensorboard")
    for name, by_step in _expected().items():
        assert got[name] == pytest.approx(by_step, rel=1e-6), name
    assert got["summary/samples_per_s"] == {2: 3.5}
    assert {"events/resize.0/text_summary", "events/fault.step1.device2/text_summary"} <= set(tags["tensors"])


def test_mlflow_run_reads_back_from_its_sqlite_store_with_no_environment_variable(tmp_path, monkeypatch):
    """The run's store is SQLite (MLflow 3.17+ refuses a file store unless MLFLOW_ALLOW_FILE_STORE
    is set): `mlflow.search_runs` on its URI returns the run's metrics with that variable unset,
    and the artifact lands in the run directory."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (make setup installs it)")
    pytest.importorskip("sqlalchemy", reason="the mlflow extra is not installed (make setup installs it)")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # anything MLflow wrote beside the run directory would show here
    import mlflow
    from mlflow.tracking import MlflowClient

    with Recorder(tmp_path / "r" / "records.jsonl", sinks=open_sinks(["mlflow"], tmp_path / "r", run_name="r1")) as rec:
        _feed(rec)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    db = tmp_path / "r" / "mlruns" / "mlflow.db"
    assert db.is_file() and db.read_bytes().startswith(b"SQLite format 3")
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (run,) = mlflow.search_runs(experiment_names=["dynaresize"], output_format="list")
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    client = MlflowClient(tracking_uri=uri)
    for name, by_step in _expected().items():
        hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert hist == pytest.approx(by_step), name
        assert run.data.metrics[name] == pytest.approx(by_step[max(by_step)]), name
    assert run.data.params["policy.name"] == "scripted" and run.data.metrics["summary/samples_per_s"] == 3.5
    assert run.data.tags["resize.0"].startswith("resize 0 after step 1: 2R:2T -> 3R:1T")
    (artifact,) = (tmp_path / "r" / "mlruns" / "artifacts").rglob("summary.json")
    assert json.loads(artifact.read_text())["samples_per_s"] == 3.5


# The newest full `mlflow` package (the one with `mlflow ui`) installable here, and the schema
# revision its SQLite store must have: full MLflow opens a store only at its own alembic head
# (`_verify_schema`: anything else is "Detected out-of-date database schema ..., run 'mlflow db
# upgrade'"). 3.18.0 is on the index but not installable (its mlflow-tracing 3.18.0 is not), and
# mlflow-skinny 3.18.0 writes f4a9b2c7d1e6, which 3.17.2 refuses. The head is that of mlflow 3.17.2's
# migrations (alembic ScriptDirectory.get_heads(), read in a separate environment with `pip install
# mlflow==3.17.2`, 2026-12-04). A newer full release: raise the extra's cap and both constants.
NEWEST_FULL_MLFLOW = "3.17.2"
NEWEST_FULL_SCHEMA = "dc11669786a5"


def _extra_requirement(extra: str, name: str):
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((DOC.parents[1] / "pyproject.toml").read_text())["project"]
    (req,) = [r for r in map(Requirement, project["optional-dependencies"][extra]) if r.name == name]
    return req


def test_the_mlflow_extra_allows_no_writer_newer_than_the_newest_full_mlflow():
    spec = _extra_requirement("mlflow", "mlflow-skinny").specifier
    assert spec.contains(NEWEST_FULL_MLFLOW)
    assert not any(spec.contains(v) for v in ("3.17.3", "3.18.0", "3.18.1", "4.0.0")), str(spec)


def test_mlflow_store_has_the_schema_the_newest_full_mlflow_opens_and_reads_back(tmp_path, monkeypatch):
    """A run written by the tracker is at the schema revision the newest full `mlflow` opens as is
    (no `mlflow db upgrade`), and reads back there: the full package of a version is
    mlflow-skinny of that version plus the server and UI, so its `search_runs` is this one's when
    the installed writer is that version (the extra's newest allowed)."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (make setup installs it)")
    import sqlite3

    import mlflow
    from packaging.version import Version

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Recorder(tmp_path / "r" / "records.jsonl", sinks=open_sinks(["mlflow"], tmp_path / "r", run_name="r1")) as rec:
        _feed(rec)
    db = tmp_path / "r" / "mlruns" / "mlflow.db"
    with sqlite3.connect(db) as con:
        (revision,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
    assert revision == NEWEST_FULL_SCHEMA, (
        f"mlflow-skinny {mlflow.__version__} wrote schema {revision}; full mlflow {NEWEST_FULL_MLFLOW} opens only "
        f"{NEWEST_FULL_SCHEMA} (reinstall the extra: pip install -e '.[mlflow]')")
    assert Version(mlflow.__version__) <= Version(NEWEST_FULL_MLFLOW)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("dynaresize").experiment_id])
    assert len(runs) == 1 and runs[0].data.metrics["reward/mean"] == pytest.approx(0.2)


def test_wandb_offline_run_files_are_written(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'dynaresize[wandb]')")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Recorder(tmp_path / "records.jsonl", sinks=open_sinks(["wandb"], tmp_path, run_name="r1")) as rec:
        _feed(rec)
    wandb.teardown()  # the W&B service writes its last block when it ends (at process exit in a real run)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (data,) = run_dir.glob("run-*.wandb")
    blob = data.read_bytes()
    for name in NAMES + ["summary/samples_per_s", "events"]:
        assert name.encode() in blob, name


class _Broken:
    closed = False

    def write(self, record: dict) -> None:
        if record["kind"] == "step":
            raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_dropped_with_one_warning_and_the_records_go_on(tmp_path, capsys):
    broken = _Broken()
    with Recorder(tmp_path / "records.jsonl", sinks=[broken]) as rec:
        _feed(rec)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "_Broken failed (OSError: disk full)" in err[0]
    assert broken.closed
    assert [r["kind"] for r in read_records(tmp_path / "records.jsonl")].count("step") == 3


def test_a_backend_that_fails_to_start_is_left_out_with_one_warning(tmp_path, capsys):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (make setup installs it)")
    (tmp_path / "mlruns").write_text("a file where the store's folder should be")
    sinks = open_sinks(["jsonl", "mlflow"], tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert sinks == [] and len(err) == 1 and "logging backend 'mlflow' did not start" in err[0]
