"""An online model of each stage's time against its device count, fitted from step reports.

    rollout:  T_roll(R) = F + K / R**beta      F: the tail floor, K: scalable work
    training: T_train(n) = c + D / n           c: fixed (exposed communication), D: device-seconds
    step:     T(R)       = max(T_roll(R), T_train(N - R)) + sync

F is the part of the rollout stage that no number of devices removes: the step's longest
response decoded alone (`StepReport.rollout_floor_s`). Where a runtime does not report it,
F falls back to half the longest request's duration (a stated prior, not a measurement).
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

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

import numpy as np

from dynaresize.control.window import RollingWindow
from dynaresize.types import StepReport

FLOOR_PRIOR_FRAC = 0.5  # F = this * longest request when the runtime reports no floor


class OnlineStageModel:
    def __init__(self, window: int = 5, trend_window: int = 20) -> None:
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
        return expected_max(a, b, sd) + sync

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
            e = expected_max(a, b, sd)
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
        return expected_max(f + k / r ** self.beta, c + d / n, self.roll_obs.noise_sd()) + sync

    def train_s_next(self, num_train: int) -> float:
        """Training time of the next step on `num_train` devices: its known demand when there is
        one (`next_train_d`), else the model's."""
        d = self.next_train_d()
        if d is None:
            return self.train_s(num_train)
        return self.train_c.mean() + d / max(num_train, 1)

    def balanced_split(self, splits: tuple[int, ...], num_devices: int) -> int:
        """The legal split where the two stages take the most nearly equal time."""
        f, k, c, d, _ = self._params(0.0)
        r = np.asarray(splits, dtype=np.float64)
        gap = np.abs(f + k / np.maximum(r, 1.0) ** self.beta - c - d / np.maximum(num_devices - r, 1.0))
        return int(splits[int(np.argmin(gap))])


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


# ---------------------------------------------------------------- streaming pipeline (eta >= 2)


def expected_max_of(sorted_lengths: np.ndarray, sizes) -> np.ndarray:
    """E[max of m samples drawn without replacement] from `sorted_lengths` (ascending), for each
    m in `sizes`: sum over i >= m of L_(i) * C(i-1, m-1) / C(n, m) (1-indexed order statistics)."""
    L = np.asarray(sorted_lengths, dtype=np.float64)
    n = L.size
    sizes = np.asarray(sizes, dtype=np.int64)
    if n == 0:
        return np.zeros(sizes.shape)
    lf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))])
    i = np.arange(1, n + 1)
    out = np.empty(sizes.shape, dtype=np.float64)
    for k, m in enumerate(np.clip(sizes, 1, n)):
        ii = i[m - 1:]
        logw = (lf[ii - 1] - lf[m - 1] - lf[ii - m]) - (lf[n] - lf[m] - lf[n - m])
        out[k] = float(np.dot(L[m - 1:], np.exp(logw)))
    return out


REGIME_RECENT = 3  # reports that show a regime change, and the history kept after one
REGIME_SIGMAS = 4.0  # ... when their mean moved this many noise sds from the mean before them
REGIME_REL = 0.10  # ... and by this fraction at least
MIN_TREND_POINTS = 5  # reports (in one regime, at one split) before a trend is extrapolated


TREND_T = 2.0  # a trend is extrapolated only when |slope| > this many standard errors


