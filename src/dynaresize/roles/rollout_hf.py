"""The HF transformers rollout engine: batched sampling whose tokens no batch can change.

How a sample's tokens are made to depend only on (weights, prompt, seed, forced_length):
- Sampling is Gumbel-max with noise from a `torch.Generator` seeded by the request's seed and
  drawn once per generated token, so the noise of token t is a function of (seed, t) alone.
  argmax(logp + Gumbel) is an exact draw from softmax(logits / temperature).
- Batches never pad: requests are bucketed by prompt length, so every row of a batch has the
  same sequence length at every step and needs no attention mask.
- Every batch has exactly `batch_rows` rows (short batches are filled with throw-away copies
  of a real row), so the matrix shapes a row goes through depend on its own prompt length
  only. Measured on CPU (torch 2.13, fp32): the rows of a matmul are bit-identical whatever
  the other rows hold or where the row sits, but the kernel depends on the row count (here,
  fewer than 4 rows round differently; GPU libraries pick kernels by shape too), hence the
  fixed shape. tests/unit/test_rollout_hf.py checks bit-identity.
- Rows finished early (EOS or forced length) keep running with the batch until its longest
  row is done (static batching, as HF `generate`); their extra tokens are discarded.
- Driven request by request (`add`, `step`, `abort`: the `SteppingEngine` interface): each
  batch is a cohort (roles/hf_cohort.py) and a request added while others decode starts a
  cohort of its own, so it gets the tokens it would get alone; `step` advances every cohort by
  one token. `generate` is `add` then `step` until done.

Choosing `batch_rows`: a device's rollout time scales with its number of batches, so rows
well below the requests a device gets let the rollout stage speed up as devices are added;
larger rows give more throughput per device. Measured on the tiny model (2-core CPU, one
thread), 32 requests x 48 tokens: ~0.8 s CPU at 32 rows, ~0.95 s at 16, ~1.6 s at 8,
~3.0 s at 4; 16 requests cost about the same as 32 at 32 rows. Default 8 (two prompt groups
of 4 per batch).

Synthetic-length mode: with `forced_length` set, EOS is ignored and the response has exactly
that many tokens (as inference benchmarks do); otherwise it stops at EOS (included in the
response) or at `max_new_tokens`. Returned log-probs are those of the sampled tokens under the
sampling distribution, log_softmax(logits / temperature).

LoRA (`lora` given: `train.lora`): the engine is sent the adapter, never the base (roles/lora.py);
it keeps an `AdapterMerge` whose base weights are read from the model folder or the initial
weights (`InitialWeights`, as the trainers read theirs), and loads each targeted module's merged
weight. Its `weights_digest` is the adapter's, which is what the trainers' digest covers.

No global state is touched (threads, RNG, default dtype): the caller pins threads.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dynaresize.config import LoraConfig, ModelConfig
from dynaresize.rl.models import build_model, complete_state_dict
from dynaresize.roles.base import GenRequest, GenResult, check_request, run_to_completion, target_len
from dynaresize.roles.device_memory import release_device_memory
from dynaresize.roles.hf_cohort import Cohort
from dynaresize.roles.lora import AdapterMerge


class HFRolloutEngine:
    """A `RolloutEngine` on an HF causal LM with a KV cache (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, temperature: float, *, batch_rows: int = 8,
                 device: str | torch.device = "cpu", dtype: str = "float32", lora: LoraConfig | None = None) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        self.model_cfg = model_cfg
        self.temperature = float(temperature)
        self.batch_rows = int(batch_rows)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)  # weights and compute; sampling and log-probs stay fp32
        self.version = -1
        self._model: torch.nn.Module | None = None
        self._eos_ids: set[int] = set()
        self._cache_arg = "cache"
        self._cohorts: list[Cohort] = []  # batches being decoded (roles/hf_cohort.py)
        self.lora = lora
        self._merge: AdapterMerge | None = None  # LoRA: the kept base and the adapter served

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._model is not None

    def set_weights(self, weights: Mapping[str, Any] | Iterable[list[tuple[str, Any]]], version: int) -> None:
        """Load every parameter strictly, and tag later results with `version`. `weights`: a
        state dict (by `named_parameters` name: a tied weight once, its aliases filled in
        here), or a stream of chunks of (name, weight) pairs (roles/weight_sync.py), each
        copied into the model before the next is asked for, so no more than the chunk in hand
        is held outside the model."""
        if self._model is None:
            self._load_model()
        assert self._model is not None
        if self.lora is not None:
            self._load_adapter(weights.items() if isinstance(weights, Mapping) else
                               (named for chunk in weights for named in chunk))
        elif isinstance(weights, Mapping):
            with torch.no_grad():
                self._model.load_state_dict(complete_state_dict(weights, self._model), strict=True)
        else:
            self._load_stream(weights)
        self.version = int(version)

    def _load_stream(self, chunks: Iterable[list[tuple[str, Any]]]) -> None:
        params = dict(self._model.named_parameters())  # a tied weight once: it is one tensor
        seen: set[str] = set()
        with torch.no_grad():
            for chunk in chunks:
                for name, tensor in chunk:
                    p = params.get(name)
                    if p is None or name in seen or tuple(tensor.shape) != tuple(p.shape):
                        why = "unexpected" if p is None else "given twice" if name in seen else \
                            f"shape {tuple(tensor.shape)}, the model's {tuple(p.shape)}"
                        raise RuntimeError(f"rollout engine weights: {name} {why}")
                    p.copy_(tensor)
                    seen.add(name)
                chunk.clear()  # its buffer may go before the next one arrives
        missing = sorted(set(params) - seen)
        if missing:
            raise RuntimeError(f"rollout engine weights: missing {missing[:8]} (of {len(params)})")

    def _load_adapter(self, named: Iterable[tuple[str, Any]]) -> None:
        """LoRA: merge each module whose adapter halves arrived into the base and load it."""
        if self._merge is None:
            from dynaresize.roles.initial_weights import shared_initial_weights

            base = shared_initial_weights(self.model_cfg)  # the folder's rows (or the built-in init), fp32; kept
            self._merge = AdapterMerge(rank=self.lora.rank, alpha=self.lora.alpha, dtype=self.dtype,
                                       read_base=base.param)
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for name, merged in self._merge.feed(named):
                if name not in params or tuple(params[name].shape) != tuple(merged.shape):
                    raise RuntimeError(f"rollout engine LoRA weights: {name} is not a weight of this model")
                params[name].copy_(merged)
        if self._merge.pending():
            raise RuntimeError(f"rollout engine LoRA weights: one adapter half only for {self._merge.pending()[:4]}")

    def release(self) -> None:
        """Free the model and its caches (running requests are dropped); `set_weights` loads it again."""
        self._model, self._cohorts, self._merge = None, [], None
        release_device_memory(self.device)  # collects first

    def weights_digest(self, names: Iterable[str] | None = None) -> str:
        """`weight_sync.weights_digest` of the weights this engine serves (`names`, or every
        parameter), read from the model it computes with."""
        from dynaresize.roles.weight_sync import weights_digest

        if self._model is None:
            raise RuntimeError("rollout engine is released: no weights to digest")
        if self.lora is not None:  # the adapter applied last (the trainers digest theirs)
            return weights_digest(self._merge.named_adapter(names) if self._merge is not None else ())
        params = dict(self._model.named_parameters())
        return weights_digest((n, params[n]) for n in (params if names is None else names))

    def _load_model(self) -> None:
        self._install(build_model(self.model_cfg).to(device=self.device, dtype=self.dtype))

    def _install(self, model: torch.nn.Module) -> None:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        eos = model.config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        # transformers 5 names the KV-cache argument `cache`; 4.x named it `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._model = model

    # -- generation --------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """One result per request, in request order (`add` them all, `step` until done)."""
        return run_to_completion(self, requests)

    def add(self, requests: Sequence[GenRequest]) -> None:
        """Start `requests` now: grouped into new cohorts of one prompt length each
        (roles/hf_cohort.py), beside the cohorts already decoding."""
        if self._model is None:
            raise RuntimeError("rollout engine is released; call set_weights first")
        for r in requests:
            check_request(r)
        for batch in self._batches(requests):
            self._cohorts.append(Cohort(self._model, [requests[i] for i in batch], batch_rows=self.batch_rows,
                                        device=self.device, temperature=self.temperature, eos_ids=self._eos_ids,
                                        version=self.version, cache_arg=self._cache_arg, new_cache=_new_cache))

    def step(self) -> list[GenResult]:
        """One token for every running request; the results of those that finished."""
        out = [res for c in self._cohorts for res in c.step()]
        self._cohorts = [c for c in self._cohorts if not c.done]
        return out

    def abort(self, sample_ids: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Stop these requests (no result for them); the ids that were running."""
        wanted = {tuple(s) for s in sample_ids}
        stopped = [sid for c in self._cohorts for sid in c.abort(wanted)]
        self._cohorts = [c for c in self._cohorts if not c.done]
        return stopped

    def has_unfinished(self) -> bool:
        return bool(self._cohorts)

    def progress(self) -> dict[tuple[int, int, int], tuple[list[int], list[float]]]:
        """The running requests' tokens so far and their log-probs (copies)."""
        return {tuple(r.sample_id): (list(c.tokens[i]), list(c.logprobs[i]))
                for c in self._cohorts for i, r in enumerate(c.batch) if not c.finished[i]}

    def _batches(self, requests: Sequence[GenRequest]) -> list[list[int]]:
        """Request indices bucketed by prompt length; within a bucket, longest targets first
        (so rows that end together share a batch), chunked into `batch_rows`."""
        buckets: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            buckets.setdefault(len(r.prompt_ids), []).append(i)
        out = []
        for length in sorted(buckets):
            idxs = sorted(buckets[length], key=lambda i: (-target_len(requests[i]), tuple(requests[i].sample_id)))
            out.extend(idxs[k:k + self.batch_rows] for k in range(0, len(idxs), self.batch_rows))
        return out


def _new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
