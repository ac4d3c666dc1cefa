"""From logged steps to a calibrated job: the usable steps, their batches (rebuilt lengths or
given ones), the fitted stage models, and the notes a user should read about what was assumed.

A step is simulated when it has a mean response length (and exact lengths where they are given);
each stage's fit reads those of them that logged that stage's time (a dynaresize run's first
batch rolls out before its first step record: its rollout is simulated, not fitted). The
per-step rest (`Calibration.other_s`) is the logged step time minus the stages (one-step-off:
the slower one; colocated: both; or the source's own `rest_s`), else the logged weight sync,
else 0 (said in a note).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynaresize.advise.calibrate import Calibration, calibrate
from dynaresize.advise.lengths import rebuild_lengths
from dynaresize.advise.logs import LoggedRun, StepMetrics
from dynaresize.costmodel.costs import Hardware, ModelPreset
from dynaresize.costmodel.stages import Batch, StageModel
from dynaresize.errors import UserError
from dynaresize.workload.trace import DEFAULT_PROMPT_TOKENS

MAX_OVER_MEAN_DEFAULT = 4.0  # without a logged max: a long tail of 4x the mean (notes say so)


@dataclass(frozen=True, kw_only=True)
class Prepared:
    steps: tuple[StepMetrics, ...]  # the steps simulated (a mean length, and exact lengths where given)
    rollout_steps: tuple[StepMetrics, ...]  # of them, those with a rollout time (the rollout fit's)
    train_steps: tuple[StepMetrics, ...]  # ... with a training time (the training fit's)
    batches: tuple[Batch, ...]
    calibration: Calibration
    notes: tuple[str, ...]
    logged_samples_per_s: float | None
    colocated_step_s: tuple[float, ...] | None  # fitted stages + rest per step, for a colocated log
    drift: dict  # mean response length at the start and the end of the run, and its max


def prepare(run: LoggedRun, *, num_devices: int, rollout_devices: int, samples_per_step: int, base: ModelPreset,
            hw: Hardware, lengths: dict | list | None = None) -> Prepared:
    """The calibrated job of `run` (module doc). `lengths`: exact response lengths replacing
    the rebuilt ones: `{step: lengths}` (a dynaresize run's samples; steps without any are left
    out) or a list, one per usable step in order (a length trace)."""
    notes: list[str] = []
    steps = tuple(s for s in run.steps if s.len_mean)
    if isinstance(lengths, dict):
        have = [s for s in steps if s.step in lengths]
        if len(have) < len(steps):
            notes.append(f"{len(steps) - len(have)} steps without sample lengths: left out")
        steps, lengths = tuple(have), [lengths[s.step] for s in have]
    fit = [i for i, s in enumerate(steps) if s.rollout_s]  # each stage is fitted on the steps that logged it
    fit_train = [i for i, s in enumerate(steps) if s.train_s]
    if min(len(fit), len(fit_train)) < 2:
        raise UserError(f"{run.source}: {len(fit)} steps with a rollout time and {len(fit_train)} with a training "
                        "time, each with a mean response length (need at least 2 of each)")
    if len(steps) < len(run.steps):
        notes.append(f"{len(run.steps) - len(steps)} of {len(run.steps)} steps lack a mean length: left out")
    for stage, have in (("rollout", fit), ("training", fit_train)):
        if len(have) < len(steps):
            notes.append(f"{len(steps) - len(have)} of {len(steps)} steps lack a {stage} time: simulated, their "
                         f"{stage} not fitted")
    colocated = rollout_devices >= num_devices
    if lengths is None:
        if "len_max" not in run.found:
            notes.append(f"no response_length/max: the tail is unknown; rebuilt with max = "
                         f"{MAX_OVER_MEAN_DEFAULT:g} x mean (a length trace gives the real one)")
        if "prompt_mean" not in run.found:
            notes.append(f"no prompt_length/mean: prompts taken as {DEFAULT_PROMPT_TOKENS} tokens")
        lengths = [rebuild_lengths(mean=s.len_mean, longest=s.len_max or MAX_OVER_MEAN_DEFAULT * s.len_mean,
                                   clip_ratio=s.clip_ratio or 0.0, num_samples=samples_per_step, seed=s.step)
                   for s in steps]
    elif len(lengths) != len(steps):
        raise UserError(f"{run.source}: {len(lengths)} steps of lengths for {len(steps)} logged steps")
    batches = tuple(Batch(np.asarray(L, dtype=np.int64),
                          np.full(len(L), int(round(s.prompt_mean or DEFAULT_PROMPT_TOKENS)), dtype=np.int64))
                    for s, L in zip(steps, lengths))
    roll = np.array([steps[i].rollout_s for i in fit])
    train = np.array([steps[i].train_s for i in fit_train])
    timed = [s for s in steps if s.step_s]
    if timed:
        rest = [s.rest_s if s.rest_s is not None else s.step_s - (
            (s.rollout_s or 0.0) + (s.train_s or 0.0) if colocated else max(s.rollout_s or 0.0, s.train_s or 0.0))
            for s in timed]
        other = float(np.mean(np.maximum(rest, 0.0)))
    elif all(s.sync_s is not None for s in steps):
        other = float(np.mean([s.sync_s for s in steps]))
        notes.append("no step time: the per-step rest is the logged weight sync only")
    else:
        other = 0.0
        notes.append("no step time and no weight sync time: nothing counted outside the stages")
    n_train = num_devices if colocated else num_devices - rollout_devices
    cal = calibrate(base, hw, rollout_batches=[batches[i] for i in fit], rollout_s=roll,
                    train_batches=[batches[i] for i in fit_train], train_s=train, other_s=other,
                    num_rollout=num_devices if colocated else rollout_devices, num_train=n_train)
    if not cal.ratio_identified:
        notes.append("rollout: these steps cannot tell weight-read time from compute time (longest and mean "
                     "lengths move together); the preset's ratio kept, one scale fitted")
    if not cal.fixed_identified:
        notes.append(f"training: the demand barely varies across steps, so the fixed per-step part cannot be told "
                     f"from the per-device share; fixed part taken as {cal.train_fixed_s:.2f} s")
    logged = None
    if len(timed) == len(steps):
        logged = samples_per_step * len(steps) / float(sum(s.step_s for s in steps))
    colocated_step = None
    if colocated:  # every step as it ran, on the fitted stage models
        sm = StageModel(cal.model, lambda k: batches[k], hw, batch_cache=2)
        colocated_step = tuple(sm.rollout(k, num_devices).time_s + sm.train(k, num_devices).time_s + cal.other_s
                               for k in range(len(batches)))
    means = [float(np.mean(b.response_tokens)) for b in batches]
    q = max(1, len(means) // 10)
    drift = {"mean_first": float(np.mean(means[:q])), "mean_last": float(np.mean(means[-q:])),
             "max_first": float(np.mean([b.response_tokens.max() for b in batches[:q]])),
             "max_last": float(np.mean([b.response_tokens.max() for b in batches[-q:]]))}
    return Prepared(steps=steps, rollout_steps=tuple(steps[i] for i in fit),
                    train_steps=tuple(steps[i] for i in fit_train), batches=batches, calibration=cal,
                    notes=tuple(notes), logged_samples_per_s=logged, colocated_step_s=colocated_step, drift=drift)
