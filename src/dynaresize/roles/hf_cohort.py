"""One cohort of the HF rollout engine: up to `batch_rows` requests of one prompt length,
started together and decoded in lockstep, one token per `step` (roles/rollout_hf.py).

Why cohorts: the HF engine makes a sample's tokens independent of everything else in the
engine by giving every forward pass the same shape (exactly `batch_rows` rows, no padding: all
rows of a cohort have one sequence length at every step). A request that arrives while others
decode cannot join their cohort (its length differs), so it starts a cohort of its own; each
`step` of the engine advances every live cohort by one token. Rows that end early (EOS, their
target length, or `abort`) keep their place until the whole cohort ends (the shape must not
change); their extra tokens are thrown away.

Sampling is Gumbel-max with per-request generators (see rollout_hf.py), so a row's tokens are a
function of (weights, prompt, seed, target) alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from dynaresize.roles.base import GenRequest, GenResult, target_len


class Cohort:
    """A fixed-shape batch being decoded (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, batch: list[GenRequest], *, batch_rows: int, device: torch.device,
                 temperature: float, eos_ids: set[int], version: int, cache_arg: str,
                 new_cache: Callable[[torch.nn.Module], Any]) -> None:
        if not 1 <= len(batch) <= batch_rows or len({len(r.prompt_ids) for r in batch}) != 1:
            raise ValueError("a cohort holds 1..batch_rows requests of one prompt length")
        self.model, self.batch, self.batch_rows = model, list(batch), batch_rows
        self.temperature, self.eos_ids, self.version = temperature, eos_ids, version
        self.cache_arg = cache_arg
        self.t0 = time.perf_counter()
        rows = self.batch + [self.batch[0]] * (batch_rows - len(self.batch))  # filler rows: shape only
        self.targets = [target_len(r) for r in self.batch]
        self.gens = [torch.Generator(device="cpu").manual_seed(int(r.seed)) for r in self.batch]
        self.tokens: list[list[int]] = [[] for _ in self.batch]
        self.logprobs: list[list[float]] = [[] for _ in self.batch]
        self.finished = [t == 0 for t in self.targets]
        self.aborted = [False] * len(self.batch)
        self.reported = [False] * len(self.batch)
        self.input_ids = torch.tensor([r.prompt_ids for r in rows], dtype=torch.long, device=device)
        self.cache = new_cache(model)  # filled in place by each forward

    @property
    def done(self) -> bool:
        return all(self.finished)

    def sample_ids(self) -> list[tuple[int, int, int]]:
        """The requests of this cohort still running (not finished, not aborted)."""
        return [tuple(r.sample_id) for r, f in zip(self.batch, self.finished) if not f]

    def abort(self, sample_ids: set) -> list[tuple[int, int, int]]:
        """Stop these requests (they give no result); the ids actually stopped."""
        out = []
        for i, r in enumerate(self.batch):
            if tuple(r.sample_id) in sample_ids and not self.finished[i]:
                self.finished[i] = self.aborted[i] = True
                out.append(tuple(r.sample_id))
        if self.done:
            self.cache = None
        return out

    def results(self) -> list[GenResult]:
        """Results of the rows that ended and were not yet handed out (zero-length ones at once)."""
        out = []
        now = time.perf_counter() - self.t0
        for i, r in enumerate(self.batch):
            if self.finished[i] and not self.aborted[i] and not self.reported[i]:
                self.reported[i] = True
                out.append(GenResult(sample_id=tuple(r.sample_id), response_ids=self.tokens[i],
                                     logprobs=self.logprobs[i], version=self.version,
                                     duration_s=float(now if self.tokens[i] else 0.0)))
        return out

    @torch.inference_mode()
    def step(self) -> list[GenResult]:
        """Decode one token for every row; the results of the rows that ended now."""
        if self.done:
            return self.results()
        out = self.model(input_ids=self.input_ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache})
        logp = torch.log_softmax(out.logits[:, -1, :].float() / self.temperature, dim=-1).cpu()
        vocab = logp.shape[-1]
        noise = torch.zeros((self.batch_rows, vocab), dtype=torch.float32)
        for i in range(len(self.batch)):
            if not self.finished[i]:
                noise[i] = gumbel(self.gens[i], vocab)
        picked = torch.argmax(logp + noise, dim=-1)
        picked_logp = logp.gather(1, picked[:, None]).squeeze(1).tolist()
        picked_ids = picked.tolist()
        for i, r in enumerate(self.batch):
            if self.finished[i]:
                continue
            tok = picked_ids[i]
            self.tokens[i].append(tok)
            self.logprobs[i].append(picked_logp[i])
            if len(self.tokens[i]) >= self.targets[i] or (r.forced_length is None and tok in self.eos_ids):
                self.finished[i] = True
        self.input_ids = picked[:, None].to(self.input_ids.device)
        ended = self.results()
        if self.done:
            self.cache = None  # the KV cache goes with the cohort
        return ended


def gumbel(gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise from `gen`: one draw of `vocab` numbers per generated token."""
    u = torch.rand(vocab, generator=gen, dtype=torch.float64)
    # u in [0, 1): clamp away 0 so the noise is finite; float64 keeps distinct draws distinct.
    return (-torch.log(-torch.log(u.clamp_min(1e-300)))).to(torch.float32)
