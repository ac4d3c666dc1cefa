"""An MLflow run in a SQLite store under `RUN_DIR/mlruns/`: the database `mlflow.db` (tracking
URI `sqlite:///RUN_DIR/mlruns/mlflow.db`) and the artifacts in `artifacts/` beside it.

The config goes in as params (flattened `section.field`), step and resize scalars as metrics
at x = step (one `log_batch` per record), text lines as tags (`resize.<id>`, `fault.step2.device1`,
...), the summary as `summary/<field>` metrics and the `summary.json` artifact. Read it back with
`mlflow.search_runs(experiment_names=["dynaresize"])` or `MlflowClient(tracking_uri=...)` on that
URI, or `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlruns/mlflow.db` (the full `mlflow`).

Why SQLite: MLflow 3 keeps the file store (`file:` URIs) in maintenance mode and refuses it
without `MLFLOW_ALLOW_FILE_STORE=true`; a SQLite store is MLflow's supported local store in
every version and needs no environment variable. It needs `sqlalchemy` and `alembic`, which
the `mlflow` extra installs beside `mlflow-skinny`. The first open creates the tables (a few
seconds: MLflow runs its schema migrations).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path

from dynaresize.tracking.base import TrackerSink, summary_scalars

EXPERIMENT = "dynaresize"
DB_FILE = "mlflow.db"
ARTIFACTS = "artifacts"
MAX_PARAM_CHARS = 500  # the smallest limit of MLflow versions in use
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch
# MLflow logs two INFO lines while it creates the tables; the console shows them only at
# DYNARESIZE_LOG_LEVEL=info or debug (cluster/placement.py), like every third-party line.
_QUIET = ("mlflow.store.db.utils", "alembic")


def tracking_uri(store: str | Path) -> str:
    """The SQLite tracking URI of the store folder `store` (absolute: `sqlite:////abs/...`)."""
    return "sqlite:///" + str(Path(store).resolve() / DB_FILE)


class MLflowSink(TrackerSink):
    def __init__(self, store: str | Path, run_name: str) -> None:
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise RuntimeError(f"MLflow's SQLite store needs {' and '.join(missing)} "
                               "(pip install 'dynaresize[mlflow]')")
        from mlflow.tracking import MlflowClient

        folder = Path(store)
        folder.mkdir(parents=True, exist_ok=True)
        with _quiet():  # the store's first use creates the tables
            self.client = MlflowClient(tracking_uri=tracking_uri(folder))
            exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            EXPERIMENT, artifact_location=(folder.resolve() / ARTIFACTS).as_uri())
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.last_step = 0

    def log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in sorted(_flatten(config).items())]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if values:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        self.last_step = max(self.last_step, step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.client.set_tag(self.run_id, tag, text)

    def log_summary(self, summary: dict) -> None:
        self.log_scalars(self.last_step, summary_scalars(summary))
        self.client.log_text(self.run_id, json.dumps(summary, indent=2, default=str), "summary.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple, bool)) or v is None else str(v)
    return out


class _quiet:
    """Raise MLflow's table-creation loggers to WARNING for a block, unless the console asks for more."""

    def __enter__(self) -> None:
        loud = os.environ.get("DYNARESIZE_LOG_LEVEL", "").lower() in ("info", "debug")
        self.saved = [(lg, lg.level) for lg in map(logging.getLogger, _QUIET)] if not loud else []
        for lg, _ in self.saved:
            lg.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        for lg, level in self.saved:
            lg.setLevel(level)
