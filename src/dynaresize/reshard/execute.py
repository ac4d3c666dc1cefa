"""Execute a transfer plan on one rank: point-to-point messages through a bounded staging buffer.

Every rank that holds an old shard or will hold a new one calls `execute_plan` with the same
plan (computed identically everywhere by `plan.layout_plan` from the old and new layouts). The rank walks the plan in its
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

Point to point, on the caller's communicator (NCCL semantics; docs/faults.md): every message
is one batched P2P op (`dist.batch_isend_irecv`), waited for before the next. NCCL runs a
batch on the group's own communicator (ncclGroupStart/End over it), where a lone
`dist.send`/`recv` may make a 2-rank communicator per pair on first use (torch versions without
eager P2P reuse): a hidden group creation on the first resize's critical path, counted nowhere.
Batching a whole round at once would need a staging buffer per message in flight; one op per
batch keeps the staging bound and the deadlock argument above (a wait is a blocking transfer).
On gloo (no coalescing) the batch is a plain isend/irecv.

Local storage: a rank's state of a kind is its pieces of the layout in ascending order (see
reshard/layout.py), given either as one flat tensor (the pieces concatenated) or as one 1-D
tensor per piece (live views into a trainer's own storage, e.g. FSDP2's local shards, so no
copy of the state is made to send it; `out=` likewise receives into the new trainer's own
storage).

Kinds: state kinds may have different dtypes (fp32 params and moments, int64 counters); they
travel together as bytes (uint8 views), so one message per chunk carries all of them. A caller
may move a subset of kinds (`kinds=`) on a group of its choice (`group=`), e.g. parameters on
the critical path first, optimizer moments later on another group (cluster/handoff.py);
moving the kinds in two passes gives exactly the result of one pass. Two concurrent calls must
use different groups. Tensors may live on CUDA (the staging buffer is then on the same device,
and the backend must be NCCL).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from dynaresize.reshard.layout import FlatLayout, Layout
from dynaresize.reshard.plan import Transfer, chunk_elems_for, layout_plan


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

    def __add__(self, other: "ReshardStats") -> "ReshardStats":
        return ReshardStats(bytes_sent=self.bytes_sent + other.bytes_sent,
                            bytes_received=self.bytes_received + other.bytes_received,
                            peak_staging_bytes=max(self.peak_staging_bytes, other.peak_staging_bytes),
                            seconds=self.seconds + other.seconds, num_messages=self.num_messages + other.num_messages,
                            bytes_local=self.bytes_local + other.bytes_local)


NO_STATS = ReshardStats(bytes_sent=0, bytes_received=0, peak_staging_bytes=0, seconds=0.0, num_messages=0)
Storage = torch.Tensor | Sequence[torch.Tensor]  # one flat tensor, or one 1-D tensor per piece


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Book:
    """Where each global range of one rank's pieces lives in its local tensors of one kind."""

    def __init__(self, pieces: Sequence[tuple[int, int]], storage: Storage, what: str) -> None:
        sizes = [hi - lo for lo, hi in pieces]
        if isinstance(storage, torch.Tensor):
            if storage.dim() != 1 or storage.numel() != sum(sizes) or not storage.is_contiguous():
                raise ValueError(f"{what}: must be contiguous 1-D with {sum(sizes)} elements, "
                                 f"got shape {tuple(storage.shape)}")
            tensors = list(storage.split(sizes)) if sizes else []
        else:
            tensors = [t for t in storage if t.numel()]  # empty pieces are not pieces
            if [t.numel() for t in tensors] != sizes or any(t.dim() != 1 or not t.is_contiguous() for t in tensors):
                raise ValueError(f"{what}: pieces of sizes {[t.numel() for t in tensors]}, layout says {sizes}")
        self.pieces, self.tensors = list(pieces), tensors
        self.starts = [lo for lo, _ in pieces]

    def bytes(self, lo: int, hi: int) -> torch.Tensor:
        i = bisect.bisect_right(self.starts, lo) - 1
        plo, phi = self.pieces[i] if i >= 0 else (0, 0)
        if i < 0 or hi > phi:
            raise ValueError(f"range [{lo}, {hi}) is not inside one local piece")
        return self.tensors[i][lo - plo:hi - plo].view(torch.uint8)


