"""A Weights & Biases run in offline mode: files under `RUN_DIR/wandb/offline-run-*/`.

Offline always (`mode="offline"`, as `WANDB_MODE=offline`): nothing reaches the network; upload
later with `wandb sync RUN_DIR/wandb/offline-run-*`. The config goes in as the run config,
scalars with `step=` (steps only grow: a resize's scalars share its step), text lines into one
`events` table logged at close, the summary into the run summary. Console capture is off, so the
driver's stdout and stderr stay as they are. The W&B service process writes the run file's last
block when it ends (at the driver's exit, or `wandb.teardown()` in a process that goes on).
"""

from __future__ import annotations

import os
from pathlib import Path

from dynaresize.tracking.base import TrackerSink, summary_scalars

PROJECT = "dynaresize"


class WandbSink(TrackerSink):
    def __init__(self, run_dir: str | Path, run_name: str) -> None:
        os.environ["WANDB_MODE"] = "offline"
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(mode="offline", console="off", silent=True, disable_git=True, save_code=False)
        self.run = wandb.init(project=PROJECT, name=run_name, dir=str(run_dir), settings=settings, reinit="create_new")
        self.events: list[list] = []
        self.last_step = 0

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        step = max(step, self.last_step)  # W&B drops anything logged at a step below its current one
        if values:
            self.run.log(values, step=step)
        self.last_step = step

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.events.append([step, tag, text])

    def log_summary(self, summary: dict) -> None:
        self.run.summary.update(summary_scalars(summary))

    def close(self) -> None:
        if self.events:
            self.run.log({"events": self.wandb.Table(columns=["step", "tag", "text"], data=self.events)},
                         step=self.last_step)
        self.run.finish()
