"""One step's response lengths rebuilt from what a log keeps of them: the mean, the max and the
clip ratio (the share of responses cut at the length cap).

The model: a log-normal distribution censored at the logged max M. With a clip ratio c > 0, M
is the cap and the (1 - c) quantile of the uncensored distribution sits at M (a share c of
responses reach it); with c = 0 the largest of the n samples is M. Its one free parameter, the
spread sigma, is solved (bisection) so that the mean equals the logged mean: the mean falls
monotonically from M (sigma = 0: every response is M) towards c * M as sigma grows. The n
lengths are the distribution's quantiles at (i + 0.5) / n (deterministic: no sampling noise),
then put in a fixed pseudo-random order (seeded by the step) so that the simulator's
round-robin routing sees a mixed batch, as a real one is.

What it cannot know: the shape between the mean and the max (a second mode, a heavier tail);
a length trace (`--length-trace`) or a dynaresize run's sample records replace it.

Pure: numpy only.
"""

from __future__ import annotations

from functools import lru_cache
from statistics import NormalDist

import numpy as np


@lru_cache(maxsize=32)
def _normal_quantiles(n: int) -> np.ndarray:
    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / n) for i in range(n)])


def rebuild_lengths(*, mean: float, longest: float, clip_ratio: float = 0.0, num_samples: int,
                    seed: int = 0) -> np.ndarray:
    """`num_samples` response lengths (int64, >= 1) whose mean is `mean` and whose largest is
    `longest` (to rounding), a share `clip_ratio` of them at `longest` (see the module doc)."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: must be >= 1")
    if not (mean > 0 and longest > 0):
        raise ValueError(f"mean={mean}, longest={longest}: both must be > 0")
    n, M = int(num_samples), float(longest)
    mean = min(float(mean), M)
    c = min(max(float(clip_ratio), 0.0), 1.0)
    z = _normal_quantiles(n)
    anchor = NormalDist().inv_cdf(1.0 - c) if 0.0 < c < 1.0 else float(z[-1])

    def lengths(sigma: float) -> np.ndarray:
        return np.minimum(M, M * np.exp(sigma * (z - anchor)))

    if c >= 1.0 or mean >= M * (1 - 1e-9):
        out = np.full(n, M)
    else:
        lo, hi = 0.0, 1.0
        while lengths(hi).mean() > mean and hi < 64.0:
            hi *= 2.0
        for _ in range(60):
            mid = (lo + hi) / 2.0
            if lengths(mid).mean() > mean:
                lo = mid
            else:
                hi = mid
        out = lengths((lo + hi) / 2.0)
    arr = np.maximum(np.rint(out), 1).astype(np.int64)
    return arr[np.random.default_rng(seed).permutation(n)]
