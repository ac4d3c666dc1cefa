"""Experiment trackers fed by the driver's record stream: TensorBoard, MLflow, W&B.

Config `logging.backends` names them (`jsonl`, the run's `records.jsonl`, is always on). Each is
a `Sink` the `Recorder` hands every record it emits; `TrackerSink` maps records to what a
tracker shows, the same way for every backend (`tracking/base.py`):

- `config` -> the tracker's run config / params;
- `step` -> scalars at x = step (names: `metrics.STEP_SCALARS`, docs/records.md);
- `resize` -> scalars `resize/critical_s`, `resize/total_s` at the resize's step, and a text
  line (TensorBoard text panel, MLflow tag `resize.<id>`, W&B `events` table);
- `fault`, `recovery` -> text lines; `eval` -> `eval/<field>` scalars;
- `summary` -> the tracker's run summary (numeric fields as `summary/<field>`).

Invariants: a backend's library is imported only when the backend is named, so none is a
dependency (extras `dynaresize[tensorboard|mlflow|wandb]`); a backend named but not installed
is a `ConfigError` before anything is written (`check_backends`); files go under the run
directory only (`tensorboard/`, `mlruns/`, `wandb/`), and nothing reaches the network (W&B runs
offline, MLflow a SQLite store in `mlruns/mlflow.db`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dynaresize.errors import ConfigError
from dynaresize.records import Sink

# backend -> (module that must be importable, pip extra that installs it)
REQUIREMENTS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


def check_backends(backends: tuple[str, ...] | list[str]) -> None:
    """Raise ConfigError (one line per backend) for each named backend whose library is missing."""
    errors = []
    for name in backends:
        if name in REQUIREMENTS:
            module, extra = REQUIREMENTS[name]
            if importlib.util.find_spec(module) is None:
                errors.append(f"logging.backends={name!r}: the {module} package is not installed "
                              f"(pip install 'dynaresize[{extra}]')")
    if errors:
        raise ConfigError(errors)


def open_sinks(backends: tuple[str, ...] | list[str], run_dir: str | Path, run_name: str | None = None) -> list[Sink]:
    """One sink per named tracker backend (`jsonl` needs none), writing under `run_dir`.

    A backend that is installed but fails to start is left out with one warning on stderr, as
    the recorder does with one that fails later: a tracker never stops a run.
    """
    check_backends(backends)
    run_dir = Path(run_dir)
    name = run_name or run_dir.resolve().name
    sinks: list[Sink] = []
    for backend in (b for b in backends if b != "jsonl"):
        try:
            sinks.append(_open(backend, run_dir, name))
        except Exception as exc:
            print(f"dynaresize: warning: logging backend {backend!r} did not start ({type(exc).__name__}: {exc}); "
                  "the run goes on without it", file=sys.stderr)
    return sinks


def _open(backend: str, run_dir: Path, name: str) -> Sink:
    if backend == "tensorboard":
        from dynaresize.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(run_dir / "tensorboard")
    if backend == "mlflow":
        from dynaresize.tracking.mlflow_sink import MLflowSink

        return MLflowSink(run_dir / "mlruns", run_name=name)
    from dynaresize.tracking.wandb_sink import WandbSink

    return WandbSink(run_dir, run_name=name)
