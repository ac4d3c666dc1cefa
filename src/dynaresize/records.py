"""One record stream for simulated and real runs: typed JSON objects, one per line.

Every record is a JSON object whose `kind` names its type. `SCHEMA` lists the fields each kind
must carry (more may be added); `Recorder.emit` checks them, so a tool reading
`records.jsonl` can rely on them. docs/records.md documents every kind.

The recorder is the only writer of `records.jsonl`; it appends and flushes each line, so a run
that dies leaves every record it emitted readable. It also hands every record, in order, to
its sinks (experiment trackers, `dynaresize.tracking`); a sink that fails is dropped with one
warning on stderr: a tracker never stops a run, and `records.jsonl` stays complete.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

SCHEMA: dict[str, tuple[str, ...]] = {
    "config": ("config",),
    "step": ("step", "t_start_s", "t_end_s", "rollout_s", "train_s", "sync_s", "num_rollout",
             "num_train", "idle_device_s", "tail_idle_device_s"),
    "resize": ("resize_id", "step", "from", "to", "moving", "to_role", "critical_s", "total_s"),
    "op": ("resize_id", "name", "device", "start_s", "end_s", "bytes", "critical"),
    "refused": ("step", "requested_rollout", "reason"),
    "decision": ("step", "action", "reason"),
    "sample": ("sample_id", "version", "device", "num_tokens", "token_sha1", "reward",
               "consumed_step", "dropped"),
    "span": ("device", "name", "start_s", "end_s"),
    "comm": ("event", "ranks", "critical"),
    "fault": ("step", "device", "fault_kind", "point"),  # `kind` names the record type
    "recovery": ("step", "lost_devices", "recovery_s", "num_devices"),
    "checkpoint": ("step", "path", "cause"),
    "snapshot": ("step", "snapshot_kind", "bytes", "seconds", "critical_s"),
    "resume": ("step", "checkpoint", "num_devices"),
    "eval": ("step", "version", "reward_mean", "pass_at_1", "num_prompts", "samples_per_prompt"),
    "placement": ("strategy", "nodes"),
    "concurrency": ("step", "device", "t_s", "in_flight", "mean_in_flight", "peak", "window_s"),
    "weight_sync": ("step", "device", "mode", "changed_fraction", "wire_bytes", "wire_dtype", "staging_peak_bytes",
                    "seconds"),
    "summary": ("summary",),
}


def safe_name(policy: str) -> str:
    """A policy's name as a file name: the folder its `records.jsonl` goes to in a comparison."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", policy)


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity; write them as null so every line parses strictly."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def make_record(kind: str, **fields: Any) -> dict:
    """A record dict of `kind`; raises ValueError if a schema field is missing."""
    missing = [f for f in SCHEMA.get(kind, ()) if f not in fields]
    if kind not in SCHEMA:
        raise ValueError(f"unknown record kind {kind!r}")
    if missing:
        raise ValueError(f"record {kind!r} lacks fields {missing}")
    return {"kind": kind, **_clean(fields)}


class Sink(Protocol):
    """Receives every record a recorder emits (see `dynaresize.tracking`)."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class Recorder:
    """Appends records to a JSONL file (or keeps them in memory when `path` is None) and hands
    each to `sinks`."""

    def __init__(self, path: str | Path | None, sinks: Iterable[Sink] = ()) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        self.sinks: list[Sink] = list(sinks)
        self._lock = threading.Lock()  # the overlapped rollout thread emits too: lines and sink calls stay whole
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")

    def emit(self, kind: str, **fields: Any) -> dict:
        rec = make_record(kind, **fields)
        with self._lock:
            self.records.append(rec)
            if self._fh is not None:
                self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
                self._fh.flush()
            for sink in list(self.sinks):
                self._to_sink(sink, "write", rec)
        return rec

    def _to_sink(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # a tracker's failure must not stop the run
            self.sinks.remove(sink)
            print(f"dynaresize: warning: {type(sink).__name__} failed ({type(exc).__name__}: {exc}); "
                  "it gets no more records", file=sys.stderr)
            if method != "close":
                try:
                    sink.close()
                except Exception:
                    pass

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    def close(self) -> None:
        with self._lock:
            for sink in list(self.sinks):
                self._to_sink(sink, "close")
            self.sinks = []
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: str | Path, kind: str | None = None) -> Iterator[dict]:
    """Yield the records of a `records.jsonl` file, optionally only those of one kind."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                if kind is None or rec.get("kind") == kind:
                    yield rec


def run_records(run_dir: str | Path, kind: str | None = None) -> Iterator[dict]:
    """Yield the records of the run in `run_dir` (optionally one kind), for commands reading a
    run a user names: a missing `records.jsonl` or a line that is not JSON is a `UserError`
    naming the file (and line), raised when iteration reaches it."""
    from dynaresize.errors import UserError

    p = Path(run_dir)
    path = p / "records.jsonl"
    if not path.is_file():
        raise UserError(f"{p}: no records.jsonl (not a dynaresize run directory)")
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{lineno}: not a JSON record") from None
            if kind is None or rec.get("kind") == kind:
                yield rec
