"""Builds the rollout engine a run config names: the one module of `roles` that imports the
engine backends (`rollout_vllm`, `rollout_hf`), so the interface (`roles.base`) never does and
the package has no import circle. Backends import lazily: choosing one never imports the other.
"""

from __future__ import annotations

from typing import Any

from dynaresize.rl.env import env_spec
from dynaresize.rl.models import max_positions
from dynaresize.roles import base
from dynaresize.roles.base import RolloutEngine, TPPlacement


def rollout_engine_from_config(cfg: Any, tp: TPPlacement | None = None, **kwargs: Any) -> RolloutEngine:
    """The rollout engine of run config `cfg` (`resolve_engine`), built from its settings.
    `tp`: this engine's rank of a tensor-parallel replica (vllm only; None: a whole engine).
    `kwargs` go to the chosen engine's constructor (for example `device` for hf)."""
    name = base.resolve_engine(cfg)  # through the module: one definition, patched in tests
    r = cfg.rollout
    if name != "vllm" and tp is not None and tp.size > 1:
        raise ValueError(f"rollout.tensor_parallel={tp.size} needs rollout.engine=vllm (the {name} engine "
                         "holds a whole model per device)")
    if name == "vllm":
        from dynaresize.roles.rollout_vllm import VLLMRolloutEngine

        # 0: the run's prompt + response budget (a longer prompt keeps its last max_prompt_tokens),
        # within the model's positions (vLLM refuses a longer one)
        # (multi-turn: the trajectory's budget, task.max_total_tokens)
        budget = r.max_prompt_tokens + r.max_new_tokens
        if env_spec(cfg.task) is not None:
            budget = cfg.task.max_total_tokens or max_positions(cfg.model)
        max_model_len = r.vllm_max_model_len or min(budget, max_positions(cfg.model))
        options = dict(max_num_seqs=r.vllm_max_num_seqs, max_model_len=max_model_len,
                       kv_cache_bytes=r.vllm_kv_cache_bytes, seed=cfg.seed,
                       prefix_caching=not cfg.deterministic, cuda_graphs=not cfg.deterministic,
                       dtype=base.engine_dtype(cfg),
                       gpu_memory_utilization=r.gpu_memory_utilization,
                       lora=cfg.train.lora)  # LoRA: sent adapters, merged into the base (roles/vllm_lora.py)
        return VLLMRolloutEngine(cfg.model, r.temperature, **{**options, **kwargs}, tp=tp)
    from dynaresize.roles.rollout_hf import HFRolloutEngine

    device = str(kwargs.get("device", "cpu"))
    options = {"batch_rows": r.batch_rows, "dtype": base.engine_dtype(cfg, cuda=device.startswith("cuda")),
               "lora": cfg.train.lora}  # LoRA: sent adapters, merged into the base it reads itself
    return HFRolloutEngine(cfg.model, r.temperature, **{**options, **kwargs})
