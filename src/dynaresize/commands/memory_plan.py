"""The memory plan of a run config (`costmodel.memory` fed from `RunConfig`), shared by
`dynaresize preflight` and the check where `dynaresize run` starts (`check_at_start`: on CUDA a
starting split that does not fit is a config error, exit 2, one line, and `policy.min_train` is
raised to the fewest trainers that fit). Apart from commands/run.py and commands/preflight.py so
neither imports the other."""

from __future__ import annotations

from dataclasses import replace

from dynaresize.config import RunConfig
from dynaresize.costmodel import memory
from dynaresize.errors import ConfigError
from dynaresize.roles.base import checkpointing, compute_dtype

GB = 1e9


def inputs_of(cfg: RunConfig, *, engine: str | None = None) -> memory.MemoryInputs:
    """The memory plan's inputs from a run config, for a CUDA device (the engine's dtype as
    `roles.base.engine_dtype` gives it there; `rollout.engine = auto` is vLLM on a GPU node,
    the hf engine in deterministic mode). A sequence is `rollout.max_prompt_tokens +
    max_new_tokens`; multi-turn (`task.env`), `task.max_total_tokens`, or when that is 0 (the
    model's positions) the prompt and `task.max_turns` responses, observations not counted."""
    r, t = cfg.rollout, cfg.train
    if engine is None:
        engine = "hf" if r.engine == "hf" or (r.engine == "auto" and cfg.deterministic) else "vllm"
    dtype = r.dtype if r.dtype != "auto" else ("bf16" if t.dtype == "bf16" or not cfg.deterministic else "fp32")
    seq = r.max_prompt_tokens + r.max_new_tokens
    if cfg.task.env:  # multi-turn: a trajectory is its cap, or at least its turns (observations unknown here)
        seq = cfg.task.max_total_tokens or r.max_prompt_tokens + cfg.task.max_turns * r.max_new_tokens
    return memory.MemoryInputs(
        micro_batch_size=t.micro_batch_size, seq_tokens=seq, train_dtype=compute_dtype(cfg, cuda=True),
        activation_checkpointing=checkpointing(cfg, cuda=True), reference=t.kl_coef > 0, engine=engine,
        engine_dtype=dtype, tensor_parallel=r.tensor_parallel, gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_bytes=r.vllm_kv_cache_bytes, max_model_len=r.vllm_max_model_len or seq, hf_batch_rows=r.batch_rows,
        reshard_staging_bytes=cfg.reshard.staging_bytes, engine_release=r.engine_release,
        logprob_chunk_tokens=t.logprob_chunk_tokens, adapter_params=adapter_params(cfg))


def adapter_params(cfg: RunConfig) -> int:
    """`train.lora`'s adapter parameters for the run's model (peft's own count, on meta); 0 without LoRA."""
    if cfg.train.lora is None:
        return 0
    import math

    from dynaresize.roles.lora_model import adapter_specs

    return int(sum(math.prod(s) for _, s in adapter_specs(cfg.model, cfg.train.lora)))


def _bounds(cfg: RunConfig):
    from dynaresize.emulate.model import run_bounds

    return run_bounds(cfg)


def plan(cfg: RunConfig, shape: memory.ModelShape, hbm_bytes: float) -> list[memory.SplitFit]:
    """Every split the run's bounds allow, fitted to a device of `hbm_bytes`."""
    return memory.plan_splits(shape, inputs_of(cfg), hbm_bytes, num_devices=cfg.cluster.devices,
                              rollout_sizes=_bounds(cfg).splits())


def start_check(cfg: RunConfig, device_kind: str, hbm_bytes: float,
                shape: memory.ModelShape | None = None) -> RunConfig:
    """The run's config after the memory check at start: unchanged off CUDA; on CUDA, a starting
    split that does not fit raises ConfigError (one line: the split, the role, the bytes), and
    `policy.min_train` is raised to the fewest trainers that fit."""
    if device_kind != "cuda":
        return cfg
    if shape is None:
        from dynaresize.roles.model_shape import read_shape

        shape = read_shape(cfg.model)
    r = cfg.cluster.rollout_devices
    start = memory.split_fit(shape, inputs_of(cfg), hbm_bytes, rollout=r, train=cfg.cluster.devices - r)
    if not start.fits:
        raise ConfigError([f"cluster.rollout_devices={r}: the starting split {r} rollout : {start.train} train does not "
                           f"fit a {hbm_bytes / GB:.1f} GB cuda device: {start.limit} (dynaresize preflight shows "
                           "every split)"])
    fitting = [s.train for s in plan(cfg, shape, hbm_bytes) if s.fits]
    least = min(fitting, default=start.train)
    if least <= cfg.policy.min_train:
        return cfg
    return replace(cfg, policy=replace(cfg.policy, min_train=least))


def check_at_start(cfg: RunConfig) -> RunConfig:
    """`start_check` with this process's device: CUDA when torch sees one (its memory from
    torch), else nothing to check. A CPU-only driver over GPU workers is not checked here."""
    import torch

    if not torch.cuda.is_available():
        return start_check(cfg, "cpu", 0.0)
    return start_check(cfg, "cuda", float(torch.cuda.get_device_properties(0).total_memory))
