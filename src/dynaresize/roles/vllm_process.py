"""What an in-process vLLM engine changes in its process, and how the worker keeps it out.

vLLM's CPU worker replaces `torch.set_num_threads` by a no-op, reseeds the global RNGs and
sets environment variables (LD_PRELOAD among them) when it starts. `preserve_process_state`
restores the thread function and count, the RNG states and the environment after every entry
point of `roles.rollout_vllm`, so the worker's own math (bitwise-reproducible only at a fixed
thread count and seed) and later subprocesses are unaffected. `ENGINE_ENV` is what the engine
is created under (in-process, no usage stats); `OVERRIDING_ENV` what is removed for it.
`eager_token_ranks` replaces one compiled sampler helper on CPU (why: its docstring), and
`preload_vllm` imports vLLM's modules ahead of an engine's first start.

Imports torch (and vLLM only inside `_eager_token_ranks`), not Ray.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from contextlib import contextmanager

import torch

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# Removed for the engine's creation: it would override `kv_cache_bytes` (in whole GiB).
OVERRIDING_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


@contextmanager
def preserve_process_state(*, env: bool = True):
    """Restore torch's thread function and count, the global RNGs and (optionally) the
    environment after the block: vLLM changes all of them when it starts."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    py_rng, np_rng, torch_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    saved_env = dict(os.environ) if env else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if saved_env is not None:
            restore_env(saved_env)


def restore_env(saved: dict[str, str]) -> None:
    """Undo environment changes, except new VLLM_* variables (vLLM's own, read again later)."""
    for key in list(os.environ):
        if key not in saved and not key.startswith("VLLM_"):
            del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


_patched_ranks = False


def eager_token_ranks() -> None:
    """On CPU, compute the sampled tokens' ranks (which log-prob requests make vLLM return)
    eagerly instead of through its `torch.compile`d helper: compiling it costs 3-14 s on the
    first request of every process (measured, 2 cores) and needs a C++ compiler. Same result
    (a count of `x >= value` per row); the only cost is a (rows x vocab) bool temporary."""
    global _patched_ranks
    if _patched_ranks or torch.cuda.is_available():
        return
    from vllm.v1.sample import sampler

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    sampler.batched_count_greater_than = batched_count_greater_than
    _patched_ranks = True


def preload_vllm() -> float:
    """Import the vLLM modules an engine's first start needs; returns the seconds taken.

    Most of a process's first `start` is imports: on the 2-core CPU machine a first start
    took 8-24 s, and 1.3 s after `preload` (docs/rollout.md, section 4). A worker that may become a rollout device can call
    this when it starts, or in a background thread, so no resize pays for them. Safe to
    call more than once and without an engine: imports only (no engine, no
    torch.distributed); they touch neither the RNGs nor the thread count (checked), and the
    environment variables they set are undone.
    """
    t0 = time.perf_counter()
    worker = "vllm.v1.worker.gpu_worker" if torch.cuda.is_available() else "vllm.v1.worker.cpu_worker"
    saved_env = dict(os.environ)
    try:
        for name in ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", worker,
                     "vllm.v1.sample.sampler", "vllm.model_executor.model_loader",
                     "vllm.model_executor.models.qwen2", "vllm.model_executor.models.llama"):
            try:
                importlib.import_module(name)
            except Exception:  # a module this build lacks: the start imports what it needs
                pass
    finally:
        restore_env(saved_env)
    return time.perf_counter() - t0
