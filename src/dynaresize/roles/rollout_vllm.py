"""The vLLM rollout engine: an in-process `vllm.LLM` behind the `RolloutEngine` interface.

Lifecycle (docs/rollout.md has the measured costs):
- `start(state_dict, version)` creates the engine in this process (`load_format="dummy"`: only
  the config and tokenizer are read, from `ModelConfig.path` or a temporary directory kept until
  `release` for the built-in model) with its KV cache (`kv_cache_bytes`), checks its weights'
  names against the state dict's (roles/engine_map.py), loads it in place, warms up (2 tokens).
- `load_weights(state_dict, version)` updates the running engine in place: the worker's
  `model_runner.reload_weights(weights_iterator=...)` through `collective_rpc`, in chunks of
  whole decoder layers (a fused group, q/k/v, gate/up or weight+bias, is never split across
  calls: vLLM would process a half-loaded layer), then the tied lm_head is re-dispatched (on
  CPU its GEMM handle is built from the embedding at load time) and the prefix cache reset.
  A weight sync's stream of buckets (roles/weight_sync.py) goes in one call, as it arrives.
- `release()` tears the engine down, frees its memory; `park()`/`unpark()`: vLLM's sleep mode (CUDA), else nothing.

Sampling: every request is its own vLLM request with `SamplingParams(seed=GenRequest.seed)`,
so its tokens depend on (weights, prompt, seed, forced_length), not on its batch (checked in
tests/dist/test_rollout_vllm.py). Log-probs are vLLM's `processed_logprobs` of the sampled
tokens: log_softmax(logits / temperature), as the HF engine returns. Numerics differ slightly
with batch composition (CPU: up to ~3e-5), unlike the HF engine's fixed-shape batches.
Driven request by request (the `SteppingEngine` interface: `add`, `step`, `abort`) through the
in-process engine's `add_request` / `step` / `abort_request`; `generate` is `add` then `step`
until done (roles/vllm_requests.py).

Tensor parallelism (`tp`: a `TPPlacement`, size k > 1): one rank of a replica spanning k device
workers (roles/vllm_tp.py); every call is made on all k ranks in the same order (`start`,
`set_weights`/`load_weights`, `generate`, `step`, `weights_digest` are collectives). Each rank
is sent the whole state dict, vLLM keeps its slice: a load moves k x one copy's bytes.

One engine per process. Helpers: process state vLLM changes (`vllm_process`), its world kept apart
(`vllm_world`), weight chunks and digests (`vllm_weights`, MoE experts: `vllm_moe`), KV budget
(`vllm_memory`), tensor parallelism (`vllm_tp`), the start's check of weight names (`engine_map`),
LoRA (`vllm_lora`: started from the folder's weights, sent adapters, serves the merged weights).
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dynaresize.config import ModelConfig
from dynaresize.errors import UserError
from dynaresize.rl.models import build_model, build_tokenizer, hf_config, max_positions
from dynaresize.roles.base import GenRequest, GenResult, TPPlacement, run_to_completion, target_len, vllm_model_problem
from dynaresize.roles.device_memory import bytes_freed_by, check_wake
from dynaresize.roles.engine_map import check_start
from dynaresize.roles.vllm_lora import is_adapter, load_adapter, policy_shapes, save_weights, start_lora
from dynaresize.roles.vllm_memory import kv_bytes_per_token, kv_cache_bytes, kv_problem
from dynaresize.roles.vllm_process import ENGINE_ENV, OVERRIDING_ENV, eager_token_ranks, preserve_process_state
from dynaresize.roles.vllm_requests import check_fits, empty_result, extend, result_of, vllm_request, warm_up
from dynaresize.roles.vllm_weights import _rpc_digest, _rpc_kv_cache_bytes, _rpc_weight_shapes, load_into, reset_prefix_cache
from dynaresize.roles.vllm_tp import check_placement, fixed_request_ids, tp_creation, tp_engine_kwargs
from dynaresize.roles.vllm_world import (destroy_vllm_world, install_safe_cleanup, internals_problem, tp_name_base,
                                         vllm_world)


class VLLMRolloutEngine:
    """A `RolloutEngine` on an in-process vLLM engine (see the module docstring).

    Args:
        model_cfg: the policy model (`path` None: the built-in tiny Qwen2).
        temperature: sampling temperature (> 0); log-probs are under it.
        max_num_seqs: requests the engine decodes at once (vLLM's `max_num_seqs`).
        max_model_len: longest prompt + response in tokens; 0: the model's own limit.
        kv_cache_bytes: KV cache size; 0: sized for the device (roles/vllm_memory.py).
        dtype: weights and compute dtype ("float32": the HF engine's and trainer's).
        seed: the engine's own seed (every request carries its own; this seeds nothing of ours).
        prefix_caching: reuse the KV of shared prompt blocks (GRPO groups); off makes a
            sample's numerics independent of earlier requests (deterministic mode).
        load_chunk_bytes: weights per `reload_weights` call (whole layers); 0: one call.
        warmup: a two-token request at start (one-off costs fall in `start`, not the first rollout).
        gpu_memory_utilization: CUDA: the share of the device the engine may use (checked free at start).
        tp: this engine's rank of a tensor-parallel replica (None or size 1: a whole engine).
        cuda_graphs: CUDA: capture CUDA graphs (off in deterministic mode); eager on CPU always.
        lora: `train.lora` (rank, alpha) or None: sent adapters, serves the merged weights (vllm_lora).
    """

    def __init__(self, model_cfg: ModelConfig, temperature: float, *, max_num_seqs: int = 64,
                 max_model_len: int = 0, kv_cache_bytes: int = 0, dtype: str = "float32",
                 seed: int = 0, prefix_caching: bool = True, load_chunk_bytes: int = 0,
                 warmup: bool = True, gpu_memory_utilization: float = 0.85, tp: TPPlacement | None = None,
                 cuda_graphs: bool = True, lora: Any = None) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 0 or kv_cache_bytes < 0 or load_chunk_bytes < 0:
            raise ValueError("max_model_len, kv_cache_bytes and load_chunk_bytes must be >= 0")
        problem = vllm_model_problem(model_cfg) or internals_problem()
        if problem:
            raise UserError(f"rollout.engine=vllm: {problem}; use rollout.engine=hf")
        self.model_cfg = model_cfg
        self.tp = check_placement(tp)  # None: one rank
        self.temperature = float(temperature)
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.kv_cache_bytes = int(kv_cache_bytes)
        self.dtype, self._dtype = dtype, (getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        self.seed = int(seed)
        self.prefix_caching = bool(prefix_caching)
        self.load_chunk_bytes = int(load_chunk_bytes)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.warmup, self.cuda_graphs = bool(warmup), bool(cuda_graphs)
        self.version, self.lora, self._lora = -1, lora, None  # _lora: vllm_lora.EngineLora once started
        self.timings: dict[str, float] = {}  # seconds of the last start / load_weights / release
        self._llm: Any = None
        self._world: Any = None
        self._tmpdir: str | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self._parked, self._request_ids = False, itertools.count()
        self._park_bytes = 0  # what `park` freed on the device: what waking needs back
        # ours -> (request, start, vLLM's id, tokens so far, their log-probs)
        self._running: dict[str, tuple[GenRequest, float, str, list[int], list[float]]] = {}
        self._rid: dict[str, str] = {}  # an id vLLM's outputs may carry (ours or its own) -> ours
        self._ready: list[GenResult] = []  # results due at the next `step` (zero-length requests)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._llm is not None

    def set_weights(self, state_dict: Mapping[str, Any] | Iterable[list[tuple[str, Any]]], version: int) -> None:
        """`start` if released, else `load_weights` (a dict, or a stream of chunks: weight_sync.py)."""
        if self._llm is None:
            self.start(state_dict, version)
        else:
            self.load_weights(state_dict, version)

    def start(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Create the engine (KV cache included), load `state_dict` into it, warm it up."""
        if self._llm is not None:
            raise RuntimeError("vLLM engine already started; use load_weights")
        t0 = time.perf_counter()
        model_dir = self._model_dir()
        with preserve_process_state():
            os.environ.update(ENGINE_ENV)
            for key in OVERRIDING_ENV:
                os.environ.pop(key, None)
            from vllm import LLM

            install_safe_cleanup()
            eager_token_ranks()
            kwargs = self.engine_kwargs()
            # vLLM runs full garbage collections while it starts (~0.6 s each over a worker's
            # heap, measured: 2-3 s per start); with the existing heap frozen they only walk
            # the engine's own objects. Unfrozen afterwards (vLLM freezes too): nothing stays
            # uncollectable. A leaving role's cycles were collected before (roles/device_memory.py).
            gc.freeze()
            try:
                with vllm_world(self.tp and tp_name_base(self.tp.master_port)) as world, tp_creation(self.tp):
                    self._world = world
                    self._llm = LLM(model=model_dir, **kwargs)
            except BaseException:
                self._llm = None
                self._drop_tmpdir()
                raise
            finally:
                gc.unfreeze()
        t1 = time.perf_counter()
        if self.tp:
            fixed_request_ids(True)  # read at every add_request
        try:
            self._shapes = self._llm.collective_rpc(_rpc_weight_shapes)[0]
            hf = self._llm.llm_engine.model_config.hf_config
            hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            self._tied = bool(getattr(hf, "tie_word_embeddings", False))
            adapter, state_dict = is_adapter(state_dict) if self.lora else (False, state_dict)
            given = policy_shapes(self.model_cfg) if adapter else state_dict  # LoRA: the policy's names (vllm_lora)
            self._shapes = check_start(self._llm, self._shapes, given, self._tied, self.model_cfg.path)  # engine_map.py
            if self.lora:
                self._lora = start_lora(self._llm, self.lora, self._dtype, self.model_cfg, self._shapes)
            self._load(state_dict)
            self.version = int(version)
            t2 = time.perf_counter()
            if self.warmup:
                with preserve_process_state(env=False):
                    warm_up(self._llm, self.temperature)
        except BaseException:
            self.release()
            raise
        t3 = time.perf_counter()
        self.timings = {"start_s": t3 - t0, "create_s": t1 - t0, "load_s": t2 - t1, "warmup_s": t3 - t2}

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Update the running engine's weights in place (every weight, strictly)."""
        if self._llm is None:
            raise RuntimeError("vLLM engine is released; call start or set_weights first")
        t0 = time.perf_counter()
        self._load(state_dict)
        self.version = int(version)
        self.timings = {"load_s": time.perf_counter() - t0}

    def _load(self, weights: Mapping[str, Any] | Iterable[list[tuple[str, Any]]]) -> None:
        adapter, weights = is_adapter(weights) if self._lora else (False, weights)
        with preserve_process_state(env=False):
            if adapter:
                return load_adapter(self._llm, self._lora, weights)  # vllm_lora.py
            load_into(self._llm, weights, shapes=self._shapes, tied=self._tied, chunk_bytes=self.load_chunk_bytes)
        if self._lora:
            self._lora.applied = False  # full weights: no adapter applied

    def release(self) -> None:
        """Tear the engine down: model, KV cache, its process groups; `start` builds it again."""
        t0 = time.perf_counter()
        llm, self._llm = self._llm, None
        if llm is not None:
            with preserve_process_state(env=False):
                try:
                    llm.llm_engine.engine_core.shutdown()  # -> roles.vllm_world's safe cleanup
                finally:
                    del llm
                    destroy_vllm_world(self._world)  # a no-op when shutdown already did it
                    self._world = None
                    gc.collect()
                    if self.tp:
                        fixed_request_ids(False)
        self._parked, self._running, self._ready, self._rid, self._lora = False, {}, [], {}, None  # requests go too
        self._drop_tmpdir()
        self.timings = {"release_s": time.perf_counter() - t0}

    def park(self) -> bool:
        """Free the engine's memory but keep it warm, where the platform can (vLLM sleep mode
        level 1 on CUDA: weights to host memory, KV cache dropped). Returns whether memory was
        freed; False on CPU, where sleep is a no-op: call `release` to free memory there."""
        if self._llm is None or self._parked or not self._sleep_mode():
            return False
        self._park_bytes = bytes_freed_by(lambda: self._llm.sleep(level=1), self._device())
        self._parked = True
        return True

    def unpark(self) -> None:
        """Undo `park` (wake the engine); a no-op if it is not parked. The device's memory is
        collected and checked first: waking re-maps exactly the bytes sleep gave back, and
        where they are not free a `RuntimeError` says so in one line (vLLM would fail inside
        its allocator); the engine stays parked."""
        if self._llm is not None and self._parked:
            check_wake(self._park_bytes, self._device(), "the parked vLLM engine")
            self._llm.wake_up()
            reset_prefix_cache(self._llm)
            self._parked = False

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self._sleep_mode() else torch.device("cpu")

    def alloc_kv_cache(self) -> int:
        """Bytes of the engine's KV cache. vLLM allocates it when the engine starts and cannot
        allocate it separately, so this only reports it (0 when released)."""
        if self._llm is None:
            return 0
        return int(self._llm.collective_rpc(_rpc_kv_cache_bytes)[0])

    def engine_settings(self) -> dict:
        """The settings the running engine actually uses (for records and tests)."""
        if self._llm is None:
            return {}
        vc = self._llm.llm_engine.vllm_config
        return {"max_num_seqs": int(vc.scheduler_config.max_num_seqs), "max_model_len": int(vc.model_config.max_model_len),
                "kv_cache_memory_bytes": vc.cache_config.kv_cache_memory_bytes, "kv_cache_bytes": self.alloc_kv_cache(),
                "dtype": str(vc.model_config.dtype).replace("torch.", ""),
                "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
                "enable_chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
                "logprobs_mode": str(vc.model_config.logprobs_mode), "tied_embeddings": self._tied}

    def engine_kwargs(self) -> dict:
        """The `vllm.LLM` arguments this engine is created with."""
        kwargs: dict[str, Any] = dict(
            load_format="auto" if self.lora else "dummy",  # weights: `start`'s (LoRA: the folder's base)
            dtype=self.dtype, seed=self.seed, tensor_parallel_size=1,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=False,  # a prompt is always prefilled whole: no split-dependent numerics
            enable_prefix_caching=self.prefix_caching,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / temperature)
            # CUDA graphs on CUDA (an in-place reload keeps the weights' storage, so captured
            # pointers stay valid) unless deterministic; eager on CPU: seconds, not minutes, per start
            enforce_eager=not (self.cuda_graphs and self._sleep_mode()),
            disable_log_stats=True, **({"max_model_len": self.max_model_len} if self.max_model_len else {}))
        kwargs.update(tp_engine_kwargs(self.tp))  # a TP rank: tensor_parallel_size k, external launcher
        cache = kv_cache_bytes(self.kv_cache_bytes, cuda=self._sleep_mode())
        if cache is not None:  # one request of max_model_len must fit (vllm_memory.py)
            per_token = kv_bytes_per_token(hf_config(self.model_cfg), self.dtype)
            if problem := kv_problem(cache, per_token, self.max_model_len or max_positions(self.model_cfg)):
                raise UserError(problem)
            kwargs["kv_cache_memory_bytes"] = cache
        if self._sleep_mode():  # CUDA: the memory budget, and sleep mode (park frees memory)
            kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=self.gpu_memory_utilization)
        return kwargs

    @staticmethod
    def _sleep_mode() -> bool:
        return torch.cuda.is_available()

    def _model_dir(self) -> str:
        if self.model_cfg.path is not None:
            return str(self.model_cfg.path)
        self._tmpdir = tempfile.mkdtemp(prefix="dynaresize-vllm-")
        hf_config(self.model_cfg).save_pretrained(self._tmpdir)
        build_tokenizer(self.model_cfg.vocab_size).save_pretrained(self._tmpdir)
        if self.lora:  # the base LoRA merges into (the trainers' own initial weights)
            save_weights(build_model(self.model_cfg), self._tmpdir)
        return self._tmpdir

    def _drop_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- generation --------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """One result per request, in request order (`add` them all, `step` until done)."""
        return run_to_completion(self, requests)

    def add(self, requests: Sequence[GenRequest]) -> None:
        """Start `requests` now, beside those the engine is running (roles/vllm_requests.py)."""
        if self._llm is None:
            raise RuntimeError("vLLM engine is released; call set_weights first")
        if self._parked:
            raise RuntimeError("vLLM engine is parked; call unpark first")
        engine = self._llm.llm_engine
        limit = int(engine.vllm_config.model_config.max_model_len)
        for r in requests:
            check_fits(r, limit)
        with preserve_process_state(env=False):
            for r in requests:
                if target_len(r) == 0:
                    self._ready.append(empty_result(r, self.version))
                    continue
                rid = f"dynaresize-{next(self._request_ids)}"
                internal = engine.add_request(rid, *vllm_request(r, self.temperature))
                internal = internal if isinstance(internal, str) else rid  # outputs may carry vLLM's own id
                self._running[rid] = (r, time.perf_counter(), internal, [], [])
                self._rid[rid] = self._rid[internal] = rid

    def step(self) -> list[GenResult]:
        """One engine iteration; the requests that finished in it."""
        out, self._ready = self._ready, []
        if self._running:
            with preserve_process_state(env=False):
                for o in self._llm.llm_engine.step():
                    rid = self._rid.get(o.request_id)
                    if rid not in self._running:
                        continue
                    req, _, _, tokens, logprobs = self._running[rid]
                    extend(req, o, tokens, logprobs)
                    if o.finished:
                        req, t0 = self._drop(rid)
                        out.append(result_of(req, tokens, logprobs, self.version, time.perf_counter() - t0))
        return out

    def abort(self, sample_ids: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Stop these requests (no result for them); the ids that were running."""
        wanted = {tuple(s) for s in sample_ids}
        rids = [rid for rid, (r, *_) in self._running.items() if tuple(r.sample_id) in wanted]
        if rids:
            with preserve_process_state(env=False):
                self._llm.llm_engine.abort_request(rids)
        return [tuple(self._drop(rid)[0].sample_id) for rid in rids]

    def has_unfinished(self) -> bool:
        return bool(self._ready or self._running)

    def progress(self) -> dict[tuple[int, int, int], tuple[list[int], list[float]]]:
        """The running requests' tokens so far and their log-probs (copies)."""
        return {tuple(r.sample_id): (list(t), list(lp)) for r, _, _, t, lp in self._running.values()}

    def _drop(self, rid: str) -> tuple[GenRequest, float]:
        """Forget a request that finished or was aborted: (request, start)."""
        req, t0, internal, _, _ = self._running.pop(rid)
        self._rid.pop(rid, None)
        self._rid.pop(internal, None)
        return req, t0

    # -- checks ------------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        """The checkpoint (trainer) names of the engine's weights."""
        return sorted(self._shapes)

    def weights_digest(self, names: Iterable[str] | None = None) -> str:
        """`state_dict_digest` of the weights the engine computes with, read back from it
        (not from what was sent), under the trainer's names. `names` None: every weight.
        With tied embeddings the lm_head's kernel is also checked against the embedding even
        when `names` leaves it out; a stale one prefixes the digest with `STALE_HEAD`, so it
        can never match a trainer's."""
        if self._llm is None:
            raise RuntimeError("vLLM engine is released")
        if self._lora is not None and self._lora.applied:  # LoRA: the adapter applied (vllm_lora.py)
            return self._lora.digest(names, self._dtype)
        wanted, dtype = sorted(self._shapes if names is None else names), self._dtype
        with preserve_process_state(env=False):
            return self._llm.collective_rpc(_rpc_digest, args=(wanted, dtype))[0]

