"""GRPO: group-relative advantages, fixed micro-batches, and the clipped policy-gradient loss.

Invariants (what keeps RL semantics fixed under resizes):
- `group_advantages` normalises each prompt's rewards by that prompt's own mean (and std); it
  sees nothing of devices or batches.
- `micro_batches` fixes micro-batch composition by sample id alone (sorted, then chunked), so
  it is the same whatever number of training devices later share the micro-batches out.
- `micro_batch_loss` divides by the step's loss denominator (`loss_denominator`: the response
  tokens of the whole step, or its sequence count for the seq-mean modes), so the step loss (and
  gradient) is the plain sum over micro-batches, whichever device computed which. A sample's
  loss depends on the other samples of its micro-batch only through right padding, which
  masking makes exact up to float rounding (~1e-7).

The loss per response token t of sample s (PPO clipping, verl's names in docs/training.md):
    ratio_t = exp(logp_t - old_logp_t)
    pg_t    = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))
    pg_t    = min(pg_t, -A * clip_ratio_c)         if A < 0 and clip_ratio_c > 0 (dual clip)
    l_t     = pg_t [* behaviour weight] + kl_coef * kl_t - entropy_coef * H_t
    kl_t    = logp_t - ref_logp_t                          (estimator k1)
            = exp(ref - logp) - (ref - logp) - 1            (estimator k3, "low-variance KL")
and the step loss is sum_s w_s * sum_t l_t / D (`loss_agg_mode`, n_s = tokens of sample s,
T = the step's response tokens, N = its sequences, L = the response budget):
    token-mean               w_s = 1        D = T
    seq-mean-token-sum       w_s = 1        D = N
    seq-mean-token-mean      w_s = 1 / n_s  D = N
    seq-mean-token-sum-norm  w_s = 1 / L    D = N   (Dr. GRPO)
Multi-turn samples (roles/multiturn.py) carry a loss mask over their response: 1 on the model's
tokens, 0 on the observations' (tool results, environment text). Every sum over t above (the
policy gradient, the behaviour weight, the KL and entropy terms, the clip and ratio statistics)
runs over the masked-in tokens only, and n_s and T count only those: an observation token is
context, never a target. An empty mask means every response token is the model's.

logp is taken under the sampling distribution (logits / temperature), matching the log-probs
the rollout engine returns, and `old_logp` are the behaviour log-probs the trainer was given
(the engine's, or recomputed: see the worker). H_t is the entropy of the sampling distribution
at each response position (with gradient only when entropy_coef != 0; always reported).
"""

from __future__ import annotations

import dataclasses

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynaresize.rl.logprobs import chunked_token_logprobs, supports_chunking

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
    loss_mask: tuple[int, ...] = ()  # multi-turn: 1 per model token, 0 per observation token; empty: all 1

    @property
    def num_model_tokens(self) -> int:
        """The response tokens the loss counts (the model's own)."""
        return sum(1 for m in self.loss_mask if m) if self.loss_mask else len(self.response_ids)

    def with_logprobs(self, logprobs: Sequence[float]) -> "TrainSample":
        """The same sample with proximal log-probs recomputed by the trainers."""
        if len(logprobs) != len(self.response_ids):
            raise ValueError(f"sample {self.sample_id}: {len(logprobs)} log-probs for {len(self.response_ids)} tokens")
        return dataclasses.replace(self, prox_logprobs=[float(x) for x in logprobs])


ADV_STD = ("sample", "population")


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6, *, norm_by_std: bool = True,
                     std: str = "population") -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of `group_size` rewards, or
    r - mean with `norm_by_std` False (Dr. GRPO).

    `rewards` is ordered prompt by prompt (all samples of prompt 0, then prompt 1, ...). `std`
    names the estimator: `population` (ddof=0) or `sample` (ddof=1, Bessel's correction, as
    verl's and TRL's GRPO: x sqrt(G/(G-1)) of the population std, 1.155 at G=4), which needs
    groups of 2 or more. A group with equal rewards gets zero advantages.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    if std not in ADV_STD:
        raise ValueError(f"std {std!r}: must be one of {ADV_STD}")
    ddof = 1 if std == "sample" else 0
    if norm_by_std and group_size <= ddof:
        raise ValueError(f"the sample std of a group of {group_size} is undefined")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = math.fsum(group) / group_size
        if not norm_by_std:
            out.extend(r - mean for r in group)
            continue
        std_dev = math.sqrt(math.fsum((r - mean) ** 2 for r in group) / (group_size - ddof))
        out.extend((r - mean) / (std_dev + eps) for r in group)
    return out


