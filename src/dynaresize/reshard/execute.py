"""Execute a transfer plan on one rank: point-to-point messages through a bounded staging buffer.

Every rank that holds an old shard or will hold a new one calls `execute_plan` with the same
plan (computed identically everywhere by `plan.transfer_plan`). The rank walks the plan in its
global order and acts only on the transfers that name it:
- src == dst == rank: copy the range from the old shard into the new shard (no message);
- src == rank: pack the range of every moved state kind into the staging buffer, as bytes,
  one kind after another in sorted-name order, and `send` it as one message;
- dst == rank: `recv` one message into the staging buffer and unpack it into the new shards.

Bounded staging: the staging buffer is allocated once, sized to the largest packed chunk this
rank moves, and never more than `staging_bytes` (a plan whose chunk would exceed it is refused
before anything moves). `ReshardStats.peak_staging_bytes` is that allocation, and 0 on a rank
that only copies locally.

Deadlock freedom: sends and recvs block (assume, worst case, that a send returns only once
its matching recv is posted). Suppose some ranks were stuck forever. Each stuck rank is blocked
on its *current* transfer: the first transfer naming it that it has not finished. Let t be the
earliest, in the global order, of the stuck ranks' current transfers, blocked on rank a with
partner b. Every transfer naming b that comes before t has been finished by b: otherwise b's
current transfer would be earlier than t, and b, not finished, would be stuck (a rank that is
not blocked makes progress, and there are finitely many transfers), contradicting the choice of
t. So b's current transfer is t too, both sides of t are posted, and t completes: contradiction.
Each transfer involves only its two ranks, so ranks outside a pair never wait on it, and
disjoint pairs proceed in parallel (the plan interleaves pieces round-robin for that reason).

Kinds: state kinds may have different dtypes (fp32 params and moments, int64 counters); they
travel together as bytes (uint8 views), so one message per chunk carries all of them. A caller
may move a subset of kinds (`kinds=`) on a group of its choice (`group=`), e.g. parameters on
the critical path first, optimizer moments later on another group in a background thread;
moving the kinds in two passes gives exactly the result of one pass. Two concurrent calls must
use different groups. Tensors may live on CUDA (the staging buffer is then on the same device,
and the backend must be NCCL).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from dynaresize.reshard.layout import FlatLayout
from dynaresize.reshard.plan import Transfer, chunk_elems_for, transfer_plan


@dataclass(frozen=True)
class ReshardStats:
    """What one rank did in one `execute_plan` call."""

    bytes_sent: int
    bytes_received: int
    peak_staging_bytes: int
    seconds: float
    num_messages: int
    bytes_local: int = 0  # copied in place (src == dst), no message

    def to_dict(self) -> dict:
        return asdict(self)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def execute_plan(
    plan: Sequence[Transfer],
    *,
    rank: int,
    old_shards: Mapping[str, torch.Tensor] | None,
    new_numel_local: int,
    group: dist.ProcessGroup | None = None,
    staging_bytes: int,
    kinds: Iterable[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """Move this rank's part of `plan`; return its new shards (1-D, `new_numel_local` each).

    `old_shards` maps kind -> this rank's old shard (1-D, contiguous); None (or empty tensors)
    on a rank that held no old shard, which then passes `dtypes` (kind -> dtype) and `device`.
    `kinds` selects the kinds to move (default: all); every rank of the plan must pass the same
    kinds with the same dtypes. `group` carries the messages (None: the world); `src`/`dst` are
    world ranks. Raises ValueError, before any message, when the plan disagrees with the shards
    or a chunk's packed bytes exceed `staging_bytes`.
    """
    start = time.perf_counter()
    old = dict(old_shards or {})
    names = sorted(kinds if kinds is not None else (old or dtypes or {}).keys())
    if not names:
        raise ValueError("kinds: nothing to move (no old_shards, dtypes or kinds given)")
    kind_dtypes: dict[str, torch.dtype] = {}
    for k in names:
        if k in old:
            kind_dtypes[k] = old[k].dtype
            if dtypes and k in dtypes and dtypes[k] != old[k].dtype:
                raise ValueError(f"dtypes: {k} is {dtypes[k]} but its old shard is {old[k].dtype}")
        elif dtypes and k in dtypes:
            kind_dtypes[k] = dtypes[k]
        else:
            raise ValueError(f"kinds: {k!r} has neither an old shard nor a dtype on rank {rank}")
    if device is None:
        device = next((old[k].device for k in names if k in old), torch.device("cpu"))
    device = torch.device(device)
    sizes = {k: _element_size(kind_dtypes[k]) for k in names}
    bytes_per_elem = sum(sizes.values())

    mine = [t for t in plan if t.src == rank or t.dst == rank]
    sent = [t for t in mine if t.src == rank]
    received = [t for t in mine if t.dst == rank]
    old_lo = min((t.lo for t in sent), default=0)
    new_lo = min((t.lo for t in received), default=0)
    old_numel = sum(t.numel for t in sent)
    if sum(t.numel for t in received) != new_numel_local:
        raise ValueError(
            f"new_numel_local: {new_numel_local} on rank {rank}, but the plan delivers "
            f"{sum(t.numel for t in received)} elements to it"
        )
    src_flat: dict[str, torch.Tensor] = {}
    for k in names:
        if k not in old:
            if old_numel:
                raise ValueError(f"old_shards: rank {rank} sends {old_numel} elements but has no {k!r} shard")
            continue
        shard = old[k]
        if shard.numel() != old_numel or not shard.is_contiguous():
            raise ValueError(
                f"old_shards: {k!r} on rank {rank} must be contiguous with {old_numel} elements, "
                f"got shape {tuple(shard.shape)}"
            )
        src_flat[k] = shard.reshape(-1)
    remote = [t for t in mine if not t.is_local]
    need = max((t.numel * bytes_per_elem for t in remote), default=0)
    if need > staging_bytes:
        raise ValueError(
            f"staging_bytes: a chunk of {need} packed bytes exceeds the bound {staging_bytes}; "
            f"plan with chunk_elems_for({staging_bytes}, {bytes_per_elem})"
        )

    new = {k: torch.empty(new_numel_local, dtype=kind_dtypes[k], device=device) for k in names}
    new_bytes = {k: new[k].view(torch.uint8) for k in names}
    old_bytes = {k: src_flat[k].view(torch.uint8) for k in src_flat}
    staging = torch.empty(need, dtype=torch.uint8, device=device) if need else None
    num_sent = num_received = num_local = num_messages = 0

    for t in mine:
        n = t.numel
        if t.is_local:
            for k in names:
                s = sizes[k]
                a, b = (t.lo - new_lo) * s, (t.hi - new_lo) * s
                new_bytes[k][a:b].copy_(old_bytes[k][(t.lo - old_lo) * s : (t.hi - old_lo) * s])
            num_local += n * bytes_per_elem
        elif t.src == rank:
            off = 0
            for k in names:
                nb = n * sizes[k]
                a = (t.lo - old_lo) * sizes[k]
                staging[off : off + nb].copy_(old_bytes[k][a : a + nb])
                off += nb
            dist.send(staging[:off], dst=t.dst, group=group)
            num_sent += off
            num_messages += 1
        else:
            total = n * bytes_per_elem
            dist.recv(staging[:total], src=t.src, group=group)
            off = 0
            for k in names:
                nb = n * sizes[k]
                a = (t.lo - new_lo) * sizes[k]
                new_bytes[k][a : a + nb].copy_(staging[off : off + nb])
                off += nb
            num_received += total
            num_messages += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # so `seconds` covers the transfers, not their launch
    stats = ReshardStats(
        bytes_sent=num_sent,
        bytes_received=num_received,
        peak_staging_bytes=0 if staging is None else staging.numel(),
        seconds=time.perf_counter() - start,
        num_messages=num_messages,
        bytes_local=num_local,
    )
    return new, stats


def reshard_flat(
    old_shards: Mapping[str, torch.Tensor] | None,
    *,
    numel: int,
    old_ranks: Iterable[int],
    new_ranks: Iterable[int],
    rank: int,
    staging_bytes: int,
    group: dist.ProcessGroup | None = None,
    kinds: Iterable[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """Plan and execute in one call: move `kinds` of a flat state of `numel` elements per kind
    from a `FlatLayout` over `old_ranks` to one over `new_ranks`. Called by every rank in
    `old_ranks | new_ranks` with the same arguments except `rank`, `old_shards` (and `device`).
    The chunk size is the largest whose packed kinds fit `staging_bytes`.
    """
    old_ranks, new_ranks = tuple(old_ranks), tuple(new_ranks)
    old = dict(old_shards or {})
    names = sorted(kinds if kinds is not None else (old or dtypes or {}).keys())
    spec = {k: (old[k].dtype if k in old else (dtypes or {}).get(k)) for k in names}
    missing = [k for k, d in spec.items() if d is None]
    if missing:
        raise ValueError(f"kinds: {missing} have neither an old shard nor a dtype on rank {rank}")
    bytes_per_elem = sum(_element_size(d) for d in spec.values())
    plan = transfer_plan(numel, old_ranks, new_ranks, chunk_elems=chunk_elems_for(staging_bytes, bytes_per_elem))
    return execute_plan(
        plan,
        rank=rank,
        old_shards=old,
        new_numel_local=FlatLayout(numel, new_ranks).local_numel(rank),
        group=group,
        staging_bytes=staging_bytes,
        kinds=names,
        dtypes=dtypes,
        device=device,
    )
