"""TensorBoard event files under `RUN_DIR/tensorboard/`, written with tensorboardX.

tensorboardX (one small package beside protobuf and numpy) rather than
`torch.utils.tensorboard`, which needs the whole `tensorboard` package to write. Scalars go
under their names (`reward/mean`, ...), text under `events/<tag>` (markdown), the config and the
summary as JSON text. Event files are flushed after every step, so a run that dies keeps what it
logged; a resumed run adds a new event file beside the old ones (TensorBoard merges them).
"""

from __future__ import annotations

import json
from pathlib import Path

from dynaresize.tracking.base import TrackerSink, summary_scalars


class TensorBoardSink(TrackerSink):
    def __init__(self, log_dir: str | Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(log_dir), flush_secs=30)
        self.last_step = 0

    def log_config(self, config: dict) -> None:
        self.writer.add_text("config", _code(config), 0)

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.last_step = max(self.last_step, step)
        self.writer.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(f"events/{tag}", text, step)

    def log_summary(self, summary: dict) -> None:
        for name, value in summary_scalars(summary).items():
            self.writer.add_scalar(name, value, self.last_step)
        self.writer.add_text("summary", _code(summary), self.last_step)

    def close(self) -> None:
        self.writer.close()


def _code(data: dict) -> str:
    """JSON as a markdown code block (TensorBoard's text panel renders markdown)."""
    return "```\n" + json.dumps(data, indent=2, default=str) + "\n```"
