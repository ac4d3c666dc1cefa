"""Read a run directory (or a simulation's output directory) for a report, checking it first.

A run directory (`dynaresize run`) holds `records.jsonl`; a simulation directory
(`dynaresize simulate`) holds `summary.json` with `results` and one `<policy>/records.jsonl` per
policy. Either loads as a list of `RunRecords`, one per run.

Invariant: anything malformed is one `UserError` line naming the file (and line) and what is
wrong: a missing directory, no records, a line that is not JSON or not a record, a record
missing a field of its kind (records.SCHEMA), no `step` record. One exception: a last line
without its newline that does not parse is what a run killed mid-write leaves, and is skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize.errors import UserError
from dynaresize.records import SCHEMA


@dataclass(frozen=True, kw_only=True)
class RunRecords:
    """The records of one run (a real run, or one policy of a simulation)."""

    name: str
    path: Path
    records: list[dict] = field(repr=False)

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    @property
    def summary(self) -> dict:
        """The last summary record's summary (a resumed run appends a new one), or {}."""
        found = self.of("summary")
        return found[-1]["summary"] if found else {}

    @property
    def simulated(self) -> bool:
        return not self.of("span")


def read_checked(path: Path) -> list[dict]:
    """The records of `path`, each checked against the schema of its kind."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # the last line, without its newline: a run killed mid-write
                continue
            raise UserError(f"{path}:{n}: bad JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
            raise UserError(f"{path}:{n}: not a record (a JSON object with a 'kind')")
        missing = [f for f in SCHEMA.get(rec["kind"], ()) if f not in rec]
        if missing:
            raise UserError(f"{path}:{n}: {rec['kind']} record lacks {', '.join(missing)}")
        records.append(rec)
    if not any(r["kind"] == "step" for r in records):
        raise UserError(f"{path}: no step records (nothing to report yet)")
    return records


def load_runs(run_dir: str | Path) -> tuple[list[RunRecords], dict | None]:
    """The runs in `run_dir`, and the simulation summary when it is a simulation directory."""
    root = Path(run_dir)
    if not root.is_dir():
        raise UserError(f"{root}: no such run directory")
    if (root / "records.jsonl").is_file():
        return [RunRecords(name=root.resolve().name, path=root / "records.jsonl",
                           records=read_checked(root / "records.jsonl"))], None
    doc = _sim_summary(root)
    if doc is None:
        raise UserError(f"{root}: not a run directory (no records.jsonl) nor a simulation directory "
                        "(no summary.json with results)")
    from dynaresize.records import safe_name

    runs = []
    for result in doc["results"]:
        path = root / safe_name(str(result.get("policy"))) / "records.jsonl"
        if not path.is_file():
            raise UserError(f"{path}: missing (summary.json lists policy {result.get('policy')!r})")
        runs.append(RunRecords(name=str(result["policy"]), path=path, records=read_checked(path)))
    return runs, doc


def _sim_summary(root: Path) -> dict | None:
    path = root / "summary.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: bad JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list) or not doc["results"]:
        return None
    return doc
