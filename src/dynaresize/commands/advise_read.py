"""Read a job's per-step metrics for `dynaresize advise` from where the user has them.

- `verl-log`: a console log (`advise.logs.parse_console`), its printed config read for the batch;
- `tensorboard`: an event directory (or one event file): every scalar tag, by step; read with the
  `tensorboard` package's event reader where installed, else tensorboardX's protobufs (the
  `tensorboard` extra) and a record reader here; neither: one line naming the extra;
- `wandb-csv`: a W&B history export (a `_step` or `step` column, one column per key);
- `dynaresize`: a run directory (`records.jsonl`): step records, the config's devices, split and
  batch, and each step's exact response lengths from its sample records.

`auto` picks by what the path is. Every failure is a `UserError` naming the file and what was
missing (exit 2, one line).
"""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import numpy as np

from dynaresize.advise.logs import LoggedRun, parse_console, printed_batch, steps_from_rows
from dynaresize.errors import UserError
from dynaresize.records import run_records

FORMATS = ("auto", "verl-log", "tensorboard", "wandb-csv", "dynaresize")


def detect(path: Path) -> str:
    if path.is_dir():
        if (path / "records.jsonl").is_file():
            return "dynaresize"
        if any(p.name.startswith("events.out.tfevents") for p in path.rglob("events.out.tfevents*")):
            return "tensorboard"
        raise UserError(f"{path}: a directory with neither records.jsonl (a dynaresize run) nor TensorBoard "
                        "event files (events.out.tfevents.*)")
    if not path.is_file():
        raise UserError(f"{path}: no such file or directory")
    if path.name.startswith("events.out.tfevents"):
        return "tensorboard"
    if path.suffix.lower() == ".csv":
        return "wandb-csv"
    return "verl-log"


def read(path: str | Path, fmt: str = "auto") -> LoggedRun:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file or directory")
    kind = detect(p) if fmt == "auto" else fmt
    reader = {"verl-log": _console, "tensorboard": _tensorboard, "wandb-csv": _csv, "dynaresize": _run_dir}[kind]
    run = reader(p)
    if not run.steps:
        raise UserError(f"{p}: no per-step metrics found (read as {kind}: expected "
                        + {"verl-log": "lines with step:N and key:value pairs",
                           "tensorboard": "scalars such as timing_s/gen by step",
                           "wandb-csv": "a _step column and metric columns",
                           "dynaresize": "step records in records.jsonl"}[kind] + ")")
    return run


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"{p}: cannot read ({exc.strerror})") from None


def _console(p: Path) -> LoggedRun:
    text = _text(p)
    steps, found = steps_from_rows(parse_console(text.splitlines(), str(p)), str(p))
    return LoggedRun(source=str(p), steps=steps, found=found, samples_per_step=printed_batch(text))


def _csv(p: Path) -> LoggedRun:
    with open(p, newline="", encoding="utf-8", errors="replace") as fh:
        try:
            table = list(csv.DictReader(fh))
        except csv.Error as exc:
            raise UserError(f"{p}: not a CSV file ({exc})") from None
    if table and not any(k in table[0] for k in ("_step", "step")):
        raise UserError(f"{p}: no _step (or step) column; a W&B history export has one")
    rows = []
    for t in table:
        row: dict = {}
        for k, v in t.items():
            if k is None or v in (None, ""):
                continue
            try:
                row[k] = float(v)
            except ValueError:
                continue
        if "_step" in row:
            row["step"] = row.pop("_step")
        if "step" in row:
            rows.append(row)
    steps, found = steps_from_rows(rows, str(p))
    return LoggedRun(source=str(p), steps=steps, found=found)


def _tensorboard(p: Path) -> LoggedRun:
    files = sorted(p.rglob("events.out.tfevents*")) if p.is_dir() else [p]
    by_step: dict[int, dict] = {}
    for f in files:
        for tag, step, value in _scalars(f):
            by_step.setdefault(step, {"step": step})[tag] = value
    steps, found = steps_from_rows([by_step[k] for k in sorted(by_step)], str(p))
    return LoggedRun(source=str(p), steps=steps, found=found)


def _event_class():
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        try:
            from tensorboardX.proto.event_pb2 import Event
        except ImportError:
            raise UserError("reading TensorBoard event files needs the tensorboard extra: "
                            "pip install 'dynaresize[tensorboard]'") from None
    return Event


