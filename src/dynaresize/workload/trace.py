"""Workload traces: JSONL, one line per step, replacing the modelled workload; and `Batch`, one
step's response and prompt lengths (the value both the simulator and the runtime read).

    {"step": 0, "response_tokens": [812, 95, ...], "prompt_tokens": [301, 301, ...]}

`prompt_tokens` is optional (default `DEFAULT_PROMPT_TOKENS` per sample) and, when given, has
one entry per response. The number of samples of a step is the length of its list. Steps
must be integers in strictly increasing order; blank lines are skipped. The simulator uses the
steps in file order; `trace_steps` keys them by their `step` value (what
`workload.lengths_for_step` reads). Any malformed line raises `TraceError` naming the file and
line number.

Pure except `load_trace` / `write_trace` (file I/O).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynaresize.errors import TraceError

DEFAULT_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Batch:
    """One step's samples: response and prompt lengths in tokens, in sample order."""

    response_tokens: np.ndarray  # int64, shape (num_samples,)
    prompt_tokens: np.ndarray  # int64, same shape
    # Multi-turn: seconds each trajectory waits on its environment between turns, holding its
    # slot (float64, same shape); None: single-turn.
    wait_s: np.ndarray | None = None
    # Dynamic sampling (a workload with a filtered share, `lengths.WorkloadSpec.filter_share`):
    # the generation batch of each sample (int64, same shape; batches run one after another) and
    # whether it is trained (bool: its group was kept). None: one batch, every sample trained.
    gen_batch: np.ndarray | None = None
    trained: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.response_tokens.shape[0])

    @property
    def num_gen_batches(self) -> int:
        return 1 if self.gen_batch is None or not self.gen_batch.size else int(self.gen_batch.max()) + 1


def _int_list(value, field: str, where: str) -> list[int]:
    if not isinstance(value, list):
        raise TraceError(f"{where}: {field} must be a list of token counts, got {type(value).__name__}")
    if not value:
        raise TraceError(f"{where}: {field} is empty (a step needs at least one sample)")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TraceError(f"{where}: {field}[{i}] = {v!r} is not an integer")
        if v < 0:
            raise TraceError(f"{where}: {field}[{i}] = {v} is negative")
    return value


def parse_trace_lines(lines, name: str = "<trace>") -> list[Batch]:
    return [b for _, b in parse_trace_steps(lines, name)]


def parse_trace_steps(lines, name: str = "<trace>") -> list[tuple[int, Batch]]:
    """(step, batch) per line, in file order."""
    batches: list[tuple[int, Batch]] = []
    last_step: int | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: bad JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        step = obj.get("step")
        if "step" not in obj or isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TraceError(f"{where}: step must be a non-negative integer, got {step!r}")
        if last_step is not None and step <= last_step:
            raise TraceError(f"{where}: step {step} does not follow step {last_step}")
        if "response_tokens" not in obj:
            raise TraceError(f"{where}: missing response_tokens")
        resp = _int_list(obj["response_tokens"], "response_tokens", where)
        if "prompt_tokens" in obj and obj["prompt_tokens"] is not None:
            prompt = _int_list(obj["prompt_tokens"], "prompt_tokens", where)
            if len(prompt) != len(resp):
                raise TraceError(f"{where}: prompt_tokens has {len(prompt)} entries, response_tokens {len(resp)}")
        else:
            prompt = [DEFAULT_PROMPT_TOKENS] * len(resp)
        batches.append((step, Batch(np.asarray(resp, dtype=np.int64), np.asarray(prompt, dtype=np.int64))))
        last_step = step
    if not batches:
        raise TraceError(f"{name}: no steps in the trace")
    return batches


def load_trace(path: str | Path) -> list[Batch]:
    """The trace's batches in file order."""
    return [b for _, b in load_trace_steps(path)]


def load_trace_steps(path: str | Path) -> list[tuple[int, Batch]]:
    """The trace's (step, batch) pairs in file order."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: trace file not found")
    with open(p, encoding="utf-8") as fh:
        try:
            return parse_trace_steps(fh, name=str(p))
        except UnicodeDecodeError:
            raise TraceError(f"{p}: not a UTF-8 text file") from None


def write_trace(path: str | Path, batches: list[Batch]) -> None:
    """Write batches as a trace file (used to export a modelled workload)."""
    with open(path, "w", encoding="utf-8") as fh:
        for k, b in enumerate(batches):
            fh.write(json.dumps({"step": k, "response_tokens": b.response_tokens.tolist(),
                                 "prompt_tokens": b.prompt_tokens.tolist()}) + "\n")
