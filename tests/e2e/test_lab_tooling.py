"""A lab's tooling on one short real run (4 CPU devices, 4 steps, a scripted resize after step 1),
made once through the CLI with `--set logging.backends=tensorboard,mlflow[,wandb]` and
`--inject kill:2@resize.reshard:9`, a fault the run never reaches (no resize after step 9):

- the unfired fault is a warning on stderr and listed in the summary's `faults_unfired`;
- TensorBoard's own reader finds every scalar the step and resize records carry, with their
  values; `mlflow.search_runs` on the run's SQLite store reads the same metrics back (no
  MLFLOW_ALLOW_FILE_STORE); W&B's offline run (where installed);
- `dynaresize report` on the run directory renders every figure in headless Chromium.

The run evaluates on held-out prompts after steps 1 and 3 (`eval.every_steps=2`), so the eval
scalars reach the trackers and the report has its eval curve and table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from dynaresize.metrics import eval_scalars, resize_scalars, step_scalars

from _browser import assert_every_figure_renders
from _runs import job_data, ray_local, records  # noqa: F401

pytestmark = pytest.mark.dist

FAULT = "kill:2@resize.reshard:9"
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def lab_run(ray_local, tmp_path_factory):  # noqa: F811
    pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed (make setup installs it)")
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (make setup installs it)")
    from dynaresize.cli import main

    base = tmp_path_factory.mktemp("lab")
    cfg = base / "job.json"
    cfg.write_text(json.dumps(job_data()))
    backends = "tensorboard,mlflow" + (",wandb" if HAVE_WANDB else "")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--no-progress", "--preset", "cpu", "--config", str(cfg), "--out", str(base / "run"), "--inject", FAULT,
                     "--set", f"logging.backends={backends}", "--set", "eval.every_steps=2",
                     "--set", "eval.num_prompts=4"])
    assert code == 0, err.getvalue()[-3000:]
    return base / "run", err.getvalue()


def _want(run: Path) -> dict[str, dict[int, float]]:
    want: dict[str, dict[int, float]] = {}
    for rec in records(run, "step"):
        for name, value in step_scalars(rec).items():
            want.setdefault(name, {})[rec["step"]] = value
    for rec in records(run, "resize"):
        for name, value in resize_scalars(rec).items():
            want.setdefault(name, {})[rec["step"]] = value
    for rec in records(run, "eval"):
        for name, value in eval_scalars(rec).items():
            want.setdefault(name, {})[rec["step"]] = value
    return want


CORE = {"reward/mean", "reward/std", "response_len/mean", "response_len/max", "time/rollout_s", "time/train_s",
        "time/sync_s", "time/step_s", "split/num_rollout", "split/num_train", "idle/fraction", "idle/tail_fraction",
        "resize/critical_s", "resize/total_s", "eval/reward_mean", "eval/pass_at_1", "eval/pass_at_4"}


def test_unfired_fault_warns_and_is_listed_in_the_summary(lab_run):
    run, err = lab_run
    warning = f"dynaresize: warning: injected fault {FAULT} never fired"
    assert [line for line in err.splitlines() if line.startswith("dynaresize: warning")] == [
        warning + ": the run did not reach resize.reshard at step 9 with device 2 alive"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["faults_unfired"] == [FAULT] and summary["faults_injected"] == 0
    assert summary["resizes"] == 1 and summary["ledger_ok"]
    assert [r["step"] for r in records(run, "eval")] == [1, 3] and set(summary["eval"]) >= {"reward_mean", "pass_at_4"}


def test_tensorboard_reader_finds_every_scalar_of_the_run(lab_run):
    pytest.importorskip("tensorboard", reason="TensorBoard's reader is not installed (the dev extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = lab_run
    want = _want(run)
    assert CORE <= set(want)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for name, by_step in want.items():
        assert {e.step: e.value for e in acc.Scalars(name)} == pytest.approx(by_step, rel=1e-5), name
    assert "events/resize.0/text_summary" in acc.Tags()["tensors"]


def test_mlflow_reads_the_run_back_from_its_sqlite_store(lab_run, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3.17+ needs it for a file store, not SQLite
    import mlflow
    from mlflow.tracking import MlflowClient

    run, _ = lab_run
    uri = f"sqlite:///{(run / 'mlruns' / 'mlflow.db').resolve()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (mrun,) = mlflow.search_runs(experiment_names=["dynaresize"], output_format="list")
    client = MlflowClient(tracking_uri=uri)
    assert mrun.info.run_name == "run" and mrun.info.status == "FINISHED"
    for name, by_step in _want(run).items():
        hist = client.get_metric_history(mrun.info.run_id, name)
        assert {m.step: m.value for m in hist} == pytest.approx(by_step), name
    assert mrun.data.params["cluster.devices"] == "4"
    assert mrun.data.tags["resize.0"].startswith("resize 0 after step 1: 2R:2T -> 3R:1T")


@pytest.mark.skipif(not HAVE_WANDB, reason="the wandb extra is not installed (pip install 'dynaresize[wandb]')")
def test_wandb_offline_run_is_written(lab_run):
    import wandb

    wandb.teardown()  # the W&B service writes its last block when it ends (at process exit in a real run)
    run, _ = lab_run
    (data,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"reward/mean" in data.read_bytes() and b"resize/critical_s" in data.read_bytes()


def test_report_of_the_run_renders_in_chromium(lab_run):
    from dynaresize.cli import main

    run, _ = lab_run
    assert main(["report", str(run)]) == 0
    # split, stage times, idle, reward, device timeline, requests in flight per replica (one-step-off
    # runs write concurrency records too), one resize Gantt chart
    assert_every_figure_renders(run / "report.html", expected=7)
    assert "Requests in flight per replica" in (run / "report.html").read_text()
    page = (run / "report.html").read_text()
    assert "Reward and eval" in page and "pass_at_4" in page  # the eval curve and its table
