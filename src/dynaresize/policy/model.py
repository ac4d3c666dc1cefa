"""An online model of each stage's time against its device count, fitted from step reports.

    rollout:  T_roll(R) = F + K / R**beta      F: the tail floor, K: scalable work
    training: T_train(n) = c + D / n           c: fixed (exposed communication), D: device-seconds
    step:     T(R)       = max(T_roll(R), T_train(N - R)) + sync
              (serial pipeline, staleness 0: T_roll(R) + T_train(N - R) + sync)

F is the part of the rollout stage that no number of devices removes (`StepReport.rollout_floor_s`):
the step's longest response decoded alone in the simulator and emulated runs; on the unpaced
runtime the longest engine call, an upper bound (docs/policies.md). Where a report has 0, F
falls back to half the longest request's duration (a stated prior, not a measurement).
The scalable part K = (T_roll - F) * R**beta: the time other requests add to the slowest
replica's decode steps, which shrinks as they spread over more replicas.

Fitted online: F, K, c, D and sync are window means of the last `window` reports (the window
rides the drift); beta starts at 1 and is refitted from the rollout time observed on both sides
of every move (least squares on log scale, clipped to [0.3, 1.5]). The model only extrapolates
to other device counts; everything it knows comes from the reports.

The next step's training is known better than the window mean: in the one-step-off pipeline
the next step trains the batch this step rolled out, whose sequence tokens the report carries
(`StepReport.next_train_tokens`). The model learns the device-seconds per token, rho, as a window
mean of D / `train_tokens`, and predicts the next step with D_next = rho x next_train_tokens and
no training noise (`step_curve_next`): only the rollout of the batch after it is still unknown.

The streaming pipeline's model (staleness >= 2) is `StreamStageModel` in `policy/stream_model.py`.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

import numpy as np

from dynaresize.control.window import RollingWindow
from dynaresize.types import StepReport

FLOOR_PRIOR_FRAC = 0.5  # F = this * longest request when the runtime reports no floor


class OnlineStageModel:
    def __init__(self, window: int = 5, trend_window: int = 20, serial: bool = False) -> None:
        self.serial = serial  # staleness 0: the stages run one after the other, so their times add
        self.floor = RollingWindow(window)
        self.roll_scalable = RollingWindow(trend_window)  # T_roll - F, per report
        self.roll_r = RollingWindow(trend_window)  # rollout devices, per report
        self.window = window
        self.train_c = RollingWindow(window)
        self.train_d = RollingWindow(window)
        self.train_d_trend = RollingWindow(trend_window)
        self.sync = RollingWindow(window)
        self.roll_obs = RollingWindow(trend_window)  # observed stage times, for their noise
        self.train_obs = RollingWindow(trend_window)
        self._train_obs_n = 1
        self.train_rho = RollingWindow(window)  # training device-seconds per sequence token
        self.next_tokens = 0  # sequence tokens of the batch the next step trains (0: unknown)
        self.beta = 1.0
        self._beta_obs: list[float] = []
        self._last: StepReport | None = None
        self.num_reports = 0

    # ------------------------------------------------------------------ fitting

    @staticmethod
    def floor_of(report: StepReport) -> float:
        f = getattr(report, "rollout_floor_s", 0.0) or 0.0
        if f <= 0:
            f = FLOOR_PRIOR_FRAC * min(report.rollout_s, report.rollout_longest_s or report.rollout_s)
        return min(f, report.rollout_s)

    def update(self, report: StepReport) -> None:
        self.num_reports += 1
        f = self.floor_of(report)
        r = max(report.num_rollout, 1)
        prev = self._last
        if prev is not None and prev.num_rollout != report.num_rollout and prev.num_rollout > 0:
            # A move happened: the scalable parts before and after give one beta observation.
            s0 = max(prev.rollout_s - self.floor_of(prev), 1e-9)
            s1 = max(report.rollout_s - f, 1e-9)
            ratio = math.log(prev.num_rollout / r)
            if abs(ratio) > 1e-9:
                self._beta_obs.append(min(1.5, max(0.3, math.log(s1 / s0) / ratio)))
                self._beta_obs = self._beta_obs[-8:]
                self.beta = sum(self._beta_obs) / len(self._beta_obs)
        n = max(report.num_train, 1)
        c = min(max(report.train_fixed_s, 0.0), report.train_s)
        d = max(report.train_s - c, 0.0) * n
        self.floor.push(f)
        self.roll_scalable.push(max(report.rollout_s - f, 0.0))
        self.roll_r.push(r)
        self.train_c.push(c)
        self.train_d.push(d)
        self.train_d_trend.push(d)
        if report.train_tokens > 0:
            self.train_rho.push(d / report.train_tokens)
        self.next_tokens = max(int(report.next_train_tokens), 0)
        self.sync.push(max(report.sync_s, 0.0))
        if prev is not None and prev.num_rollout != report.num_rollout:
            self.roll_obs.clear()  # noise is measured at one split
            self.train_obs.clear()
        self.roll_obs.push(report.rollout_s)
        self.train_obs.push(report.train_s)
        self._train_obs_n = n
        self._last = report

    # --------------------------------------------------------------- prediction

    @property
    def ready(self) -> bool:
        return self.num_reports > 0

    def _k_values(self) -> RollingWindow:
        """K = (T_roll - F) * R**beta per report, with the current beta."""
        w = RollingWindow(max(len(self.roll_r), 1))
        for s, r in zip(self.roll_scalable.values, self.roll_r.values):
            w.push(s * r ** self.beta)
        return w

    def _params(self, ahead: float) -> tuple[float, float, float, float, float]:
        ks = self._k_values()
        recent = list(ks.values)[-self.window:]
        k_level = sum(recent) / len(recent) if recent else 0.0
        k = max(k_level + ks.slope() * ahead, 0.0)
        d = max(self.train_d.mean() + self.train_d_trend.slope() * ahead, 0.0)
        return self.floor.mean(), k, self.train_c.mean(), d, self.sync.mean()

    def next_train_d(self) -> float | None:
        """Training device-seconds of the batch the next step trains: its known sequence tokens x
        the measured device-seconds per token. None when either is unknown."""
        if self.next_tokens <= 0 or len(self.train_rho) == 0:
            return None
        return self.train_rho.mean() * self.next_tokens

    def rollout_s(self, num_rollout: int, ahead: float = 0.0) -> float:
        f, k, _, _, _ = self._params(ahead)
        return f + k / max(num_rollout, 1) ** self.beta

    def train_s(self, num_train: int, ahead: float = 0.0) -> float:
        _, _, c, d, _ = self._params(ahead)
        return c + d / max(num_train, 1)

    def step_curve(self, splits, num_devices: int, ahead: float = 0.0) -> np.ndarray:
        """Expected step time at each split: E[max(rollout, training)] + sync, each stage with
        its measured step-to-step noise (Clark's formula for the max of two normals), so a split
        where the two stages just meet is predicted slower than one with slack, as it is."""
        f, k, c, d, sync = self._params(ahead)
        r = np.maximum(np.asarray(splits, dtype=np.float64), 1.0)
        n = np.maximum(num_devices - r, 1.0)
        a = f + k / r ** self.beta
        b = c + d / n
        sd = np.hypot(self.roll_obs.noise_sd(), self.train_obs.noise_sd() * self._train_obs_n / n)
        return self._combine(a, b, sd) + sync

    def _combine(self, a, b, sd):
        """The two stages' share of the step: their sum (serial) or E[max] (overlapped)."""
        return np.asarray(a, dtype=np.float64) + b if self.serial else expected_max(a, b, sd)

    def step_s(self, num_rollout: int, num_devices: int, ahead: float = 0.0) -> float:
        return float(self.step_curve([num_rollout], num_devices, ahead)[0])

    def gain_samples(self, num_rollout: int, target: int, num_devices: int, ahead: float = 0.0) -> np.ndarray:
        """Predicted step-time gain of `target` over `num_rollout`, once per report of the window:
        each from that report's own F, K, c and D (the trend, beta and noise shared). Their
        spread says how far the reports agree on the gain (sync cancels in a gain)."""
        _, k, _, d, _ = self._params(ahead)
        n = min(self.window, len(self.train_d))
        if n == 0:
            return np.zeros(0)
        ks = list(self._k_values().values)[-n:]
        fs = list(self.floor.values)[-n:]
        cs = list(self.train_c.values)[-n:]
        ds = list(self.train_d.values)[-n:]
        k_off = k - sum(ks) / len(ks)
        d_off = d - self.train_d.mean()
        r = np.array([max(num_rollout, 1), max(target, 1)], dtype=np.float64)
        nt = np.maximum(num_devices - r, 1.0)
        sd = np.hypot(self.roll_obs.noise_sd(), self.train_obs.noise_sd() * self._train_obs_n / nt)
        out = []
        for fi, ki, ci, di in zip(fs, ks, cs, ds):
            a = fi + max(ki + k_off, 0.0) / r ** self.beta
            b = ci + max(di + d_off, 0.0) / nt
            e = self._combine(a, b, sd)
            out.append(float(e[0] - e[1]))
        return np.asarray(out)

    def step_curve_next(self, splits, num_devices: int) -> np.ndarray | None:
        """Expected time of the next step at each split when its training demand is known
        (`next_train_d`): training is then exact (no noise term), the rollout is the window's.
        None when the demand is unknown."""
        d = self.next_train_d()
        if d is None:
            return None
        f, k, c, _, sync = self._params(0.0)
        r = np.maximum(np.asarray(splits, dtype=np.float64), 1.0)
        n = np.maximum(num_devices - r, 1.0)
        return self._combine(f + k / r ** self.beta, c + d / n, self.roll_obs.noise_sd()) + sync

    def train_s_next(self, num_train: int) -> float:
        """Training time of the next step on `num_train` devices: its known demand when there is
        one (`next_train_d`), else the model's."""
        d = self.next_train_d()
        if d is None:
            return self.train_s(num_train)
        return self.train_c.mean() + d / max(num_train, 1)

    def balanced_split(self, splits: tuple[int, ...], num_devices: int) -> int:
        """The legal split where the two stages take the most nearly equal time (serial: where
        their sum is least)."""
        f, k, c, d, _ = self._params(0.0)
        r = np.asarray(splits, dtype=np.float64)
        roll, train = f + k / np.maximum(r, 1.0) ** self.beta, c + d / np.maximum(num_devices - r, 1.0)
        return int(splits[int(np.argmin(roll + train if self.serial else np.abs(roll - train)))])


_erf = np.vectorize(math.erf, otypes=[np.float64])


def expected_max(a, b, sd):
    """E[max(X, Y)] for normal X, Y with means a, b and sd of X - Y = `sd` (Clark 1961);
    elementwise on arrays; max(a, b) where sd is 0."""
    a, b, sd = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                                   np.asarray(sd, dtype=np.float64))
    safe = np.where(sd > 1e-12, sd, 1.0)
    z = (a - b) / safe
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    clark = a * cdf + b * (1.0 - cdf) + sd * pdf
    return np.where(sd > 1e-12, clark, np.maximum(a, b))
