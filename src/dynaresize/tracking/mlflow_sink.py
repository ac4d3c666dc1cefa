"""An MLflow run in a local file store under `RUN_DIR/mlruns/` (tracking URI `file:...`).

The config goes in as params (flattened `section.field`), step and resize scalars as metrics
at x = step (one `log_batch` per record), text lines as tags (`resize.<id>`, `fault.step2.device1`,
...), the summary as `summary/<field>` metrics and the `summary.json` artifact. Read it back with
`MlflowClient(tracking_uri="file:RUN_DIR/mlruns")` or `mlflow ui --backend-store-uri ...`.

MLflow 3 keeps the file store in maintenance mode and refuses it unless
`MLFLOW_ALLOW_FILE_STORE=true`; this sink sets that (if unset) in the driver's environment,
and so must a reader.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dynaresize.tracking.base import TrackerSink, summary_scalars

EXPERIMENT = "dynaresize"
MAX_PARAM_CHARS = 500  # the smallest limit of MLflow versions in use
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch


def tracking_uri(store: str | Path) -> str:
    return Path(store).resolve().as_uri()


class MLflowSink(TrackerSink):
    def __init__(self, store: str | Path, run_name: str) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        Path(store).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri(store))
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(EXPERIMENT)
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
