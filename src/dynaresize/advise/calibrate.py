"""Fit the simulator's stage models to a job's logged stage times.

The stage models are the simulator's own (`costmodel.stages.StageModel`): a rollout replica's
time is `decode steps x t_weights + its samples' KV reads x t_kv` (memory-bound, both scale with
`decode_eff`) plus `its tokens x t_flop + prompt tokens x t_prefill` (compute, scale with
1 / `mfu_decode`, `mfu_prefill`); the stage ends with the slowest replica. Training is
`device-seconds / n + train_comm_s` (device-seconds scale with 1 / `mfu_train`). So a fit is a
preset with four numbers changed:

- rollout: T_k = max over replicas r of (a * mem_r(k) + b * comp_r(k)), mem and comp computed
  with the preset at the logged split on the step's rebuilt batch. For each ratio a / b on a
  log grid the overall scale keeps the logged total (throughput is a total); the ratio with the
  least mean relative error wins. The ratio is *identified* only when it lowers the error by more than
  `IDENTIFY_GAIN` over the preset's own ratio (1): steps whose longest and mean lengths move
  together cannot tell weight reads from compute, and then the preset's ratio is kept.
- training: T_k = s * D_k / n + f by least squares (which keeps the logged total), D_k the preset's
  device-seconds of step k. The fixed part f and the per-device share s are told apart only
  when D_k varies across the logged steps (relative spread >= `MIN_SPREAD`); otherwise f is the
  preset's `train_comm_s` and s alone is fitted.
- per step outside the stages (weight sync, driver, logging): the logged step time minus the
  stages (one-step-off: the slower stage; colocated: their sum), its mean, paid on every split.

What one split cannot tell: how rollout time changes with the device count. That comes from
the model's structure (round-robin routing over R / tp replicas; the slowest replica, at least
the longest response decoded alone, bounds the stage), not from the data.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dynaresize.costmodel.costs import Hardware, ModelPreset
from dynaresize.costmodel.stages import Batch, StageModel

RATIOS = np.exp(np.linspace(math.log(1 / 30), math.log(30), 61))
IDENTIFY_GAIN = 0.01  # mean relative error points the fitted ratio must save over the preset's
MIN_SPREAD = 0.05  # relative spread of training demand across steps needed to tell fixed from per-device


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The fitted preset and how well it reproduces the logged steps."""

    model: ModelPreset  # the preset with the fitted numbers (use it for every split)
    rollout_scale_mem: float  # a: multiplies decode_eff
    rollout_scale_compute: float  # b: divides mfu_decode and mfu_prefill
    ratio_identified: bool
    train_scale: float  # s: divides mfu_train
    train_fixed_s: float  # f: train_comm_s
    fixed_identified: bool
    other_s: float  # per step outside the stages
    rollout_fit_s: tuple[float, ...]  # fitted stage times on the logged steps
    train_fit_s: tuple[float, ...]
    rollout_error: float  # mean relative error on the logged steps
    train_error: float
    floor_fraction: float  # mean share of the fitted rollout time that is the longest response alone

    def to_json(self) -> dict:
        return {"rollout_error": self.rollout_error, "train_error": self.train_error,
                "rollout_scale_mem": self.rollout_scale_mem, "rollout_scale_compute": self.rollout_scale_compute,
                "ratio_identified": self.ratio_identified, "train_scale": self.train_scale,
                "train_fixed_s": self.train_fixed_s, "fixed_identified": self.fixed_identified,
                "other_s": self.other_s, "floor_fraction": self.floor_fraction,
                "decode_eff": self.model.decode_eff, "mfu_decode": self.model.mfu_decode,
                "mfu_train": self.model.mfu_train}


def _replica_parts(base: ModelPreset, hw: Hardware, batches: list[Batch], num_rollout: int):
    """Per step, the replicas' memory-bound and compute seconds under `base` (two arrays)."""
    mem_only = replace(base, mfu_decode=1e30, mfu_prefill=1e30)
    comp_only = replace(base, decode_eff=1e-30)
    sm = StageModel(mem_only, lambda b: batches[b], hw, batch_cache=2)
    sc = StageModel(comp_only, lambda b: batches[b], hw, batch_cache=2)
    return ([sm.replica_times(k, num_rollout)[0] for k in range(len(batches))],
            [sc.replica_times(k, num_rollout)[0] for k in range(len(batches))])


