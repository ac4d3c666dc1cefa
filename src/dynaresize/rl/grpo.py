"""GRPO: group-relative advantages, fixed micro-batches, and the clipped policy-gradient loss.

Invariants (what keeps RL semantics fixed under resizes):
- `group_advantages` normalises each prompt's rewards by that prompt's own mean and std; it
  sees nothing of devices or batches.
- `micro_batches` fixes micro-batch composition by sample id alone (sorted, then chunked), so
  it is the same whatever number of training devices later share the micro-batches out.
- `micro_batch_loss` sums token losses and divides by the response-token count of the whole
  step, so the step loss (and gradient) is the plain sum over micro-batches, whichever device
  computed which. A sample's loss depends on the other samples of its micro-batch only through
  right padding, which masking makes exact up to float rounding (~1e-7).

The loss per response token t (DAPO-style token-level normalisation, PPO clipping):
    ratio_t = exp(logp_t - rollout_logp_t)
    loss_t  = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_eps, 1 + clip_eps))
              + kl_coef * kl_t
    kl_t    = logp_t - ref_logp_t                          (estimator k1)
            = exp(ref - logp) - (ref - logp) - 1            (estimator k3, "low-variance KL")
where logp is taken under the sampling distribution (logits / temperature), matching the
log-probs the rollout engine returns, and `rollout_logp` are the behaviour log-probs the
trainer was given (the engine's, or recomputed: see the worker). The entropy reported is that
of the sampling distribution at each response position (a statistic; not in the loss).
"""

from __future__ import annotations

import dataclasses

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SampleId = tuple[int, int, int]


@dataclass(frozen=True)
class TrainSample:
    """One generated sample ready for training (plain data: pickles across processes)."""

    sample_id: SampleId  # (step, prompt_index, sample_index)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, from the rollout engine (the behaviour policy)
    advantage: float
    prox_logprobs: list[float] | None = None  # recomputed by the trainers before the update (decoupled PPO)

    def with_logprobs(self, logprobs: Sequence[float]) -> "TrainSample":
        """The same sample with proximal log-probs recomputed by the trainers."""
        if len(logprobs) != len(self.response_ids):
            raise ValueError(f"sample {self.sample_id}: {len(logprobs)} log-probs for {len(self.response_ids)} tokens")
        return dataclasses.replace(self, prox_logprobs=[float(x) for x in logprobs])


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of `group_size` rewards.

    `rewards` is ordered prompt by prompt (all samples of prompt 0, then prompt 1, ...). The
    std is the population std (ddof=0); a group with equal rewards gets zero advantages.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = math.fsum(group) / group_size
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in group) / group_size)
        out.extend((r - mean) / (std + eps) for r in group)
    return out


def micro_batches(samples: Sequence[TrainSample], micro_batch_size: int) -> list[list[TrainSample]]:
    """Samples sorted by id, chunked into micro-batches of `micro_batch_size` (the last may be short)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    ordered = sorted(samples, key=lambda s: tuple(s.sample_id))
    return [ordered[i:i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def total_response_tokens(samples: Sequence[TrainSample]) -> int:
    """The loss denominator of a step: response tokens over all its samples (at least 1)."""
    return max(1, sum(len(s.response_ids) for s in samples))


KL_ESTIMATORS = ("k1", "k3")
# Decoupled PPO (AReaL, arXiv:2505.24298): with proximal log-probs the clipped ratio is taken
# against the proximal policy (the trainers' weights before this update, same kernels as the
# loss), and each token is weighted by behaviour -> proximal importance, capped so that a
# token the engine sampled at a much lower probability cannot dominate the step.
BEHAVIOUR_WEIGHT_CAP = 5.0


def dummy_micro_batch() -> list[TrainSample]:
    """A one-token sample a trainer with no micro-batch in a round runs (its loss is scaled by
    0), so that every rank calls the same modules, hence the same collectives."""
    return [TrainSample(sample_id=(-1, -1, -1), prompt_ids=[0], response_ids=[0], rollout_logprobs=[0.0],
                        advantage=0.0)]


def response_logprobs(model: torch.nn.Module, micro_batch: Sequence[TrainSample], *,
                      temperature: float = 1.0, pad_id: int = 0,
                      entropies: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per-sample log-probs of the response tokens under `model` (logits / temperature).

    One right-padded forward pass with an attention mask; gradients flow when enabled. With
    `entropies` a list, it receives each sample's per-position entropy (detached).
    """
    if not micro_batch:
        return []
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in micro_batch]
    width = max(len(x) for x in seqs)
    device = next(model.parameters()).device
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, seq in enumerate(seqs):
        input_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, :len(seq)] = 1
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    out = []
    for i, s in enumerate(micro_batch):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        if n_resp == 0:
            out.append(logits.new_zeros(0))
            if entropies is not None:
                entropies.append(logits.new_zeros(0).detach())
            continue
        # Position j predicts token j+1: the response tokens are predicted at n_prompt-1 ...
        rows = logits[i, n_prompt - 1:n_prompt - 1 + n_resp].float() / temperature
        targets = input_ids[i, n_prompt:n_prompt + n_resp]
        logp_all = torch.log_softmax(rows, dim=-1)
        out.append(logp_all.gather(-1, targets[:, None]).squeeze(-1))
        if entropies is not None:
            with torch.no_grad():
                entropies.append(-(logp_all.exp() * logp_all).sum(-1))
    return out


