"""Pure pieces of the trainer state: the flat shard rule, AdamW settings and LR schedule, and
the elementwise AdamW update. No process groups, no I/O.

Invariants: `shard_range` equals `reshard.layout.FlatLayout` (balanced contiguous ranges over
the sorted rank tuple, the first `numel % W` one element longer); `adamw_update_` is purely
elementwise, so a value never depends on where its shard starts (tested bitwise).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from dynaresize.errors import ConfigError


def shard_range(numel: int, num_ranks: int, index: int) -> tuple[int, int]:
    """[lo, hi) of shard `index` of `num_ranks`: contiguous, sizes differ by at most 1, the
    first `numel % num_ranks` shards one longer. Must equal `reshard.layout.FlatLayout`."""
    if num_ranks < 1 or not 0 <= index < num_ranks or numel < 0:
        raise ValueError(f"bad shard: numel={numel} num_ranks={num_ranks} index={index}")
    base, rem = divmod(numel, num_ranks)
    lo = index * base + min(index, rem)
    return lo, lo + base + (1 if index < rem else 0)


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """AdamW and LR-schedule settings (torch.optim.AdamW semantics: decoupled weight decay)."""

    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # 0: no clipping; else clip by the fp64 global norm
    schedule: str = "constant"  # constant | linear | cosine (after warmup, to min_lr_ratio * lr)
    warmup_steps: int = 0
    total_steps: int = 0  # decay horizon for linear/cosine
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        bad = []
        if not self.lr > 0:
            bad.append(f"train.lr: {self.lr}: must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad.append(f"train.betas: {self.betas}: must be two numbers in [0, 1)")
        if not self.eps > 0:
            bad.append(f"train.eps: {self.eps}: must be > 0")
        if self.weight_decay < 0 or self.max_grad_norm < 0 or self.warmup_steps < 0 or self.total_steps < 0:
            bad.append("train: weight_decay, max_grad_norm, warmup_steps, total_steps must be >= 0")
        if self.schedule not in ("constant", "linear", "cosine"):
            bad.append(f"train.schedule: {self.schedule!r}: must be constant, linear or cosine")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            bad.append(f"train.total_steps: {self.total_steps}: must exceed warmup_steps for {self.schedule}")
        if not 0 <= self.min_lr_ratio <= 1:
            bad.append(f"train.min_lr_ratio: {self.min_lr_ratio}: must be in [0, 1]")
        if bad:
            raise ConfigError(bad)

    @classmethod
    def from_config(cls, train_cfg: Any, **overrides: Any) -> "OptimSettings":
        """Take every field this class knows from a config section (e.g. `TrainConfig`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {n: getattr(train_cfg, n) for n in names if hasattr(train_cfg, n)}
        values.update(overrides)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)

    def lr_at(self, lr_step: int) -> float:
        """Learning rate of the update made at schedule step `lr_step` (0-based)."""
        if lr_step < self.warmup_steps:
            return self.lr * (lr_step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        frac = min(1.0, (lr_step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 1.0 - frac if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)


def adamw_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                  *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One elementwise AdamW update in place, `step` counted from 1. The op sequence is that of
    torch.optim.AdamW's single-tensor path (torch 2.13), so results match it bitwise on CPU;
    every op is elementwise, so a value never depends on where its shard starts."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): stable across processes and runs."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1