def _rel_err(fit: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(fit - y) / y))


def fit_rollout(base: ModelPreset, hw: Hardware, batches: list[Batch], logged_s: np.ndarray,
                num_rollout: int) -> tuple[float, float, bool, np.ndarray]:
    """(a, b, ratio identified, fitted times) of the rollout model (module doc)."""
    mem, comp = _replica_parts(base, hw, batches, num_rollout)
    y = np.asarray(logged_s, dtype=np.float64)

    def at(ratio: float) -> tuple[float, float, np.ndarray]:
        x = np.array([float((ratio * m + c).max()) for m, c in zip(mem, comp)])
        s = float(y.sum() / x.sum()) if x.sum() > 0 else 1.0  # the logged total kept: throughput is a total
        fit = s * x
        return _rel_err(fit, y), s, fit

    results = [(at(float(r)), float(r)) for r in RATIOS]
    (err_best, s_best, fit_best), r_best = min(results, key=lambda t: t[0][0])
    err_one, s_one, fit_one = at(1.0)
    if err_one - err_best > IDENTIFY_GAIN:
        return s_best * r_best, s_best, True, fit_best
    return s_one, s_one, False, fit_one


def fit_train(base: ModelPreset, hw: Hardware, batches: list[Batch], logged_s: np.ndarray,
              num_train: int) -> tuple[float, float, bool, np.ndarray]:
    """(s, f, fixed identified, fitted times) of the training model (module doc)."""
    sm = StageModel(base, lambda b: batches[b], hw, batch_cache=2)
    x = np.array([sm.train_device_s(k) / max(num_train, 1) for k in range(len(batches))])
    y = np.asarray(logged_s, dtype=np.float64)
    spread = float(np.std(x) / np.mean(x)) if np.mean(x) > 0 else 0.0
    if spread >= MIN_SPREAD:  # least squares with an intercept keeps the logged total
        A = np.stack([x, np.ones_like(x)], axis=1)
        (s, f), *_ = np.linalg.lstsq(A, y, rcond=None)
        if s > 0 and f >= 0:
            return float(s), float(f), True, s * x + f
    f = min(base.train_comm_s, 0.5 * float(y.min()))
    s = float((y - f).sum() / x.sum())
    return s, f, False, s * x + f


def calibrate(base: ModelPreset, hw: Hardware, *, rollout_batches: list[Batch], rollout_s, train_batches: list[Batch],
              train_s, other_s: float, num_rollout: int, num_train: int) -> Calibration:
    """The fitted preset from the logged stage times: `rollout_s[i]` of `rollout_batches[i]`,
    `train_s[i]` of `train_batches[i]` (each stage fits the steps that logged it)."""
    batches = rollout_batches
    a, b, ratio_ok, roll_fit = fit_rollout(base, hw, batches, np.asarray(rollout_s), num_rollout)
    s, f, fixed_ok, train_fit = fit_train(base, hw, train_batches, np.asarray(train_s), num_train)
    model = replace(base, name=f"{base.name}-calibrated", decode_eff=base.decode_eff * a,
                    mfu_decode=base.mfu_decode / b, mfu_prefill=base.mfu_prefill / b, mfu_train=base.mfu_train / s,
                    train_comm_s=f, sync_alpha_s=max(other_s, 0.0), sync_bw=math.inf)
    fitted = StageModel(model, lambda k: batches[k], hw, batch_cache=2)
    floors = [fitted.rollout(k, num_rollout) for k in range(len(batches))]
    floor_fraction = float(np.mean([min(r.floor_s / r.time_s, 1.0) if r.time_s > 0 else 0.0 for r in floors]))
    return Calibration(model=model, rollout_scale_mem=a, rollout_scale_compute=b, ratio_identified=ratio_ok,
                       train_scale=s, train_fixed_s=f, fixed_identified=fixed_ok, other_s=max(other_s, 0.0),
                       rollout_fit_s=tuple(map(float, roll_fit)), train_fit_s=tuple(map(float, train_fit)),
                       rollout_error=_rel_err(roll_fit, np.asarray(rollout_s, dtype=np.float64)),
                       train_error=_rel_err(train_fit, np.asarray(train_s, dtype=np.float64)),
                       floor_fraction=floor_fraction)
