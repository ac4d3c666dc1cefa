"""The numbers of a run, one definition each: the headline numbers a run reports, and the
scalars read back from its records.

Headline numbers (`throughput_fields`, `resize_counts`), assembled one way for the simulator,
the real runtime and `compare`: `dynaresize simulate` (sim/engine.py, sim/stream.py),
`dynaresize run` (driver/run.py) and
`dynaresize compare` (which puts the two side by side) all report a run with these fields, from
the same inputs: the devices, the run's time, the samples consumed, the device-seconds no work
ran (and the part of it rollout devices spent waiting for a step's last response), and the
resizes by direction. So a `prediction_error` compares two numbers defined the same way.

Invariants: `idle_fraction` and `tail_idle_fraction` are shares of `num_devices x
total_time_s`, `tail_idle_fraction <= idle_fraction`; `resizes = resizes_to_rollout +
resizes_to_train`. Pure: no Ray, torch or I/O.

The headline (`headline_rows`): the figures a reader of a run comes for, one list of (figure,
value, unit) rows that `dynaresize run`'s closing summary prints and `dynaresize report` puts
first: throughput, its gain over the simulator's prediction for the static split the run started
from and over its prediction for the run's own policy (emulated runs; `Prediction`), resizes
each way, idle and tail idle, reward first -> last, the ledger. Every time is in the run's time
unit, which the rows name (emulated, wall or simulated seconds).

Scalars derived from records (`step_scalars`, `resize_scalars`, `eval_scalars` and the text
lines): one definition shared by the experiment trackers and the report. Read only: maps one record (a dict of the docs/records.md schema) to named scalars.
`STEP_SCALARS` and `RESIZE_SCALARS` list every name with the record field it comes from;
docs/records.md ("Scalars") documents the same names, and a test checks both agree.

Invariants:
- a scalar is emitted only when its source field is present and a finite number (`None`, NaN,
  strings and booleans are skipped), so records from older runs or from the simulator, and
  step records without training metrics, map without error;
- `idle/fraction` and `idle/tail_fraction` divide by the device-seconds of the step window:
  `(num_rollout + num_train) * (t_end_s - t_start_s)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dynaresize.types import ROLLOUT, TRAIN


def throughput_fields(*, num_devices: int, total_time_s: float, num_samples: int, idle_device_s: float,
                      tail_idle_device_s: float) -> dict:
    """`total_time_s`, `samples_per_s`, `idle_fraction`, `tail_idle_fraction` of a run."""
    device_s = num_devices * total_time_s
    return {
        "total_time_s": total_time_s,
        "samples_per_s": num_samples / total_time_s if total_time_s > 0 else 0.0,
        "idle_fraction": idle_device_s / device_s if device_s > 0 else 0.0,
        "tail_idle_fraction": tail_idle_device_s / device_s if device_s > 0 else 0.0,
    }


def resize_counts(to_roles: Iterable[str]) -> dict:
    """`resizes`, `resizes_to_rollout`, `resizes_to_train` from each resize's destination role."""
    roles = list(to_roles)
    return {"resizes": len(roles), "resizes_to_rollout": roles.count(ROLLOUT), "resizes_to_train": roles.count(TRAIN)}



@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The simulator's prediction for an emulated run's job (`emulate.predict`): samples/s of the
    static split the run started from, and of the run's own policy (with its resizes)."""

    start_rollout: int
    static_samples_per_s: float
    policy_samples_per_s: float
    policy_resizes: int

    def __post_init__(self) -> None:
        if self.start_rollout < 0 or self.policy_resizes < 0:
            raise ValueError(f"Prediction: negative count in {self}")
        if not (self.static_samples_per_s > 0 and self.policy_samples_per_s > 0):
            raise ValueError(f"Prediction: samples/s must be > 0, got {self}")


# Why an unpaced run's headline has no prediction.
NO_PREDICTION_UNPACED = ("none: an unpaced run (this machine's wall seconds); the simulator predicts emulated runs "
                         "(--emulate, cluster.emulate)")


def time_unit_short(summary: dict, *, simulated: bool = False) -> str:
    """"simulated s", "emulated s" or "wall s": the unit of a run's times (its summary's
    `emulate` says whether they were paced)."""
    return "simulated s" if simulated else ("emulated s" if summary.get("emulate") else "wall s")