def micro_batch_loss(model: torch.nn.Module, micro_batch: Sequence[TrainSample], *,
                     total_response_tokens: int, clip_eps: float, kl_coef: float = 0.0,
                     ref_logprobs: Sequence[Sequence[float] | torch.Tensor] | None = None,
                     kl_estimator: str = "k3", temperature: float = 1.0, pad_id: int = 0,
                     stats: dict | None = None) -> torch.Tensor:
    """The clipped policy-gradient loss of one micro-batch, normalised by the whole step.

    `total_response_tokens` counts the response tokens of every sample of the step (all
    micro-batches on all devices), so summing this over the step's micro-batches gives the
    step loss. `ref_logprobs` (one sequence per sample) is needed when `kl_coef > 0` (and,
    given, the KL is reported even at coefficient 0). If `stats` is a dict, it receives the
    sums `loss_sum`, `clipped_tokens`, `kl_sum`, `entropy_sum`, `ratio_sum` and `num_tokens` of
    this micro-batch (sums, so devices can add them up).
    """
    if total_response_tokens < 1:
        raise ValueError(f"total_response_tokens must be >= 1, got {total_response_tokens}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {kl_estimator!r}: must be one of {KL_ESTIMATORS}")
    ents: list[torch.Tensor] = []
    logps = response_logprobs(model, micro_batch, temperature=temperature, pad_id=pad_id, entropies=ents)
    total = None
    clipped = kl_sum = ratio_sum = entropy_sum = 0.0
    num_tokens = 0
    for i, (s, logp) in enumerate(zip(micro_batch, logps)):
        if logp.numel() == 0:
            continue
        if len(s.rollout_logprobs) != logp.numel():
            raise ValueError(f"sample {s.sample_id}: {len(s.rollout_logprobs)} rollout log-probs for "
                             f"{logp.numel()} response tokens")
        behaviour = torch.as_tensor(s.rollout_logprobs, dtype=logp.dtype, device=logp.device)
        old = behaviour if s.prox_logprobs is None else torch.as_tensor(s.prox_logprobs, dtype=logp.dtype,
                                                                        device=logp.device)
        ratio = torch.exp(logp - old)
        adv = float(s.advantage)
        unclipped = -adv * ratio
        clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        tok_loss = torch.maximum(unclipped, clipped_loss)
        if s.prox_logprobs is not None:
            tok_loss = tok_loss * torch.exp(old - behaviour).clamp(max=BEHAVIOUR_WEIGHT_CAP)
        if ref_logprobs is not None:
            ref = torch.as_tensor(ref_logprobs[i], dtype=logp.dtype, device=logp.device)
            if kl_estimator == "k1":
                kl = logp - ref
            else:
                delta = ref - logp
                kl = torch.exp(delta) - delta - 1.0
            if kl_coef > 0:
                tok_loss = tok_loss + kl_coef * kl
            kl_sum += float(kl.detach().sum())
        part = tok_loss.sum()
        total = part if total is None else total + part
        clipped += float((clipped_loss.detach() > unclipped.detach()).sum())
        ratio_sum += float(ratio.detach().sum())
        entropy_sum += float(ents[i].sum())
        num_tokens += logp.numel()
    if total is None:  # no response tokens: a zero that still depends on the parameters
        loss = sum(p.sum() for p in model.parameters()) * 0.0
    else:
        loss = total / total_response_tokens
    if stats is not None:
        stats.update(loss_sum=float(loss.detach()), clipped_tokens=clipped, kl_sum=kl_sum, ratio_sum=ratio_sum,
                     entropy_sum=entropy_sum, num_tokens=num_tokens)
    return loss
