"""The streaming pipeline's throughput model (staleness eta >= 2), fitted from step reports.

`StreamStageModel` is what the hysteresis policy predicts with under streaming (its class
docstring gives the model); `OnlineStageModel` (`policy/model.py`) is the one-step-off
pipeline's. The statistics both kinds of fit need and only the streaming one uses live here
too: the expected longest of m sampled lengths (`expected_max_of`), a trend that is
extrapolated only when significant (`significant_slope`), and a regime change told apart from
drift (`regime_changed`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import numpy as np

from dynaresize.control.window import RollingWindow
from dynaresize.types import StepReport


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
