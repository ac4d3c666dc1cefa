"""Outcome advantage estimators (`algorithm.adv_estimator`): one scalar reward per sample in,
one scalar advantage per sample out, as verl's `core_algos` computes them for outcome rewards.

Definitions (r_s the reward of sample s, its group g the samples of one prompt, G = |g|,
n_s the sample's response tokens the loss counts, eps = 1e-6):

    grpo                          (r_s - mean_g) / (std_g + eps)    (std: `adv_std`; or r_s - mean_g)
    rloo                          G/(G-1) * (r_s - mean_g)           = r_s - mean of the others
    reinforce_plus_plus           whiten(r) over the batch's tokens
    reinforce_plus_plus_baseline  whiten(r - mean_g) over the batch's tokens

`whiten(x)` is verl's `masked_whiten` of a per-token tensor in which every response token of
sample s holds x_s (the discount gamma is 1, verl's default, so a sample's return is its
reward at every token): with N = sum_s n_s, mu = sum_s n_s x_s / (N + 1e-8),
var = sum_s n_s (x_s - mu)^2 / (N + 1e-8) * N / (N - 1), the advantage is
(x_s - mu) / sqrt(var + 1e-8). A group of one sample gets mean 0 (verl's rule; the run config
asks for two or more samples per prompt anyway).

Invariants: the result is a function of the rewards, the group size and the token counts, in
sample-id order, never of devices. A group that left-out samples leave with one reward has
advantages 0. The two REINFORCE++ estimators read the whole step (every
sample in it), so they must be given the step's consumed samples exactly: under dynamic
sampling, the kept groups only. `present` marks samples whose reward counts (a TRL reward's
None leaves one out): a left-out sample is in no mean, std or whitening and gets 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
EPS = 1e-6  # verl's epsilon of the group std
WHITEN_EPS = 1e-8  # verl_F.masked_mean / masked_whiten


def compute_advantages(estimator: str, rewards: Sequence[float], group_size: int, *,
                       num_tokens: Sequence[int] | None = None, present: Sequence[bool] | None = None,
                       norm_by_std: bool = True, std: str = "sample") -> list[float]:
    """The advantage of each sample (see the module docstring); `rewards` ordered prompt by
    prompt, `group_size` samples each. `num_tokens` (n_s) is needed by the REINFORCE++ ones."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator {estimator!r}: must be one of {ADV_ESTIMATORS}")
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    keep = [True] * len(rewards) if present is None else [bool(p) for p in present]
    if len(keep) != len(rewards):
        raise ValueError(f"{len(keep)} present flags for {len(rewards)} rewards")
    if estimator == "grpo":
        return _per_group(rewards, keep, group_size, lambda g: _grpo(g, norm_by_std, std))
    if estimator == "rloo":
        return _per_group(rewards, keep, group_size, _rloo)
    if num_tokens is None or len(num_tokens) != len(rewards):
        raise ValueError(f"{estimator} needs the token count of every sample")
    if estimator == "reinforce_plus_plus_baseline":
        centred = _per_group(rewards, keep, group_size, lambda g: [r - _group_mean(g) for r in g])
    else:
        centred = [float(r) for r in rewards]
    return _whiten(centred, [n if k else 0 for n, k in zip(num_tokens, keep)], keep)


def _per_group(rewards: Sequence[float], keep: list[bool], group_size: int, fn) -> list[float]:
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        idx = [i for i in range(start, start + group_size) if keep[i]]
        # a group its left-out samples leave with one reward has no baseline: advantages 0
        adv = dict(zip(idx, fn([float(rewards[i]) for i in idx]))) if len(idx) >= min(2, group_size) else {}
        out.extend(adv.get(i, 0.0) for i in range(start, start + group_size))
    return out


def _group_mean(g: list[float]) -> float:
    return math.fsum(g) / len(g) if len(g) > 1 else 0.0


def _grpo(g: list[float], norm_by_std: bool, std: str) -> list[float]:
    if len(g) == 1:  # verl: mean 0, std 1
        return [g[0] / (1.0 + EPS)] if norm_by_std else [g[0]]
    mean = _group_mean(g)
    if not norm_by_std:
        return [r - mean for r in g]
    ddof = 1 if std == "sample" else 0
    sd = math.sqrt(math.fsum((r - mean) ** 2 for r in g) / (len(g) - ddof))
    return [(r - mean) / (sd + EPS) for r in g]


def _rloo(g: list[float]) -> list[float]:
    if len(g) == 1:
        return list(g)
    n, mean = len(g), _group_mean(g)
    return [r * n / (n - 1) - mean * n / (n - 1) for r in g]


def _whiten(x: list[float], n: list[int], keep: list[bool]) -> list[float]:
    total = sum(n)
    if total < 2:
        raise ValueError(f"whitening needs at least 2 response tokens in the step, got {total}")
    mu = math.fsum(ni * xi for ni, xi in zip(n, x)) / (total + WHITEN_EPS)
    var = math.fsum(ni * (xi - mu) ** 2 for ni, xi in zip(n, x)) / (total + WHITEN_EPS) * total / (total - 1)
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [(xi - mu) * scale if k and ni else 0.0 for xi, ni, k in zip(x, n, keep)]