def significant_slope(values) -> float:
    """Least-squares slope per step of `values`, or 0 when it is within TREND_T standard errors
    of 0 (or there are fewer than MIN_TREND_POINTS values): noise is not extrapolated."""
    y = np.asarray(values, dtype=np.float64)
    k = y.size
    if k < MIN_TREND_POINTS:
        return 0.0
    x = np.arange(k) - (k - 1) / 2.0
    sxx = float((x * x).sum())
    slope = float((x * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - slope * x
    se = float(np.sqrt((resid * resid).sum() / max(k - 2, 1) / sxx))
    return slope if abs(slope) > TREND_T * se else 0.0


def regime_changed(values) -> bool:
    """True when each of the last REGIME_RECENT values lies on the same side of the mean of the
    (up to 5) values before them, farther than REGIME_SIGMAS step-to-step noise sds and than
    REGIME_REL of that mean: a regime changed at once (a cap raised), not a drift or one outlier."""
    v = [float(x) for x in values]
    if len(v) < REGIME_RECENT + 3:
        return False
    head, last = v[:-REGIME_RECENT], v[-REGIME_RECENT:]
    diffs = np.diff(head)
    noise = float(np.sqrt(np.mean(diffs ** 2) / 2.0)) if diffs.size else 0.0
    ref = float(np.mean(head[-5:]))
    gap = max(REGIME_SIGMAS * noise, REGIME_REL * abs(ref))
    return all(x > ref + gap for x in last) or all(x < ref - gap for x in last)


class StreamStageModel:
    """A throughput model of the streaming pipeline (staleness eta >= 2), fitted from reports.

    A step's rollout is cut into shares of m = ceil(B / replicas) samples (replicas = R / the
    move unit, the rollout TP size); a replica runs one share at a time. The rollout pool's
    device-seconds per step at R rollout devices:

        D_roll(R) = W + shares(R) * (kappa * E[max of m(R) lengths] + pull)

    W: the step's non-serial work (KV reads, compute: it does not depend on R); pull: one weight
    pull per share; kappa * E[max ...]: a share's serial decode steps (its longest response),
    E[max] computed from the step's response lengths (order statistics), kappa calibrated on
    the measured serial time. A bigger pool cuts smaller shares, whose longest response is
    shorter: the tail is no floor, only a cost per share. Training: D_train device-seconds + a
    fixed c + the publish. The period (seconds per step) is throughput-bound:

        P(R) = max( D_roll(R) / R,  c + D_train / (N - R) + publish,  window(R) )

    i.e. rollout samples/s per device against training samples/s per device, and the window:
    eta + 1 periods must hold a step's rollout latency (the pool's time per step plus the
    measured excess X of its longest share) and the training left after its last sample
    (`train_tail_s`: all of it without accumulation, the last share's and the fixed part with
    it), `window(R) = (latency(R) + c + D_tail / (N - R) + publish) / (eta + 1)`. shares(R)
    is counted fluidly, B / (B / replicas).

    Each report gives one D_roll curve over all splits; the model keeps the last `window`
    curves (level) and `trend_window` (least-squares trend per split, fitted on the curves
    measured at the current split and extrapolated `ahead` steps past the level's own lag);
    training likewise. A trend is used only when significant (`significant_slope`) and never
    extrapolated farther than half the steps it was fitted on; a regime change
    (`regime_changed`: a cap raised at once) drops the history before it, so the trend does not
    extrapolate the jump.
    """

    def __init__(self, move_unit: int = 1, window: int = 5, trend_window: int = 20, staleness: int = 2) -> None:
        self.unit = max(int(move_unit), 1)
        self.window = window
        self.trend_window = trend_window
        self._curves: list[np.ndarray] = []  # D_roll per split, one per report
        self._measured_at: list[int] = []  # the split each curve was measured at
        self.train_c = RollingWindow(window)
        self.train_d = RollingWindow(window)
        self.train_d_trend = RollingWindow(trend_window)
        self.publish = RollingWindow(window)
        self.train_tail_d = RollingWindow(window)  # device-seconds trained after the step's last sample
        self.excess = RollingWindow(window)  # X: latency beyond the pool's time per step
        self.share_work = RollingWindow(window)  # non-serial seconds per sample on one replica
        self.eta = max(int(staleness), 1)
        self.num_reports = 0
        self._splits: np.ndarray | None = None

    def update(self, report: StepReport, splits) -> None:
        # Steps 0..eta start together from version 0: the pipeline's warm-up. Their reports
        # feed the fit but do not count as learned (a policy waits for steady-state reports).
        if report.step > self.eta:
            self.num_reports += 1
        self._batch = max(report.num_samples, len(report.response_lengths), 1)
        self._slots = report.rollout_slots if report.rollout_slots > 0 else self._batch
        splits = np.asarray(splits, dtype=np.int64)
        if self._splits is None or self._splits.shape != splits.shape or np.any(self._splits != splits):
            self._splits, self._curves, self._measured_at = splits, [], []
        n = max(report.num_train, 1)
        c = min(max(report.train_fixed_s, 0.0), report.train_s)
        d = max(report.train_s - c, 0.0) * n
        self.train_c.push(c)
        self.train_d.push(d)
        self.train_d_trend.push(d)
        self.publish.push(max(report.sync_s, 0.0))
        tail = report.train_tail_s if report.train_tail_s > 0 else report.train_s
        self.train_tail_d.push(max(min(tail, report.train_s) - c, 0.0) * n)
        curve = self._roll_curve(report, splits)
        self._curves.append(curve)
        self._measured_at.append(int(report.num_rollout))
        if report.step > self.eta:  # steps 0..eta are released together at the start: no latency sample
            self._update_excess(report, splits, curve)
        self._curves = self._curves[-self.trend_window:]
        self._measured_at = self._measured_at[-self.trend_window:]
        here = int(np.argmin(np.abs(splits - report.num_rollout)))
        if regime_changed([c[here] for c in self._same_split_curves()]):
            self._curves, self._measured_at = self._curves[-REGIME_RECENT:], self._measured_at[-REGIME_RECENT:]
        if regime_changed(list(self.train_d_trend.values)):
            keep = list(self.train_d_trend.values)[-REGIME_RECENT:]
            for w in (self.train_d, self.train_d_trend):
                w.clear()
                for v in keep:
                    w.push(v)

    def _same_split_curves(self) -> list[np.ndarray]:
        out = []
        for c, r in zip(reversed(self._curves), reversed(self._measured_at)):
            if r != self._measured_at[-1]:
                break
            out.append(c)
        return out[::-1]

    def _update_excess(self, report: StepReport, splits: np.ndarray, curve: np.ndarray) -> None:
        """X = the step's rollout latency beyond the pool's time per step, at most the longest
        share's time (the share with the step's longest response, started last)."""
        B = max(report.num_samples, len(report.response_lengths), 1)
        chunks = max(report.rollout_chunks, 1)
        w = max(report.rollout_work_s - report.rollout_serial_s, 0.0) / self.unit / B
        m = -(-B // chunks)
        longest_share = report.rollout_floor_s + m * w + report.rollout_sync_s / chunks / self.unit
        here = int(np.argmin(np.abs(splits - report.num_rollout)))
        t_roll = curve[here] / max(report.num_rollout, 1)
        x = min(max(report.rollout_s - t_roll, 0.0), longest_share)
        self.excess.push(x - m * w)  # stored without its share's work: added back per split
        self.share_work.push(w)

    def _roll_curve(self, report: StepReport, splits: np.ndarray) -> np.ndarray:
        """D_roll at every split, from one report."""
        B = max(report.num_samples, len(report.response_lengths), 1)
        chunks = max(report.rollout_chunks, 1)
        slots = report.rollout_slots if report.rollout_slots > 0 else B
        serial = max(report.rollout_serial_s, 0.0)
        work_ns = max(report.rollout_work_s - serial, 0.0)
        pull = max(report.rollout_sync_s, 0.0) / chunks
        reps = np.maximum(splits // self.unit, 1)
        share = np.minimum(slots, -(-B // reps))
        # Shares per step as a fluid count, B / (B / replicas) = replicas (B / slots where the
        # admission limit caps a share): rounding B / share up would make a split whose last
        # replica gets no share look a share cheaper, an artefact the engine does not show.
        shares = np.maximum(reps, B / slots)
        if report.response_lengths:
            lengths = np.sort(np.asarray(report.response_lengths, dtype=np.float64))
            m_now = min(slots, -(-B // chunks))
            sizes = np.unique(np.concatenate([share, [m_now]]))
            emax = dict(zip(sizes.tolist(), expected_max_of(lengths, sizes).tolist()))
            kappa = serial / (chunks * emax[m_now]) if emax[m_now] > 0 else 0.0
            per_share = kappa * np.array([emax[int(m)] for m in share])
        else:  # no lengths reported: a share's serial part is taken as the measured one
            per_share = np.full(splits.shape, serial / chunks)
        return work_ns + shares * (per_share + pull)

    def _level_trend(self, ahead: float) -> np.ndarray:
        """Level (mean of the last `window` curves) plus the trend fitted on the curves measured at
        the current split only: curves extrapolated from another split differ by their
        calibration, which a trend across a move would mistake for drift."""
        ys = np.array(self._curves)
        recent = ys[-self.window:].mean(axis=0)
        same = 0
        for r in reversed(self._measured_at):
            if r != self._measured_at[-1]:
                break
            same += 1
        ys = ys[-same:]
        k = ys.shape[0]
        if k < MIN_TREND_POINTS:
            return recent
        here = int(np.argmin(np.abs(self._splits - self._measured_at[-1])))
        if significant_slope(ys[:, here]) == 0.0:  # the measured split's own series decides
            return recent
        x = np.arange(k) - (k - 1) / 2.0
        slope = (x[:, None] * (ys - ys.mean(axis=0))).sum(axis=0) / (x * x).sum()
        lag = (min(self.window, k) - 1) / 2.0  # the recent mean sits this many steps back
        return np.maximum(recent + slope * min(ahead + lag, k / 2.0), 0.0)  # no farther than half the data

    def _d_train(self, ahead: float) -> float:
        """Training device-seconds per step: the window's level, plus its significant trend."""
        lag = (min(self.window, len(self.train_d)) - 1) / 2.0
        slope = significant_slope(list(self.train_d_trend.values))
        return max(self.train_d.mean() + slope * min(ahead + lag, len(self.train_d_trend) / 2.0), 0.0)

    def _parts(self, splits: np.ndarray, num_devices: int, d_roll: np.ndarray, c: float, d_train: float,
               publish: float, tail_d: float) -> dict[str, np.ndarray]:
        r = np.maximum(splits.astype(np.float64), 1.0)
        n = np.maximum(num_devices - r, 1.0)
        t_roll = d_roll / r
        t_train = c + d_train / n + publish
        share = np.minimum(self._slots, -(-self._batch // np.maximum(splits // self.unit, 1)))
        latency = t_roll + self.excess.mean() + share * self.share_work.mean()
        # What the window must hold after the step's last sample: all of training where a step
        # trains once its samples are in, only its last groups and the optimizer step where the
        # trainers accumulate as groups arrive (both measured: `train_tail_s`).
        tail = c + tail_d / n + publish
        return {"rollout": t_roll, "train": t_train, "window": (latency + tail) / (self.eta + 1)}

    def parts(self, splits, num_devices: int, ahead: float = 0.0) -> dict[str, np.ndarray]:
        """Rollout, training and window seconds per step at each split."""
        splits = np.asarray(splits, dtype=np.int64)
        if self._splits is None or not self._curves or splits.shape != self._splits.shape:
            raise ValueError("no reports for these splits yet")
        return self._parts(splits, num_devices, self._level_trend(ahead), self.train_c.mean(), self._d_train(ahead),
                           self.publish.mean(), self.train_tail_d.mean())

    def gain_samples(self, num_rollout: int, target: int, num_devices: int, ahead: float = 0.0) -> np.ndarray:
        """Predicted period gain of `target` over `num_rollout`, once per report of the window:
        each from that report's own rollout curve, training, publish and training tail, shifted
        by the trend as the level is. Their spread says how far the reports agree on the gain."""
        n = min(self.window, len(self._curves), len(self.train_d))
        if self._splits is None or n == 0:
            return np.zeros(0)
        pick = np.array([int(np.argmin(np.abs(self._splits - x))) for x in (num_rollout, target)])
        splits = self._splits[pick]
        curves = np.array(self._curves[-n:])[:, pick]
        curves = curves + (self._level_trend(ahead)[pick] - curves.mean(axis=0))
        ds = np.array(list(self.train_d.values)[-n:])
        ds = ds + (self._d_train(ahead) - ds.mean())
        rows = zip(curves, list(self.train_c.values)[-n:], ds, list(self.publish.values)[-n:],
                   list(self.train_tail_d.values)[-n:])
        out = []
        for curve, c, d, pub, tail in rows:
            p = self._parts(splits, num_devices, np.maximum(curve, 0.0), c, max(d, 0.0), pub, tail)
            period = np.maximum(np.maximum(p["rollout"], p["train"]), p["window"])
            out.append(float(period[0] - period[1]))
        return np.asarray(out)

    def step_curve(self, splits, num_devices: int, ahead: float = 0.0) -> np.ndarray:
        """Predicted seconds per step (the period) at each split."""
        p = self.parts(splits, num_devices, ahead)
        return np.maximum(np.maximum(p["rollout"], p["train"]), p["window"])

    def step_s(self, num_rollout: int, num_devices: int, ahead: float = 0.0) -> float:
        splits = self._splits
        i = int(np.argmin(np.abs(splits - num_rollout)))
        return float(self.step_curve(splits, num_devices, ahead)[i])
