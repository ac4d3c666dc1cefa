"""The one mapping from records to a tracker's operations, shared by every backend.

A backend (`tensorboard_sink`, `mlflow_sink`, `wandb_sink`) subclasses `TrackerSink` and
implements its hooks; which record kind becomes which scalars or text is decided here once,
from the definitions in `dynaresize.metrics`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dynaresize.metrics import eval_scalars, event_text, number, resize_scalars, resize_text, step_scalars


class TrackerSink(ABC):
    """Maps records to a tracker's four operations; a backend implements the four hooks."""

    def write(self, record: dict) -> None:
        kind = record["kind"]
        if kind == "config":
            self.log_config(record["config"])
        elif kind == "step":
            self.log_scalars(int(record["step"]), step_scalars(record))
        elif kind == "resize":
            self.log_scalars(int(record["step"]), resize_scalars(record))
            self.log_text(int(record["step"]), f"resize.{record['resize_id']}", resize_text(record))
        elif kind == "eval":
            self.log_scalars(int(record["step"]), eval_scalars(record))
        elif kind in ("fault", "recovery"):
            tag = f"{kind}.step{record['step']}." + (f"device{record['device']}" if kind == "fault"
                                                     else f"gen{record.get('generation', 0)}")
            self.log_text(int(record["step"]), tag, event_text(record))
        elif kind == "summary":
            self.log_summary(record["summary"])

    @abstractmethod
    def log_config(self, config: dict) -> None: ...

    @abstractmethod
    def log_scalars(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def log_text(self, step: int, tag: str, text: str) -> None: ...

    @abstractmethod
    def log_summary(self, summary: dict) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def summary_scalars(summary: dict) -> dict[str, float]:
    """The numeric top-level fields of a run summary, as `summary/<field>`."""
    return {f"summary/{k}": v for k, val in summary.items() if (v := number(val)) is not None}
