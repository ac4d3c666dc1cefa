"""How much memory a vLLM engine's KV cache gets, and whether one request fits in it.

A pure module (no torch, no vLLM): `VLLMRolloutEngine.engine_kwargs` asks it.
- `rollout.vllm_kv_cache_bytes = 0` (the default) sizes the cache for the device: on CUDA vLLM
  takes what `rollout.gpu_memory_utilization` x the device's memory leaves after the weights
  and activations (so nothing is passed); on the CPU a fixed `CPU_KV_CACHE_BYTES`, because
  vLLM's CPU backend would otherwise take `VLLM_CPU_KVCACHE_SPACE` (GiBs) per engine.
- A cache must hold at least one request of `max_model_len` tokens (vLLM refuses to start
  otherwise, with a message that names neither of our fields): `kv_problem` says so first, in
  one line naming the field to raise.
"""

from __future__ import annotations

from typing import Any

CPU_KV_CACHE_BYTES = 256 << 20  # ~2,300 tokens of a 7B's KV in fp32 (112 KiB/token), far more of a tiny model's
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes(requested: int, *, cuda: bool) -> int | None:
    """The `kv_cache_memory_bytes` to pass to vLLM: `requested` when set, else the device's
    default (None on CUDA: vLLM sizes it from `gpu_memory_utilization`)."""
    if requested:
        return int(requested)
    return None if cuda else CPU_KV_CACHE_BYTES


def kv_bytes_per_token(hf_config: Any, dtype: str) -> int:
    """Bytes of K and V one token takes over all layers: 2 x layers x KV heads x head dim x dtype."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def kv_problem(cache_bytes: int | None, per_token: int, max_model_len: int) -> str | None:
    """One line when a cache of `cache_bytes` cannot hold one request of `max_model_len`
    tokens; None when it can (or when vLLM sizes it: it checks that itself)."""
    if cache_bytes is None or max_model_len <= 0:
        return None
    tokens = cache_bytes // max(per_token, 1)
    if tokens >= max_model_len:
        return None
    need = per_token * max_model_len
    return (f"rollout.vllm_kv_cache_bytes={cache_bytes} holds {tokens} tokens of this model's KV cache "
            f"({per_token} bytes/token), fewer than one request of max_model_len {max_model_len}: "
            f"set it to >= {need} or lower rollout.vllm_max_model_len")
