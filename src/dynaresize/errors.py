"""One small error hierarchy.

Invariant: every exception here pickles (it may cross a Ray process boundary), and a
`UserError` carries a one-line message meant for a person; the CLI turns it into exit code 2
without a traceback.
"""

from __future__ import annotations

from typing import Any


class DynaresizeError(Exception):
    """Base of every error this package raises on purpose."""


class UserError(DynaresizeError):
    """Bad input from the user (config, trace, prompt file, flags). Exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """One or more config fields are invalid; `errors` lists `path: message` lines."""

    def __init__(self, errors: list[str] | str) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("; ".join(self.errors))

    def __reduce__(self):  # keep the list when pickled across processes
        return (type(self), (self.errors,))


class TraceError(UserError):
    """A malformed workload trace file; the message names the file and line."""


class DataError(UserError):
    """A malformed or empty prompt file; the message names the file and line."""


class CheckpointError(DynaresizeError):
    """A checkpoint is missing, partial or corrupt. Exit code 1."""

    exit_code = 1


class ResizeRefused(DynaresizeError):
    """A requested resize breaks the bounds; the run goes on with the old assignment."""


class RewardError(DynaresizeError):
    """A reward function raised or returned a non-number."""


class WorkerLost(DynaresizeError):
    """A device worker died or stopped answering within the configured timeout."""

    def __init__(self, device: int, where: str) -> None:
        self.device = device
        self.where = where
        super().__init__(f"device {device} lost during {where}")

    def __reduce__(self):
        return (type(self), (self.device, self.where))


class FieldErrors:
    """Collects `path=value: message` lines while a config is built (`config`, `config_load`)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.prefix = ""

    def add(self, name: str, value: Any, message: str) -> None:
        self.lines.append(f"{self.prefix}{name}={value!r}: {message}")

    def need(self, ok: bool, name: str, value: Any, message: str) -> None:
        if not ok:
            self.add(name, value, message)
