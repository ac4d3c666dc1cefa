"""Weight sync from the trainers to the rollout devices, tagged with the policy version.

After each training step the lowest training device broadcasts the full current weights as one
flat fp32 vector over the cached weight-sync group ({sync root} + rollout devices); receivers
unflatten it into a state dict in the fixed parameter order of `model.named_parameters()`
(the same order the trainer flattens in, so no names cross the wire). One collective per sync,
not one per tensor: per-tensor messages are what made published syncs slow (REFERENCES 3.2:
open-instruct's per-parameter RPCs took >120 s before batching; SGLang bucketed sync 130 -> 7 s).

Invariant: a receiver's state dict is bit-identical to the sender's parameters.
"""

from __future__ import annotations

from typing import Iterable

import torch


def param_specs(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the fixed flattening order."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def flatten_params(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one contiguous fp32 vector, in `param_specs` order."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in model.named_parameters()])


def unflatten(flat: torch.Tensor, specs: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Split a flat vector back into a state dict (views into `flat`)."""
    specs = list(specs)
    sizes = [int(torch.Size(shape).numel()) for _, shape in specs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flat weights have {flat.numel()} elements, the model needs {sum(sizes)}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for (name, shape), n in zip(specs, sizes):
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def broadcast_flat(flat: torch.Tensor | None, *, numel: int, src: int, group) -> torch.Tensor:
    """Broadcast a flat fp32 vector from global rank `src` over `group`; every member returns it."""
    import torch.distributed as dist

    buf = flat if flat is not None else torch.empty(numel, dtype=torch.float32)
    dist.broadcast(buf, src=src, group=group)
    return buf
