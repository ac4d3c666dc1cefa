"""The run configuration's `train` and `algorithm` sections (re-exported by `config`): the optimizer,
the loss, LoRA (`train.lora`), the advantage estimator and dynamic sampling.

Pure: nothing but `errors` imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynaresize.errors import FieldErrors as _Errors


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # rl.grpo
MAX_STALENESS = 4  # streaming keeps up to staleness + 2 weight versions on the driver (docs/pipeline.md)


ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """`train.lora`: train a low-rank adapter (peft's LoraConfig; verl's lora_rank, lora_alpha,
    target_modules) instead of the whole model; docs/lora.md says what it changes."""

    rank: int  # r: the adapter's inner dimension
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    target_modules: tuple[str, ...] = (ALL_LINEAR,)  # module name suffixes (q_proj, ...) or all-linear

    def check(self, err: "_Errors") -> None:
        err.need(isinstance(self.rank, int) and self.rank >= 1, "rank", self.rank, "must be an integer >= 1")
        err.need(math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "must be > 0")
        err.need(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        names = self.target_modules
        err.need(bool(names) and all(isinstance(n, str) and n.strip() for n in names), "target_modules",
                 ",".join(map(str, names)), "must name at least one module (or all-linear)")
        err.need(ALL_LINEAR not in names or len(names) == 1, "target_modules", ",".join(map(str, names)),
                 f"{ALL_LINEAR} already names every linear layer: give it alone")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    micro_batch_size: int = 4  # samples per micro-batch; composition fixed by sample index
    staleness: int = 1  # 0 = synchronous; 1 = one-step off-policy; 2..MAX_STALENESS = streaming (docs/pipeline.md)
    dtype: str = "auto"  # compute dtype: auto (bf16 on CUDA unless deterministic, else fp32) | fp32 | bf16
    activation_checkpointing: bool | None = None  # recompute each block's activations in backward; None: on with CUDA
    logprob_chunk_tokens: int = 1024  # the loss's output head on this many response tokens at a time; 0: whole logits
    kl_estimator: str = "k3"  # k1 (log ratio) | k3 (low-variance, non-negative); used when kl_coef > 0
    lr_schedule: str = "constant"  # constant | linear | cosine (decay over the run's steps, after warmup)
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.0  # linear/cosine decay ends at lr * min_lr_ratio
    max_grad_norm: float = 0.0  # clip the gradient by its global norm; 0: no clipping
    old_logprobs: str = "auto"  # engine | recompute | auto (recompute unless the engine's are exact)
    clip_ratio_low: float | None = None  # ratio clipped below at 1 - this; None: clip_eps
    clip_ratio_high: float | None = None  # ... and above at 1 + this (DAPO clip-higher: 0.28); None: clip_eps
    clip_ratio_c: float = 0.0  # dual-clip PPO: a negative advantage's loss capped at -A * c; 0: off, else > 1
    loss_agg_mode: str = "token-mean"  # or seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    norm_adv_by_std: bool = True  # advantage (r - mean) / (std + 1e-6) per group; False: r - mean (Dr. GRPO)
    adv_std: str = "sample"  # the group std: sample (ddof=1, as verl and TRL) | population (ddof=0)
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy, aggregated like the loss
    kl_penalty: str = "loss"  # where kl_coef's KL goes: loss (reward, verl's use_kl_in_reward: refused)
    lora: LoraConfig | None = None  # None: train every weight; else only a LoRA adapter (docs/lora.md)

    def check(self, err: "_Errors") -> None:
        err.need(self.lr > 0, "lr", self.lr, "must be > 0")
        err.need(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        err.need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas,
                 "must be two numbers in [0, 1)")
        err.need(self.eps > 0, "eps", self.eps, "must be > 0")
        err.need(self.clip_eps > 0, "clip_eps", self.clip_eps, "must be > 0")
        err.need(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        err.need(self.micro_batch_size >= 1, "micro_batch_size", self.micro_batch_size, "must be >= 1")
        err.need(isinstance(self.staleness, int) and 0 <= self.staleness <= MAX_STALENESS, "staleness",
                 self.staleness, f"must be 0 (synchronous), 1 (one-step off) or 2..{MAX_STALENESS} (streaming)")
        err.need(self.dtype in ("auto", "fp32", "bf16"), "dtype", self.dtype, "must be auto, fp32 or bf16")
        err.need(isinstance(self.logprob_chunk_tokens, int) and self.logprob_chunk_tokens >= 0,
                 "logprob_chunk_tokens", self.logprob_chunk_tokens, "must be an integer >= 0 (0: whole logits)")
        err.need(self.kl_estimator in ("k1", "k3"), "kl_estimator", self.kl_estimator, "must be k1 or k3")
        err.need(self.lr_schedule in ("constant", "linear", "cosine"), "lr_schedule", self.lr_schedule,
                 "must be constant, linear or cosine")
        err.need(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        err.need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        err.need(self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm, "must be >= 0 (0: no clipping)")
        err.need(self.old_logprobs in ("auto", "engine", "recompute"), "old_logprobs", self.old_logprobs,
                 "must be auto, engine or recompute")
        for name, v in (("clip_ratio_low", self.clip_ratio_low), ("clip_ratio_high", self.clip_ratio_high)):
            err.need(v is None or (math.isfinite(v) and v > 0), name, v, "must be > 0 (or unset: clip_eps)")
        err.need(None in (self.clip_ratio_low, self.clip_ratio_high) or self.clip_eps == TrainConfig.clip_eps,
                 "clip_eps", self.clip_eps, "unused when clip_ratio_low and clip_ratio_high are both set: unset one")
        err.need(self.clip_ratio_c == 0 or (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1),
                 "clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip PPO), or 0 (off)")
        err.need(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", self.loss_agg_mode,
                 f"must be one of {', '.join(LOSS_AGG_MODES)}")
        err.need(self.adv_std in ("sample", "population"), "adv_std", self.adv_std, "must be sample or population")
        err.need(math.isfinite(self.entropy_coef) and self.entropy_coef >= 0, "entropy_coef", self.entropy_coef,
                 "must be >= 0")
        err.need(self.kl_penalty == "loss", "kl_penalty", self.kl_penalty, "must be loss" if self.kl_penalty != "reward"
                 else "not supported: a KL reward penalty (verl's use_kl_in_reward) needs the reference log-probs "
                 "before the advantages, and the trainers compute them in the loss; use loss (kl_coef, kl_estimator)")


ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # rl.advantages


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """verl's `algorithm.*`: the advantage estimator, DAPO's dynamic sampling (cross-checks: config_load)."""

    adv_estimator: str = "grpo"  # grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline (rl/advantages.py)
    filter_groups: bool = False  # dynamic sampling: drop groups whose filter_metric is constant, generate more
    filter_metric: str = "reward"  # reward (shaped) | score (before overlong shaping) | a reward's own key (acc)
    max_num_gen_batches: int = 10  # generation batches a step may take before the run stops; 0: no cap

    def check(self, err: "_Errors") -> None:
        err.need(self.adv_estimator in ADV_ESTIMATORS, "adv_estimator", self.adv_estimator,
                 f"must be one of {', '.join(ADV_ESTIMATORS)}")
        err.need(bool(self.filter_metric.strip()), "filter_metric", self.filter_metric,
                 "must name a metric: reward, score or a key the reward function returns")
        err.need(self.max_num_gen_batches >= 0, "max_num_gen_batches", self.max_num_gen_batches, "must be >= 0 (0: no cap)")
        for name in () if self.filter_groups else ("filter_metric", "max_num_gen_batches"):
            err.need(getattr(self, name) == getattr(AlgorithmConfig, name), name, getattr(self, name),
                     "only used with algorithm.filter_groups=true")