def headline_rows(summary: dict, prediction: Prediction | None = None, *, no_prediction: str = "",
                  simulated: bool = False) -> list[tuple[str, str, str]]:
    """The run's headline: (figure, value, unit) rows, from its summary and, for an emulated run,
    the simulator's `prediction` (else `no_prediction` says why there is none; empty: no rows).
    A figure whose summary fields are absent (a simulated run has no reward or ledger) is left out."""
    unit = time_unit_short(summary, simulated=simulated)
    rows: list[tuple[str, str, str]] = []
    rate, total = number(summary.get("samples_per_s")), number(summary.get("total_time_s"))
    if rate is not None:
        rows.append(("throughput", f"{rate:.3f}", f"samples per {unit}"))
    if total is not None:
        rows.append(("run time", f"{total:.1f}", unit + (" of the steps (startup left out)" if summary.get("emulate")
                                                          else "")))
    if prediction is not None and rate is not None:
        rows.append(("gain over static", f"{rate / prediction.static_samples_per_s:.2f}x",
                     f"this run / the simulator's {prediction.static_samples_per_s:.3f} samples per {unit} for the "
                     f"static split it started from ({prediction.start_rollout} rollout)"))
        rows.append(("vs prediction", f"{rate / prediction.policy_samples_per_s:.3f}",
                     f"measured / predicted: the simulator's {prediction.policy_samples_per_s:.3f} samples per "
                     f"{unit} for this policy ({prediction.policy_resizes} resizes)"))
    elif no_prediction:
        rows.append(("gain over static", "n/a", no_prediction))
    if "resizes" in summary:
        each_way = ("resizes_to_rollout" in summary and "resizes_to_train" in summary)
        rows.append(("resizes", str(summary["resizes"]), f"{summary['resizes_to_rollout']} to rollout, "
                     f"{summary['resizes_to_train']} to train" if each_way else "each way not recorded"))
    idle, tail = number(summary.get("idle_fraction")), number(summary.get("tail_idle_fraction"))
    if idle is not None:
        rows.append(("idle", f"{idle:.1%}", "of device-seconds (devices x run time) with no work"))
    if tail is not None:
        rows.append(("tail idle", f"{tail:.1%}", "of device-seconds: rollout devices done, waiting for "
                     "their step's last response (part of idle)"))
    first, last = number(summary.get("reward_first")), number(summary.get("reward_last"))
    if first is not None and last is not None:
        rows.append(("reward", f"{first:.3f} -> {last:.3f}", "mean reward of the first steps -> the last "
                     "(up to 2 each)"))
    if "ledger_ok" in summary:
        problems = summary.get("ledger_problems") or []
        rows.append(("ledger", "ok" if summary["ledger_ok"] else "FAILED",
                     "every sample generated once, consumed once or dropped with a reason" if summary["ledger_ok"]
                     else "; ".join(str(p) for p in problems[:3])))
    return rows


# Training metrics a step record may carry (emitted by the trainer when it reports them).
TRAIN_FIELDS: tuple[str, ...] = ("loss", "grad_norm", "kl", "entropy", "clip_frac", "lr")

# (scalar name, step-record field it is read from, meaning); derived ones name their inputs.
STEP_SCALARS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward_mean", "mean reward of the step's samples (left-out ones not counted)"),
    ("reward/std", "reward_std", "population std of the step's rewards (left-out ones not counted)"),
    ("reward/left_out", "reward_left_out", "samples a TRL-style reward left out (returned None)"),
    *((f"train/{f}", f, f"training metric `{f}` of the step") for f in TRAIN_FIELDS),
    ("sampling/gen_batches", "gen_batches", "generation batches the step took (algorithm.filter_groups)"),
    ("sampling/groups_kept", "groups_kept", "prompt groups the step trained on (algorithm.filter_groups)"),
    ("sampling/groups_filtered", "groups_filtered", "prompt groups filtered out: constant metric (algorithm.filter_groups)"),
    ("response_len/mean", "response_len_mean", "mean response length (tokens)"),
    ("response_len/max", "response_len_max", "longest response (tokens)"),
    ("time/rollout_s", "rollout_s", "rollout stage time"),
    ("time/train_s", "train_s", "training stage time"),
    ("time/sync_s", "sync_s", "weight sync time"),
    ("time/step_s", "t_end_s - t_start_s", "the step window"),
    ("split/num_rollout", "num_rollout", "rollout devices"),
    ("split/num_train", "num_train", "training devices"),
    ("idle/fraction", "idle_device_s / (devices * step_s)", "idle share of the window's device-seconds"),
    ("idle/tail_fraction", "tail_idle_device_s / (devices * step_s)",
     "share spent by rollout devices waiting for the step's last response"),
)
RESIZE_SCALARS: tuple[tuple[str, str, str], ...] = (
    ("resize/critical_s", "critical_s", "decision to the moved device's first useful work"),
    ("resize/total_s", "total_s", "decision to the last background op done"),
)