def _p2p(op, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> None:
    """One message to or from world rank `peer`, as a batched P2P op on `group`'s own
    communicator, waited for before the staging buffer is reused (module docstring: P2P)."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


def _contiguous_pieces(transfers: Sequence[Transfer], numel: int) -> list[tuple[int, int]]:
    """A single range starting at the lowest transfer (flat layouts without explicit pieces)."""
    lo = min((t.lo for t in transfers), default=0)
    return [(lo, lo + numel)] if numel else []


def execute_plan(
    plan: Sequence[Transfer],
    *,
    rank: int,
    old_shards: Mapping[str, Storage] | None,
    new_numel_local: int | None = None,
    old_pieces: Sequence[tuple[int, int]] | None = None,
    new_pieces: Sequence[tuple[int, int]] | None = None,
    out: Mapping[str, Storage] | None = None,
    group: dist.ProcessGroup | None = None,
    staging_bytes: int,
    kinds: Iterable[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, Storage], ReshardStats]:
    """Move this rank's part of `plan`; return its new state per kind and what it did.

    `old_shards` maps kind -> this rank's old storage (see the module docstring), laid out
    as `old_pieces` (default: one contiguous range); None (or empty) on a rank that held no old
    state, which then passes `dtypes` (kind -> dtype) and `device`. The new state goes into
    `out` (kind -> storage laid out as `new_pieces`) when given, else into new flat tensors of
    `new_numel_local` elements (or the total of `new_pieces`). `kinds` selects the kinds to
    move (default: all); every rank of the plan must pass the same kinds with the same dtypes.
    `group` carries the messages (None: the world); `src`/`dst` are world ranks. Raises
    ValueError, before any message, when the plan disagrees with the storage or a chunk's
    packed bytes exceed `staging_bytes`.
    """
    start = time.perf_counter()
    old = {k: v for k, v in (old_shards or {}).items()}
    names = sorted(kinds if kinds is not None else (old or dtypes or {}).keys())
    if not names:
        raise ValueError("kinds: nothing to move (no old_shards, dtypes or kinds given)")

    def dtype_of(storage: Storage) -> torch.dtype:
        return storage.dtype if isinstance(storage, torch.Tensor) else next(iter(storage)).dtype

    kind_dtypes: dict[str, torch.dtype] = {}
    for k in names:
        if k in old and (isinstance(old[k], torch.Tensor) or len(old[k])):
            kind_dtypes[k] = dtype_of(old[k])
            if dtypes and k in dtypes and dtypes[k] != kind_dtypes[k]:
                raise ValueError(f"dtypes: {k} is {dtypes[k]} but its old shard is {kind_dtypes[k]}")
        elif dtypes and k in dtypes:
            kind_dtypes[k] = dtypes[k]
        else:
            raise ValueError(f"kinds: {k!r} has neither an old shard nor a dtype on rank {rank}")
    if device is None:
        first = next((old[k] for k in names if k in old), None)
        device = torch.device("cpu") if first is None else (
            first.device if isinstance(first, torch.Tensor) else next(iter(first)).device)
    device = torch.device(device)
    sizes = {k: _element_size(kind_dtypes[k]) for k in names}
    bytes_per_elem = sum(sizes.values())

    mine = [t for t in plan if t.src == rank or t.dst == rank]
    sent = [t for t in mine if t.src == rank]
    received = [t for t in mine if t.dst == rank]
    old_numel = sum(t.numel for t in sent)
    if new_pieces is None:
        if new_numel_local is None:
            new_numel_local = sum(t.numel for t in received)
        new_pieces = _contiguous_pieces(received, new_numel_local)
    want = sum(hi - lo for lo, hi in new_pieces)
    if sum(t.numel for t in received) != want or (new_numel_local is not None and new_numel_local != want):
        raise ValueError(f"new_numel_local: {want} on rank {rank}, but the plan delivers "
                         f"{sum(t.numel for t in received)} elements to it")
    if old_pieces is None:
        old_pieces = _contiguous_pieces(sent, old_numel)
    if sum(hi - lo for lo, hi in old_pieces) != old_numel and old_numel:
        raise ValueError(f"old_pieces: {old_pieces} hold a different number of elements than rank {rank} sends "
                         f"({old_numel})")
    src_books: dict[str, _Book] = {}
    for k in names:
        if k not in old or not old_numel:
            if old_numel:
                raise ValueError(f"old_shards: rank {rank} sends {old_numel} elements but has no {k!r} shard")
            continue
        src_books[k] = _Book(old_pieces, old[k], f"old_shards: {k!r} on rank {rank}")
    remote = [t for t in mine if not t.is_local]
    need = max((t.numel * bytes_per_elem for t in remote), default=0)
    if need > staging_bytes:
        raise ValueError(
            f"staging_bytes: a chunk of {need} packed bytes exceeds the bound {staging_bytes}; "
            f"plan with chunk_elems_for({staging_bytes}, {bytes_per_elem})"
        )
    new: dict[str, Storage] = dict(out) if out is not None else {
        k: torch.empty(want, dtype=kind_dtypes[k], device=device) for k in names}
    dst_books = {k: _Book(new_pieces, new[k], f"out: {k!r} on rank {rank}") for k in names}
    staging = torch.empty(need, dtype=torch.uint8, device=device) if need else None
    num_sent = num_received = num_local = num_messages = 0

    for t in mine:
        if t.is_local:
            for k in names:
                dst_books[k].bytes(t.lo, t.hi).copy_(src_books[k].bytes(t.lo, t.hi))
            num_local += t.numel * bytes_per_elem
        elif t.src == rank:
            off = 0
            for k in names:
                piece = src_books[k].bytes(t.lo, t.hi)
                staging[off:off + piece.numel()].copy_(piece)
                off += piece.numel()
            _p2p(dist.isend, staging[:off], t.dst, group)
            num_sent += off
            num_messages += 1
        else:
            total = t.numel * bytes_per_elem
            _p2p(dist.irecv, staging[:total], t.src, group)
            off = 0
            for k in names:
                piece = dst_books[k].bytes(t.lo, t.hi)
                piece.copy_(staging[off:off + piece.numel()])
                off += piece.numel()
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


def reshard(
    old_shards: Mapping[str, Storage] | None,
    *,
    old_layout: Layout,
    new_layout: Layout,
    rank: int,
    staging_bytes: int,
    out: Mapping[str, Storage] | None = None,
    group: dist.ProcessGroup | None = None,
    kinds: Iterable[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, Storage], ReshardStats]:
    """Plan and execute in one call: move `kinds` of a state from `old_layout` to
    `new_layout`. Called by every rank of either layout with the same arguments except
    `rank`, `old_shards`, `out` (and `device`). The chunk size is the largest whose packed
    kinds fit `staging_bytes`.
    """
    old = dict(old_shards or {})
    names = sorted(kinds if kinds is not None else (old or dtypes or {}).keys())
    spec = {}
    for k in names:
        if k in old and (isinstance(old[k], torch.Tensor) or len(old[k])):
            spec[k] = old[k].dtype if isinstance(old[k], torch.Tensor) else next(iter(old[k])).dtype
        else:
            spec[k] = (dtypes or {}).get(k)
    missing = [k for k, d in spec.items() if d is None]
    if missing:
        raise ValueError(f"kinds: {missing} have neither an old shard nor a dtype on rank {rank}")
    bytes_per_elem = sum(_element_size(d) for d in spec.values())
    plan = layout_plan(old_layout, new_layout, chunk_elems=chunk_elems_for(staging_bytes, bytes_per_elem))
    return execute_plan(plan, rank=rank, old_shards=old, old_pieces=old_layout.rank_pieces(rank),
                        new_pieces=new_layout.rank_pieces(rank), out=out, group=group,
                        staging_bytes=staging_bytes, kinds=names, dtypes=dtypes, device=device)


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
    """`reshard` between flat layouts over `old_ranks` and `new_ranks`."""
    return reshard(old_shards, old_layout=FlatLayout(numel, tuple(old_ranks)),
                   new_layout=FlatLayout(numel, tuple(new_ranks)), rank=rank, staging_bytes=staging_bytes,
                   group=group, kinds=kinds, dtypes=dtypes, device=device)
