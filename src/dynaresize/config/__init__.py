"""Run configuration: frozen keyword-only dataclasses, one per section, each checking its own
fields (`check(err)`); the parsers of the small string formats fields use (schedules, fault
specs) are in `types`, re-exported here, as are the `rollout` section (`config.rollout`) and the
`train` and `algorithm` sections (`config.train`).

Pure: no Ray, torch or I/O, and nothing but `errors`, `types` and those two imported: every layer reads these values.
Checks that need the cost models (emulated accelerators) run in `emulate.check`; making a
config from dicts, files and `--set` overrides is `config_load`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dynaresize.errors import FieldErrors as _Errors  # noqa: F401  (config_load's collector, by its old name)
from dynaresize.config.rollout import ROLLOUT_DTYPES, ROLLOUT_ENGINES, RolloutConfig  # noqa: F401
from dynaresize.config.train import (  # noqa: F401
    ADV_ESTIMATORS, ALL_LINEAR, LOSS_AGG_MODES, MAX_STALENESS, AlgorithmConfig, LoraConfig, TrainConfig,
)
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
    snapshot_every_steps: int = 0  # K: full in-memory snapshots every K steps (driver/snapshots.py); 0: Young/Daly
    mtbf_s: float = 10800.0  # the mean time between failures that choosing K assumes (a job's, not a device's)

    def check(self, err: "_Errors") -> None:
        err.need(self.every_steps >= 0, "every_steps", self.every_steps, "must be >= 0")
        err.need(self.snapshot_every_steps >= 0, "snapshot_every_steps", self.snapshot_every_steps,
                 "must be >= 0 (0: chosen from the snapshot cost and mtbf_s)")
        err.need(math.isfinite(self.mtbf_s) and self.mtbf_s > 0, "mtbf_s", self.mtbf_s, "must be a positive number")
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
        err.need(t.lora is None or self.rollout.weight_sync != "delta", "rollout.weight_sync", "delta",
                 "not with train.lora: a sync sends the adapter whole (megabytes, docs/lora.md); use full or auto")
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
