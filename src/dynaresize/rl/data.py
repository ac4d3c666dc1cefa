"""The prompt source: a JSONL prompt file, and which prompts each step takes (a training
dataset in verl's or TRL's schema is read by `rl.dataset`).

Invariants:
- `load_prompts` returns one dict per non-blank line, each with a non-empty string `prompt`;
  every other field is kept untouched (it goes to the reward function). Any bad line raises
  `DataError` naming the file and the line number, in one line.
- `prompts_for_step(prompts, step, num_prompts, seed)` is a function of its arguments only
  (never of device counts): a seeded shuffle per epoch over the prompt list, read as one
  endless stream, `num_prompts` at a time. Every prompt is used once per epoch.
- The prompt index of a sample id is the position within the step (0..num_prompts-1), so the
  ids of a step are unique even when a step spans an epoch boundary or the prompt list is
  shorter than a step.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

from dynaresize.errors import DataError
from dynaresize.rl.dataset import jsonl_rows
from dynaresize.rl.seeds import derived_seed


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL prompt file (blank lines skipped), each with a `prompt` string
    (`eval.prompts_file`; a training dataset in verl's or TRL's schema: `rl.dataset`)."""
    records: list[dict] = []
    for where, rec in jsonl_rows(path):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object with a \"prompt\" field, got {type(rec).__name__}")
        if "prompt" not in rec:
            raise DataError(f"{where}: missing \"prompt\" field (fields: {', '.join(sorted(rec)) or 'none'})")
        if not isinstance(rec["prompt"], str):
            raise DataError(f"{where}: \"prompt\" must be a string, got {type(rec['prompt']).__name__}")
        if not rec["prompt"].strip():
            raise DataError(f"{where}: \"prompt\" is empty")
        records.append(rec)
    if not records:
        raise DataError(f"{Path(path)}: no prompts (the file is empty)")
    return records


def prompt_order(num_records: int, step: int, num_prompts: int, seed: int) -> list[int]:
    """Indices into the prompt list of the `num_prompts` prompts of `step`."""
    if num_records < 1:
        raise ValueError("no prompts")
    if step < 0 or num_prompts < 1:
        raise ValueError(f"bad step {step} or num_prompts {num_prompts}")
    out = []
    perm: list[int] = []
    perm_epoch = -1
    for k in range(step * num_prompts, (step + 1) * num_prompts):
        epoch, pos = divmod(k, num_records)
        if epoch != perm_epoch:
            perm = list(range(num_records))
            random.Random(derived_seed(seed, "prompt-order", epoch)).shuffle(perm)
            perm_epoch = epoch
        out.append(perm[pos])
    return out


def prompts_for_step(prompts: Sequence[dict], step: int, num_prompts: int, seed: int) -> list[tuple[int, dict]]:
    """(prompt_index, record) for each prompt of `step`; prompt_index is the position in the step."""
    return [(j, prompts[i]) for j, i in enumerate(prompt_order(len(prompts), step, num_prompts, seed))]


def reward_fields(record: dict) -> dict:
    """The fields of a prompt record handed to the reward function: all but `prompt`."""
    return {k: v for k, v in record.items() if k != "prompt"}