def micro_batches(samples: Sequence[TrainSample], micro_batch_size: int) -> list[list[TrainSample]]:
    """Samples sorted by id, chunked into micro-batches of `micro_batch_size` (the last may be short)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    ordered = sorted(samples, key=lambda s: tuple(s.sample_id))
    return [ordered[i:i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def total_response_tokens(samples: Sequence[TrainSample]) -> int:
    """The token count of a step: the model's response tokens over all its samples (at least 1;
    observation tokens of multi-turn samples are not counted); the loss denominator of
    `token-mean` (`loss_denominator`)."""
    return max(1, sum(s.num_model_tokens for s in samples))


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_denominator(loss_agg_mode: str, *, tokens: int, sequences: int) -> int:
    """D of the module docstring: the step's response tokens (`token-mean`) or its sequences
    (the seq-mean modes); counts of the whole step, never of one device's share."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r}: must be one of {LOSS_AGG_MODES}")
    return max(1, int(tokens if loss_agg_mode == "token-mean" else sequences))


def _sequence_sum(tok_loss: torch.Tensor, loss_agg_mode: str, max_response_tokens: int | None) -> torch.Tensor:
    """w_s * sum_t l_t of the module docstring (`tok_loss` holds the masked-in tokens only)."""
    if loss_agg_mode == "seq-mean-token-mean":
        return tok_loss.sum() / max(1, tok_loss.numel())
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if not max_response_tokens or max_response_tokens < 1:
            raise ValueError("seq-mean-token-sum-norm needs max_response_tokens >= 1 (the response budget)")
        return tok_loss.sum() / max_response_tokens
    return tok_loss.sum()


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
                      entropies: list[torch.Tensor] | None = None,
                      entropy_grad: bool = False, chunk_tokens: int = 0) -> list[torch.Tensor]:
    """Per-sample log-probs of the response tokens under `model` (logits / temperature).

    One right-padded forward pass with an attention mask; gradients flow when enabled. With
    `entropies` a list, it receives each sample's per-position entropy (detached, unless
    `entropy_grad`: then it carries the gradient, for an entropy term in the loss). With
    `chunk_tokens` > 0 (`train.logprob_chunk_tokens`) the output head runs on response positions
    only, that many at a time, never holding the whole fp32 logits (rl/logprobs.py).
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
    if chunk_tokens > 0 and supports_chunking(model):
        return _chunked(model, micro_batch, input_ids, mask, temperature=temperature, entropies=entropies,
                        entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    out = []
    for i, s in enumerate(micro_batch):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        if n_resp == 0:
            out.append(logits.new_zeros(0))
            if entropies is not None:
                entropies.append(logits.new_zeros(0) if entropy_grad else logits.new_zeros(0).detach())
            continue
        # Position j predicts token j+1: the response tokens are predicted at n_prompt-1 ...
        rows = logits[i, n_prompt - 1:n_prompt - 1 + n_resp].float() / temperature
        targets = input_ids[i, n_prompt:n_prompt + n_resp]
        logp_all = torch.log_softmax(rows, dim=-1)
        out.append(logp_all.gather(-1, targets[:, None]).squeeze(-1))
        if entropies is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(-(logp_all.exp() * logp_all).sum(-1))
    return out


def _chunked(model: torch.nn.Module, micro_batch: Sequence[TrainSample], input_ids: torch.Tensor,
             mask: torch.Tensor, *, temperature: float, entropies: list[torch.Tensor] | None,
             entropy_grad: bool, chunk_tokens: int) -> list[torch.Tensor]:
    """`response_logprobs` through `rl.logprobs.chunked_token_logprobs`: the same positions
    (position j predicts token j+1), the same values up to float rounding."""
    rows, cols, sizes = [], [], []
    for i, s in enumerate(micro_batch):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        rows += [i] * n_resp
        cols += range(n_prompt - 1, n_prompt - 1 + n_resp)
        sizes.append(n_resp)
    rows_t = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
    cols_t = torch.tensor(cols, dtype=torch.long, device=input_ids.device)
    logp, ent = chunked_token_logprobs(model, input_ids, mask, rows_t, cols_t, input_ids[rows_t, cols_t + 1],
                                       temperature=temperature, chunk_tokens=chunk_tokens)
    if entropies is not None:
        keep_grad = entropy_grad and torch.is_grad_enabled()
        entropies.extend(e if keep_grad else e.detach() for e in torch.split(ent, sizes))
    return list(torch.split(logp, sizes))


def micro_batch_loss(model: torch.nn.Module, micro_batch: Sequence[TrainSample], *,
                     total_response_tokens: int | None = None, clip_eps: float, kl_coef: float = 0.0,
                     ref_logprobs: Sequence[Sequence[float] | torch.Tensor] | None = None,
                     kl_estimator: str = "k3", temperature: float = 1.0, pad_id: int = 0,
                     stats: dict | None = None, denominator: float | None = None,
                     loss_agg_mode: str = "token-mean", max_response_tokens: int | None = None,
                     clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                     clip_ratio_c: float = 0.0, entropy_coef: float = 0.0, chunk_tokens: int = 0) -> torch.Tensor:
    """The clipped policy-gradient loss of one micro-batch, normalised by the whole step.

    `denominator` is D of the module docstring for the whole step (all micro-batches on all
    devices; `loss_denominator`), so summing this over the step's micro-batches gives the step
    loss; `total_response_tokens` is the same for `token-mean` (give one of the two).
    `max_response_tokens` is L of `seq-mean-token-sum-norm` (the response budget).
    `clip_ratio_low`/`clip_ratio_high` default to `clip_eps`; `clip_ratio_c` > 1 turns on the
    dual clip of negative advantages (0: off). `ref_logprobs` (one sequence per sample) is needed
    when `kl_coef > 0` (and, given, the KL is reported even at coefficient 0). If `stats` is a
    dict, it receives the sums `loss_sum`, `clipped_tokens`, `dual_clipped_tokens`, `kl_sum`,
    `entropy_sum`, `ratio_sum` and `num_tokens` of this micro-batch (sums, so devices can add
    them up).
    """
    if (denominator is None) == (total_response_tokens is None):
        raise ValueError("give one of denominator and total_response_tokens")
    denom = float(total_response_tokens if denominator is None else denominator)
    if denom <= 0:
        raise ValueError(f"the loss denominator must be > 0, got {denom}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r}: must be one of {LOSS_AGG_MODES}")
    if clip_ratio_c and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or 0: no dual clip), got {clip_ratio_c}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {kl_estimator!r}: must be one of {KL_ESTIMATORS}")
    low = clip_eps if clip_ratio_low is None else clip_ratio_low
    high = clip_eps if clip_ratio_high is None else clip_ratio_high
    ents: list[torch.Tensor] = []
    logps = response_logprobs(model, micro_batch, temperature=temperature, pad_id=pad_id, entropies=ents,
                              entropy_grad=entropy_coef != 0, chunk_tokens=chunk_tokens)
    total = None
    clipped = dual_clipped = kl_sum = ratio_sum = entropy_sum = 0.0
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
        ref_i = None if ref_logprobs is None else torch.as_tensor(ref_logprobs[i], dtype=logp.dtype, device=logp.device)
        ent = ents[i]
        if s.loss_mask:  # multi-turn: the model's tokens only (observation tokens are context)
            if len(s.loss_mask) != logp.numel():
                raise ValueError(f"sample {s.sample_id}: loss mask of {len(s.loss_mask)} for {logp.numel()} tokens")
            keep = torch.as_tensor(s.loss_mask, device=logp.device).bool()
            logp, behaviour, old, ent = logp[keep], behaviour[keep], old[keep], ent[keep]
            ref_i = None if ref_i is None else ref_i[keep]
            if logp.numel() == 0:
                continue
        ratio = torch.exp(logp - old)
        adv = float(s.advantage)
        unclipped = -adv * ratio
        clipped_loss = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
        tok_loss = torch.maximum(unclipped, clipped_loss)
        if clip_ratio_c and adv < 0:  # dual clip: the loss of a negative advantage is capped at -A * c
            cap = -adv * clip_ratio_c
            dual_clipped += float((tok_loss.detach() > cap).sum())
            tok_loss = torch.clamp(tok_loss, max=cap)
        if s.prox_logprobs is not None:
            tok_loss = tok_loss * torch.exp(old - behaviour).clamp(max=BEHAVIOUR_WEIGHT_CAP)
        if ref_i is not None:
            ref = ref_i
            if kl_estimator == "k1":
                kl = logp - ref
            else:
                delta = ref - logp
                kl = torch.exp(delta) - delta - 1.0
            if kl_coef > 0:
                tok_loss = tok_loss + kl_coef * kl
            kl_sum += float(kl.detach().sum())
        if entropy_coef != 0:
            tok_loss = tok_loss - entropy_coef * ent
        part = _sequence_sum(tok_loss, loss_agg_mode, max_response_tokens)
        total = part if total is None else total + part
        clipped += float((clipped_loss.detach() > unclipped.detach()).sum())
        ratio_sum += float(ratio.detach().sum())
        entropy_sum += float(ent.detach().sum())
        num_tokens += logp.numel()
    if total is None:  # no response tokens: a zero that still depends on the parameters
        loss = sum(p.sum() for p in model.parameters()) * 0.0
    else:
        loss = total / denom
    if stats is not None:
        stats.update(loss_sum=float(loss.detach()), clipped_tokens=clipped, dual_clipped_tokens=dual_clipped,
                     kl_sum=kl_sum, ratio_sum=ratio_sum, entropy_sum=entropy_sum, num_tokens=num_tokens)
    return loss
