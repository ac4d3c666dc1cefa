"""Per-token log-probs of a micro-batch's responses without the whole fp32 logits.

The loss needs, at each response position, the log-prob of the token that follows (and the
entropy of the distribution there). Taking the model's full logits costs B x T x V values (a
7B's 152k vocabulary: 2.4 GB in fp32 per 4k-token sequence, and the log-softmax as much again,
kept for backward). Here the model's output head is computed only at response positions, in
chunks of `chunk_tokens` rows, each under activation checkpointing: a chunk's logits exist only
while it is computed, in forward and again in backward. The result equals the whole-logits path
up to float rounding (tests/unit/test_logprobs.py: within 1e-6 in fp32).

How: for the length of one forward, the output head's `forward` (an `nn.Linear`,
`get_output_embeddings()`) is replaced by a function that does the above on the final hidden
states it is given and returns (log-prob, entropy) per response position in place of logits.
It runs inside the model's own forward, so a sharded model (FSDP2) has its head's weights
gathered as for the plain path; parameter names and the module tree are untouched. Models that
change logits after the head (final logit soft-capping) are not eligible: `supports_chunking`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def supports_chunking(model: torch.nn.Module) -> bool:
    """True when the model's logits are its output head's plain linear output."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    return (isinstance(head, torch.nn.Linear) and not getattr(config, "final_logit_softcapping", None)
            and not getattr(config, "logit_scale", None))


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperature: float) -> torch.Tensor:
    logp_all = torch.log_softmax(F.linear(hidden, weight, bias).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.stack([logp, entropy], dim=-1)


@contextmanager
def _head_replaced(head: torch.nn.Module, fn) -> Iterator[None]:
    head.forward = fn  # an instance attribute shadows the class's forward for this call only
    try:
        yield
    finally:
        del head.forward


def chunked_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, entropy) of `targets[k]` at position (`rows[k]`, `cols[k]`) of the batch, each
    [N]; the entropy carries the gradient too (the caller detaches it when the loss has none)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head = model.get_output_embeddings()
    grad = torch.is_grad_enabled()

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[rows, cols]
        parts = []
        for lo in range(0, picked.shape[0], chunk_tokens):
            args = (picked[lo:lo + chunk_tokens], head.weight, head.bias, targets[lo:lo + chunk_tokens], temperature)
            parts.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
        out = torch.cat(parts) if parts else picked.new_zeros((0, 2), dtype=torch.float32)
        return out[None]  # [1, N, 2]: shaped like logits for any code after the head

    with _head_replaced(head, head_forward):
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits[0]
    return out[:, 0], out[:, 1]
