"""Training datasets as users already have them: parquet or JSONL, in verl's or TRL's schema.

A file's rows become prompt records: `{"prompt": str | [chat messages], ...fields}`, the form
`rl.data` and the job read (`prompt` is what the model sees, every other key goes to the reward).

- verl's schema (detected when the first row has a `reward_model` field): `{data_source,
  prompt, ability, reward_model: {style, ground_truth}, extra_info}`. The record keeps every
  column and adds `ground_truth` (from `reward_model.ground_truth`), so that a verl
  `compute_score(data_source, solution_str, ground_truth, extra_info)` gets its arguments.
- TRL's schema (any other file): a `prompt` column; every other column goes to the reward
  (a TRL reward function gets each as a keyword argument).
- `columns` (`task.columns`) names which column plays each role for other layouts:
  `{"prompt": "question", "ground_truth": "answer"}`; a dotted name reads inside a struct
  (`reward_model.ground_truth`). The named column stays in the record under its own name too.

A prompt is a non-empty string or a non-empty list of chat messages `{"role": str, "content":
str}` (rendered with the tokenizer's chat template by the job). Invariant: a bad file, row or
field raises `DataError` with one line naming the file, the row (JSONL: `FILE:LINE`, the line
number from 1; parquet: `FILE: row N`, counted from 0 as pandas and pyarrow do) and the field.

Pure except for reading (and, for the built-in math task, writing) the file; pyarrow is
imported only for parquet. No torch, no Ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dynaresize.errors import DataError

ROLES = ("prompt", "ground_truth", "data_source", "extra_info")  # the keys of task.columns
PARQUET_SUFFIXES = (".parquet", ".pq")


def jsonl_rows(path: str | os.PathLike, what: str = "prompt file") -> Iterator[tuple[str, Any]]:
    """(`FILE:LINE`, parsed JSON) for each non-blank line; a missing or unreadable file, or a
    line that is not JSON, raises DataError naming the file (and the line)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{p}: {what} not found") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{p}: cannot read {what} ({exc.strerror})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{p}:{lineno}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{lineno}: bad JSON ({exc.msg} at column {exc.colno})") from None


def parquet_rows(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """(`FILE: row N`, row dict) for each row of a parquet file (N from 0)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: dataset not found")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{p}: not a readable parquet file ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    for i, row in enumerate(rows):
        yield f"{p}: row {i}", row


def load_dataset(path: str | os.PathLike, columns: Mapping[str, str] | None = None) -> list[dict]:
    """The prompt records of a parquet or JSONL file (see the module docstring)."""
    p = Path(path)
    rows = parquet_rows(p) if p.suffix.lower() in PARQUET_SUFFIXES else jsonl_rows(p, "dataset")
    columns = dict(columns or {})
    bad = sorted(set(columns) - set(ROLES))
    if bad:
        raise DataError(f"task.columns: unknown role {bad[0]!r} (roles: {', '.join(ROLES)})")
    records: list[dict] = []
    verl = None
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with a \"prompt\" field, got {type(row).__name__}")
        if verl is None:
            verl = "reward_model" in row
        records.append(_record(where, row, columns, verl))
    if not records:
        raise DataError(f"{p}: no prompts (the file is empty)")
    return records


def schema(records: list[dict]) -> str:
    """`verl` or `trl`: the schema `load_dataset` read a file's records in (from its first row)."""
    return "verl" if records and "reward_model" in records[0] else "trl"


def _get(row: dict, name: str) -> tuple[bool, Any]:
    """(found, value) of a column; a dotted name reads inside structs."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _record(where: str, row: dict, columns: dict[str, str], verl: bool) -> dict:
    rec = dict(row)
    for role, column in columns.items():
        found, value = _get(row, column)
        if not found:
            raise DataError(f"{where}: missing field {column!r} (task.columns {role}={column}; "
                            f"fields: {', '.join(sorted(row)) or 'none'})")
        rec[role] = value
    if rec.get("prompt") is None:  # parquet reads a row without the column as null
        raise DataError(f"{where}: missing \"prompt\" field (fields: "
                        f"{', '.join(sorted(k for k, v in row.items() if v is not None)) or 'none'})")
    field = f"\"prompt\" (column {columns['prompt']!r})" if "prompt" in columns else "\"prompt\""
    rec["prompt"] = _prompt(where, field, rec["prompt"])
    if verl:
        rm = row.get("reward_model")
        if not isinstance(rm, dict):
            raise DataError(f"{where}: \"reward_model\" must be a struct with a \"ground_truth\" field, "
                            f"got {type(rm).__name__}")
        if "ground_truth" not in columns:
            if rm.get("ground_truth") is None:
                raise DataError(f"{where}: missing field \"reward_model.ground_truth\"")
            rec["ground_truth"] = rm["ground_truth"]
    for name, types, need in (("data_source", (str,), "a string"), ("extra_info", (dict,), "a struct (a dict)")):
        if rec.get(name) is not None and not isinstance(rec[name], types):
            raise DataError(f"{where}: \"{name}\" must be {need}, got {type(rec[name]).__name__}")
    return rec


def _prompt(where: str, field: str, value: Any) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {field} is empty")
        return value
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}: {field} must be a string or a list of chat messages, got {type(value).__name__}")
    if not value:
        raise DataError(f"{where}: {field} is an empty list of chat messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: {field}[{i}] must be a chat message {{role, content}}, got {type(msg).__name__}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = "missing" if msg.get(key) is None else f"a {type(msg[key]).__name__}"
                raise DataError(f"{where}: {field}[{i}].{key} must be a string ({got})")
        out.append({k: v for k, v in msg.items() if v is not None})  # parquet fills absent struct keys with null
    return out


def prompt_key(prompt: Any) -> str:
    """A prompt as a dict or set key (chat prompts are lists of messages)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def is_chat(prompt: Any) -> bool:
    """Whether a record's prompt is a list of chat messages (rendered with a chat template)."""
    return isinstance(prompt, list)


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows as a parquet file, atomically (a temporary file renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, p)
    return p
