"""Per-step metrics of a user's RL job, from the names its framework logs them under.

`StepMetrics` is one logged step in our words (stage seconds, response and prompt lengths);
`steps_from_rows` maps rows of `{logged key: value}` to them, and `parse_console` turns a
verl console log into such rows: every line carrying `step:N` and `key:value` pairs separated
by ` - ` (Ray's `(TaskRunner pid=...)` prefix and any other text before `step:` allowed).

What each logged key feeds (`KEYS`, docs/advise.md):
- rollout stage: verl `timing_s/gen`; dynaresize `rollout_s`;
- training stage: the sum of verl's `timing_s/old_log_prob`, `timing_s/ref`, `timing_s/values`,
  `timing_s/adv`, `timing_s/reward`, `timing_s/update_critic`, `timing_s/update_actor` (dynaresize
  `train_s`);
- weight sync: `timing_s/update_weights` or `timing_s/sync_rollout_weights` (dynaresize `sync_s`);
- step: `timing_s/step` (dynaresize: `t_end_s - t_start_s`);
- lengths: `response_length/mean|max|clip_ratio`, `prompt_length/mean` (TRL's
  `completions/mean_length|max_length|clipped_ratio`; OpenRLHF's W&B `train/response_length`, a
  mean; dynaresize `response_len_mean|max`). No stage-time names of TRL or OpenRLHF are known
  here: their logs need the stage times added under verl's (docs/advise.md);
- `global_seqlen/mean` is read and reported, not fitted (verl's tokens per data-parallel rank).

Pure: strings and dicts in, values out (the command reads the files).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dynaresize.errors import UserError

# our name -> the logged names it is read from (first found wins, except `train_parts`, summed)
KEYS: dict[str, tuple[str, ...]] = {
    "rollout_s": ("timing_s/gen", "rollout_s"),
    "sync_s": ("timing_s/update_weights", "timing_s/sync_rollout_weights", "sync_s"),
    "step_s": ("timing_s/step", "step_s"),
    "len_mean": ("response_length/mean", "completions/mean_length", "train/response_length", "response_len_mean"),
    "len_max": ("response_length/max", "completions/max_length", "response_len_max"),
    "clip_ratio": ("response_length/clip_ratio", "completions/clipped_ratio"),
    "prompt_mean": ("prompt_length/mean",),
    "global_seqlen_mean": ("global_seqlen/mean",),
    "rest_s": ("rest_s",),  # a dynaresize run directory's own (commands.advise_read)
}
TRAIN_PARTS = ("timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv", "timing_s/reward",
               "timing_s/update_critic", "timing_s/update_actor", "train_s")

_STEP = re.compile(r"(?:^|[\s\-|])step:\s*(\d+)")
_PAIR = re.compile(r"([A-Za-z_][\w./@\-]*):\s*(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf)(?=\s|$|,)")


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One logged step: stage seconds and lengths in tokens (None: not logged)."""

    step: int
    rollout_s: float | None = None
    train_s: float | None = None
    sync_s: float | None = None
    step_s: float | None = None
    len_mean: float | None = None
    len_max: float | None = None
    clip_ratio: float | None = None
    prompt_mean: float | None = None
    global_seqlen_mean: float | None = None
    rest_s: float | None = None  # step time outside the stages, where the source pairs them differently

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step={self.step}: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class LoggedRun:
    """The steps read from one source and which logged keys fed which of our fields."""

    source: str
    steps: tuple[StepMetrics, ...]
    found: dict  # our field -> the logged key(s) it came from
    samples_per_step: int | None = None  # from a printed config or a run directory, when given there
    num_devices: int | None = None
    rollout_devices: int | None = None
    lengths: dict | None = None  # step -> its exact response lengths (a dynaresize run's sample records)


def parse_console(lines, name: str = "<log>") -> list[dict]:
    """Rows `{"step": N, key: value, ...}` of the lines of a verl-style console log, in order.
    A later line for the same step updates that step's row (verl prints one line per step)."""
    rows: dict[int, dict] = {}
    for line in lines:
        m = _STEP.search(line)
        if not m:
            continue
        tail = line[m.end():]
        pairs = {k: float(v) for k, v in _PAIR.findall(tail) if k != "step"}
        if not pairs:
            continue
        rows.setdefault(int(m.group(1)), {"step": int(m.group(1))}).update(pairs)
    return [rows[k] for k in sorted(rows)]


def printed_batch(text: str) -> int | None:
    """samples per step from a printed verl config (`data.train_batch_size` x `rollout.n`), when
    both appear (`'train_batch_size': 512` / `train_batch_size=512` and `'n': 16` inside a
    `rollout` block, or `rollout.n=16`)."""
    tb = re.search(r"train_batch_size['\"]?\s*[:=]\s*(\d+)", text)
    n = re.search(r"rollout\.n\s*=\s*(\d+)", text)
    if n is None:
        block = re.search(r"['\"]rollout['\"]\s*:\s*\{", text)
        if block:
            n = re.search(r"['\"]n['\"]\s*:\s*(\d+)", text[block.end():block.end() + 4000])
    return int(tb.group(1)) * int(n.group(1)) if tb and n else None


def steps_from_rows(rows: list[dict], source: str) -> tuple[tuple[StepMetrics, ...], dict]:
    """Our `StepMetrics` per row, and `{our field: logged key(s)}` of what was found. Rows
    without a step number, or whose values are not finite, are an error naming the source."""
    found: dict[str, str] = {}
    out: list[StepMetrics] = []
    for row in rows:
        step = row.get("step")
        if step is None or not _finite(step) or float(step) < 0:
            raise UserError(f"{source}: a row without a step number ({_short(row)})")
        fields: dict = {"step": int(step)}
        for ours, names in KEYS.items():
            for key in names:
                v = row.get(key)
                if v is not None and _finite(v):
                    fields[ours] = float(v)
                    found.setdefault(ours, key)
                    break
        parts = [key for key in TRAIN_PARTS if row.get(key) is not None and _finite(row[key])]
        if parts:
            fields["train_s"] = sum(float(row[key]) for key in parts)
            found.setdefault("train_s", "+".join(parts))
        out.append(StepMetrics(**fields))
    out.sort(key=lambda s: s.step)
    return tuple(out), found


def missing(run: LoggedRun) -> list[str]:
    """One phrase per field the advice needs and the source lacks (empty: enough to go on)."""
    needs = {"rollout_s": "the rollout stage model (verl timing_s/gen)",
             "train_s": "the training stage model (verl timing_s/update_actor, timing_s/old_log_prob, ...)",
             "len_mean": "the length distribution (verl response_length/mean)"}
    return [f"{why}" for key, why in needs.items() if key not in run.found]


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _short(row: dict) -> str:
    text = ", ".join(f"{k}={v}" for k, v in list(row.items())[:4])
    return text if len(text) < 120 else text[:117] + "..."
