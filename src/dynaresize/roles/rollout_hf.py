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

No global state is touched (threads, RNG, default dtype): the caller pins threads.
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model, complete_state_dict
from dynaresize.roles.base import GenRequest, GenResult


class HFRolloutEngine:
    """A `RolloutEngine` on an HF causal LM with a KV cache (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, temperature: float, *, batch_rows: int = 8,
                 device: str | torch.device = "cpu", dtype: str = "float32") -> None:
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

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._model is not None

    def set_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load `state_dict` (every parameter, by `named_parameters` name: a tied weight once,
        its aliases filled in here) strictly, and tag later results with `version`."""
        if self._model is None:
            self._load_model()
        assert self._model is not None
        with torch.no_grad():
            self._model.load_state_dict(complete_state_dict(state_dict, self._model), strict=True)
        self.version = int(version)

    def release(self) -> None:
        """Free the model and its caches; `set_weights` loads it again."""
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def weights_digest(self, names: Iterable[str] | None = None) -> str:
        """`weight_sync.weights_digest` of the weights this engine serves (`names`, or every
        parameter), read from the model it computes with."""
        from dynaresize.roles.weight_sync import weights_digest

        if self._model is None:
            raise RuntimeError("rollout engine is released: no weights to digest")
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
        """One result per request, in request order."""
        if self._model is None:
            raise RuntimeError("rollout engine is released; call set_weights first")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"sample {r.sample_id}: empty prompt")
            if _target_len(r) < 0:
                raise ValueError(f"sample {r.sample_id}: negative length {_target_len(r)}")
        results: dict[int, GenResult] = {}
        for batch in self._batches(requests):
            for idx, res in zip(batch, self._generate_batch([requests[i] for i in batch])):
                results[idx] = res
        return [results[i] for i in range(len(requests))]

    def _batches(self, requests: Sequence[GenRequest]) -> list[list[int]]:
        """Request indices bucketed by prompt length; within a bucket, longest targets first
        (so rows that end together share a batch), chunked into `batch_rows`."""
        buckets: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            buckets.setdefault(len(r.prompt_ids), []).append(i)
        out = []
        for length in sorted(buckets):
            idxs = sorted(buckets[length], key=lambda i: (-_target_len(requests[i]), tuple(requests[i].sample_id)))
            out.extend(idxs[k:k + self.batch_rows] for k in range(0, len(idxs), self.batch_rows))
        return out

    @torch.inference_mode()
    def _generate_batch(self, batch: list[GenRequest]) -> list[GenResult]:
        model = self._model
        assert model is not None
        t0 = time.perf_counter()
        num_real = len(batch)
        rows = batch + [batch[0]] * (self.batch_rows - num_real)  # filler rows: shape only
        targets = [_target_len(r) for r in batch]
        gens = [torch.Generator(device="cpu").manual_seed(int(r.seed)) for r in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        done = [t == 0 for t in targets]
        ended_s = [0.0 if d else None for d in done]
        input_ids = torch.tensor([r.prompt_ids for r in rows], dtype=torch.long, device=self.device)
        cache = _new_cache(model)  # filled in place by each forward
        while not all(done):
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            logp = torch.log_softmax(out.logits[:, -1, :].float() / self.temperature, dim=-1).cpu()
            vocab = logp.shape[-1]
            noise = torch.zeros((self.batch_rows, vocab), dtype=torch.float32)
            for i in range(num_real):
                if not done[i]:
                    noise[i] = _gumbel(gens[i], vocab)
            picked = torch.argmax(logp + noise, dim=-1)
            picked_logp = logp.gather(1, picked[:, None]).squeeze(1).tolist()
            picked_ids = picked.tolist()
            now = time.perf_counter() - t0
            for i in range(num_real):
                if done[i]:
                    continue
                tok = picked_ids[i]
                tokens[i].append(tok)
                logprobs[i].append(picked_logp[i])
                r = batch[i]
                if len(tokens[i]) >= targets[i] or (r.forced_length is None and tok in self._eos_ids):
                    done[i], ended_s[i] = True, now
            input_ids = picked[:, None].to(self.device)
        del cache
        return [GenResult(sample_id=tuple(r.sample_id), response_ids=tokens[i], logprobs=logprobs[i],
                          version=self.version, duration_s=float(ended_s[i] or 0.0))
                for i, r in enumerate(batch)]


def _target_len(r: GenRequest) -> int:
    return int(r.forced_length) if r.forced_length is not None else int(r.max_new_tokens)


def _gumbel(gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise from `gen`: one draw of `vocab` numbers per generated token."""
    u = torch.rand(vocab, generator=gen, dtype=torch.float64)
    # u in [0, 1): clamp away 0 so the noise is finite; float64 keeps distinct draws distinct.
    return (-torch.log(-torch.log(u.clamp_min(1e-300)))).to(torch.float32)


def _new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