def number(value: Any) -> float | None:
    """`value` as a float if it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def step_time_s(rec: dict) -> float | None:
    start, end = number(rec.get("t_start_s")), number(rec.get("t_end_s"))
    return None if start is None or end is None else end - start


def step_scalars(rec: dict) -> dict[str, float]:
    """The scalars of one `step` record (names in `STEP_SCALARS`); absent fields are skipped."""
    out: dict[str, float] = {}
    for name, source, _ in STEP_SCALARS:
        value = number(rec.get(source))
        if value is not None:
            out[name] = value
    for key, value in (rec.get("reward_metrics") or {}).items():  # a reward's own metrics, by its names
        if (value := number(value)) is not None:
            out[f"reward/{key}"] = value
    step_s = step_time_s(rec)
    if step_s is not None:
        out["time/step_s"] = step_s
    devices = (number(rec.get("num_rollout")) or 0.0) + (number(rec.get("num_train")) or 0.0)
    denom = devices * step_s if step_s is not None else 0.0
    if denom > 0:
        for name, source in (("idle/fraction", "idle_device_s"), ("idle/tail_fraction", "tail_idle_device_s")):
            value = number(rec.get(source))
            if value is not None:
                out[name] = value / denom
    return out


def resize_scalars(rec: dict) -> dict[str, float]:
    """The scalars of one `resize` record (names in `RESIZE_SCALARS`)."""
    return {name: v for name, source, _ in RESIZE_SCALARS if (v := number(rec.get(source))) is not None}


# Fields of an `eval` record that describe it rather than measure the policy (no scalar each).
EVAL_INFO_FIELDS: tuple[str, ...] = ("kind", "step", "version", "samples_per_prompt", "correct_threshold")


def eval_scalars(rec: dict) -> dict[str, float]:
    """Every numeric field of an `eval` record as `eval/<field>`, except its step, times (`*_s`),
    counts (`num_*`) and the other `EVAL_INFO_FIELDS`: the metrics (`reward_mean`, `pass_at_k`...)."""
    return {f"eval/{k}": v for k, val in rec.items()
            if k not in EVAL_INFO_FIELDS and not k.endswith("_s") and not k.startswith("num_")
            and (v := number(val)) is not None}


def split_text(split: dict) -> str:
    """`{"rollout": [..], "train": [..]}` -> "3R:1T"."""
    return f"{len(split.get('rollout', []))}R:{len(split.get('train', []))}T"


def resize_text(rec: dict) -> str:
    """One line describing a resize, for trackers' text panels and tags."""
    moving = ", ".join(str(d) for d in rec.get("moving", []))
    line = (f"resize {rec['resize_id']} after step {rec['step']}: {split_text(rec['from'])} -> "
            f"{split_text(rec['to'])}, device(s) {moving} to {rec['to_role']}; "
            f"critical {rec['critical_s']:.3f} s, total {rec['total_s']:.3f} s")
    return line + (f" ({rec['reason']})" if rec.get("reason") else "")


def event_text(rec: dict) -> str:
    """One line describing a `fault` or `recovery` record."""
    if rec["kind"] == "fault":
        return (f"fault at step {rec['step']}: device {rec['device']} {rec['fault_kind']} at {rec['point']}"
                + (f" ({rec['reason']})" if rec.get("reason") else ""))
    return (f"recovery at step {rec['step']}: lost {rec['lost_devices']}, {rec['num_devices']} devices left, "
            f"{rec['recovery_s']:.2f} s")