def _scalars(f: Path):
    """(tag, step, value) of every scalar in one event file (TFRecord framing: length, its
    CRC, the Event proto, its CRC; the CRCs are not checked, a truncated tail is ignored)."""
    Event = _event_class()
    data = f.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        body = data[pos + 12:pos + 12 + n]
        if len(body) < n:
            break
        pos += 12 + n + 4
        ev = Event()
        try:
            ev.ParseFromString(body)
        except Exception:  # noqa: BLE001 (any decode failure: not an event file)
            raise UserError(f"{f}: not a TensorBoard event file (a record does not decode)") from None
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                yield v.tag, int(ev.step), float(v.simple_value)
            elif v.HasField("tensor") and v.tensor.float_val:
                yield v.tag, int(ev.step), float(v.tensor.float_val[0])
            elif v.HasField("tensor") and v.tensor.double_val:
                yield v.tag, int(ev.step), float(v.tensor.double_val[0])
            elif v.HasField("tensor") and len(v.tensor.tensor_content) in (4, 8):
                fmt = "<f" if len(v.tensor.tensor_content) == 4 else "<d"
                yield v.tag, int(ev.step), float(struct.unpack(fmt, v.tensor.tensor_content)[0])


def _run_dir(p: Path) -> LoggedRun:
    path = p / "records.jsonl"
    config: dict = {}
    rows: list[dict] = []
    lengths: dict[int, dict[tuple[int, int], int]] = {}
    for rec in run_records(p):
        kind = rec.get("kind")
        if kind == "config" and not config:
            config = rec.get("config", {})
        elif kind == "step":
            rows.append({"step": rec["step"], "rollout_s": rec.get("rollout_s"), "train_s": rec.get("train_s"),
                         "sync_s": rec.get("sync_s"), "step_s": rec["t_end_s"] - rec["t_start_s"],
                         "response_len_mean": rec.get("response_len_mean"),
                         "response_len_max": rec.get("response_len_max"),
                         "num_rollout": rec.get("num_rollout"), "num_train": rec.get("num_train")})
        elif kind == "sample" and not rec.get("dropped") and "num_tokens" in rec:
            s, prompt, i = (int(x) for x in str(rec["sample_id"]).split("-"))
            lengths.setdefault(s, {})[(prompt, i)] = int(rec["num_tokens"])
    if not rows:
        raise UserError(f"{path}: no step records")
    rollout = config.get("rollout", {})
    splits = {(r["num_rollout"], r["num_train"]) for r in rows}
    if len(splits) > 1:
        raise UserError(f"{p}: the run changed its split ({', '.join(f'{a}:{b}' for a, b in sorted(splits))}); "
                        "shadow mode reads a static run (one split throughout)")
    (num_rollout, num_train), = splits
    steps, found = steps_from_rows(_by_batch(rows), str(p))
    per_step = {s.step: np.array([v for _, v in sorted(lengths[s.step].items())], dtype=np.int64)
                for s in steps if s.step in lengths} or None
    spp = (rollout.get("prompts_per_step") or 0) * (rollout.get("samples_per_prompt") or 0) or None
    return LoggedRun(source=str(p), steps=steps, found=found, samples_per_step=spp,
                     num_devices=num_rollout + num_train, rollout_devices=num_rollout, lengths=per_step)


def _by_batch(rows: list[dict]) -> list[dict]:
    """A run's step record k holds the training of batch k but the rollout of batch k + 1 (the
    one-step-off pipeline; batch 0 rolls out before step 0 and has no record): one row per batch,
    its rollout time from the record before. The per-step rest (`rest_s`: the window minus its
    slower stage) and the step time stay those of the record's own window."""
    rows = sorted(rows, key=lambda r: r["step"])
    out = []
    for prev, row in zip([None, *rows[:-1]], rows):
        roll = prev["rollout_s"] if prev is not None and prev["step"] == row["step"] - 1 else None
        rest = row["step_s"] - max(row["rollout_s"] or 0.0, row["train_s"] or 0.0)
        out.append(row | {"rollout_s": roll, "rest_s": rest})
    return out


def emulated_presets(p: Path) -> tuple[str, str] | None:
    """(accelerator, model) a dynaresize run was paced to (`cluster.emulate`), if any."""
    path = p / "records.jsonl"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("kind") == "config":
                spec = rec.get("config", {}).get("cluster", {}).get("emulate")
                if spec and ":" in spec:
                    accel, _, model = spec.partition(":")
                    return accel, model
                return None
    return None
