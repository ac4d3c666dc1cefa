"""Delta weight sync (`rollout.weight_sync = delta`): after a step, only the values that changed
in the engine's dtype cross the wire, each bucket checked by a checksum of its result.

Every device of the sync group keeps an `Image`: the last weights it sent or received, in the
wire dtype (the engine's), bucket by bucket as `weight_sync.buckets` cuts them, on the host
(pinned on CUDA), with their version. A sync first agrees on a chain: every member's image of
the same version (an all-gather of the versions held). If so, the root sends, per bucket, the
elements whose bits changed against that image; if not (the first sync, a joining engine, a
device whose image was reset by a restore, a version an engine missed), every bucket goes
dense: a full sync, after which the chain holds again. The image is that of a version, not of
an engine or a trainer: a device that moves from rollout to training keeps it and, as the new
sync root, sends deltas against it.

Encoding, per bucket of n elements of e bytes with k changed (compared bit for bit, so -0.0 and
NaN payloads count): indices (int32) plus values, k*(4+e) bytes; a bitmap plus values,
n/8 + k*e; or dense, n*e. The smallest wins (`encoded_bytes`): indices below k/n = 1/32, the
bitmap up to about 1 - 1/(8e), dense above (the break-even). docs/sync.md has the measured
rates. A bucket whose changed count is zero sends only its header.

Checked: the header of each bucket carries the crc32 of the resulting bucket (the root's new
image); a receiver whose result disagrees says so in an all-reduce that every member takes
after each bucket, and the root then broadcasts that bucket dense (counted in
`refetched_buckets` of the record). So an engine loads exactly the trainers' weights cast to the
wire dtype, bucket by bucket through its usual load path (the image's views; nothing in the
engine changes), at most one payload buffer alive outside the image.

Invariants: after any sync every member's image equals the root's new image bit for bit and is
tagged with the synced version; an fp32 engine in delta mode gets every changed value (exact,
just rarely smaller).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dynaresize.roles.weight_sync import BUCKET_BYTES, Chunk, Spec, Staging, _numel, _views, buckets, packed_buckets

DENSE, INDEX, BITMAP = 0, 1, 2
KIND_NAMES = {DENSE: "dense", INDEX: "index", BITMAP: "bitmap"}
HEADER = 4  # int64 fields: kind, changed elements (-1: no base), crc32 of the result, payload bytes
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve_mode(setting: str, wire: torch.dtype) -> str:
    """`rollout.weight_sync` for a run whose engines take `wire`: `auto` is delta where the
    engine's dtype is 16-bit (most values keep their bits over a step) and full otherwise."""
    if setting != "auto":
        return setting
    return "delta" if wire.itemsize == 2 else "full"


def _bitmap_bytes(n: int) -> int:
    return (n + 31) // 32 * 4  # whole 32-bit words: the values after it stay aligned


def encoded_bytes(n: int, k: int, elem_bytes: int) -> dict[int, int]:
    """Payload bytes of each encoding of a bucket of `n` elements with `k` changed."""
    return {INDEX: k * (4 + elem_bytes) if n < 2 ** 31 else n * elem_bytes + 1,
            BITMAP: _bitmap_bytes(n) + k * elem_bytes, DENSE: n * elem_bytes}


def checksum(t: torch.Tensor) -> int:
    """crc32 of a host tensor's bytes (3-4 GB/s here)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def _ints(t: torch.Tensor) -> np.ndarray:
    """A host tensor's elements as integers of its width (numpy: bitwise compares, fancy indexing
    and bit packing run several times faster than torch's boolean ops on the CPU)."""
    return t.view(_INT[t.element_size()]).numpy()


def encode(old: torch.Tensor | None, new: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """(kind, payload bytes, changed count) of `new` against `old` (flat host tensors of one
    dtype); no `old`: dense with count -1."""
    if old is None:
        return DENSE, new.view(torch.uint8), -1
    o, nw = _ints(old), _ints(new)
    mask = o != nw
    idx = np.flatnonzero(mask)
    k = int(idx.size)
    sizes = encoded_bytes(new.numel(), k, new.element_size())
    kind = min(sizes, key=lambda c: (sizes[c], c != DENSE))  # a tie goes dense (no decode)
    if kind == DENSE:
        return DENSE, new.view(torch.uint8), k
    values = nw[idx].view(np.uint8)
    if kind == INDEX:
        head = idx.astype(np.int32).view(np.uint8)
    else:
        head = np.zeros(_bitmap_bytes(new.numel()), dtype=np.uint8)
        packed = np.packbits(mask, bitorder="little")
        head[:packed.size] = packed
    return kind, torch.from_numpy(np.concatenate([head, values])), k


def decode(image: torch.Tensor, kind: int, payload: torch.Tensor, k: int) -> None:
    """Apply `payload` (encoded by `encode`) to `image` (a host tensor) in place."""
    if kind == DENSE:
        image.copy_(payload.view(image.dtype))
        return
    n, img, raw = image.numel(), _ints(image), payload.numpy()
    ints = img.dtype
    if kind == INDEX:
        img[raw[:4 * k].view(np.int32)] = raw[4 * k:].view(ints)
    elif kind == BITMAP:
        nb = _bitmap_bytes(n)
        mask = np.unpackbits(raw[:nb], count=n, bitorder="little").view(bool)
        img[mask] = raw[nb:].view(ints)
    else:
        raise ValueError(f"unknown delta encoding {kind}")


class Image:
    """The last weights this device sent or received, in the wire dtype, per bucket (host;
    pinned on CUDA), and their version (-1: none; `reset` after a restore)."""

    def __init__(self) -> None:
        self.version = -1
        self.buckets: list[torch.Tensor | None] = []

    def reset(self) -> None:
        self.version, self.buckets = -1, []

    def store(self, b: int, host: torch.Tensor, *, pin: bool) -> torch.Tensor:
        """Bucket `b` becomes (a copy of) `host`; the stored tensor."""
        while len(self.buckets) <= b:
            self.buckets.append(None)
        cur = self.buckets[b]
        if cur is None or cur.numel() != host.numel() or cur.dtype != host.dtype:
            cur = torch.empty(host.numel(), dtype=host.dtype, pin_memory=pin)
            self.buckets[b] = cur
        if cur.data_ptr() != host.data_ptr():
            cur.copy_(host)
        return cur

    def base(self, b: int) -> torch.Tensor | None:
        return self.buckets[b] if b < len(self.buckets) else None


class Wire:
    """The sync group's collectives as the protocol uses them (torch.distributed; a test may
    pass its own)."""

    def __init__(self, group: Any, root: int, device: torch.device) -> None:
        self.group, self.root, self.device = group, root, device

    def bcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=self.root, group=self.group)

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def gather(self, value: int) -> list[int]:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t, group=self.group)
        return [int(o.item()) for o in out]


class DeltaStats:
    """What one member's side of a sync did: its mode, changed elements, bytes on the wire."""

    def __init__(self) -> None:
        self.mode = "full"
        self.changed = 0
        self.numel = 0
        self.wire_bytes = 0
        self.refetched = 0
        self.kinds = {name: 0 for name in KIND_NAMES.values()}
        self.t0 = time.time()

    def fields(self) -> dict:
        """The delta fields of a `weight_sync` record (docs/records.md)."""
        return {"mode": self.mode, "wire_bytes": self.wire_bytes, "refetched_buckets": self.refetched,
                "changed_fraction": self.changed / self.numel if self.mode == "delta" and self.numel else None,
                "bucket_encodings": dict(self.kinds)}


def _agree(wire: Wire, image: Image, stats: DeltaStats) -> bool:
    bases = wire.gather(image.version)
    chain = bases[0] >= 0 and all(b == bases[0] for b in bases)
    stats.mode = "delta" if chain else "full"
    return chain


def send_delta(full: Iterator[tuple[str, torch.Tensor]], specs: list[Spec], *, wire: Wire | None, is_root: bool,
               image: Image, version: int, device: torch.device, dtype: torch.dtype,
               bucket_bytes: int = BUCKET_BYTES) -> DeltaStats:
    """Trainer side: consume the (collective) full-weight iterator; the root sends each bucket
    as a delta against its image (or dense), then updates the image to `version`."""
    stats = DeltaStats()
    chain = _agree(wire, image, stats) if is_root else False
    if is_root:
        image.version = -1  # until every bucket is in (as on the receivers)
    pin = device.type == "cuda"
    packed = packed_buckets(full, specs, is_root=is_root, device=device, dtype=dtype, bucket_bytes=bucket_bytes)
    for b, (bucket, flat) in enumerate(packed):
        n = sum(_numel(s) for _, s in bucket)
        if not is_root:
            continue
        host = flat if flat.device.type == "cpu" else flat.cpu()
        kind, payload, k = encode(image.base(b) if chain else None, host)
        header = torch.tensor([kind, k, checksum(host), payload.numel()], dtype=torch.int64)
        _send(wire, header, device)
        if payload.numel():
            _send(wire, payload, device)
        stats.wire_bytes += HEADER * 8 + payload.numel()
        stats.numel += n
        stats.changed += max(k, 0)
        stats.kinds[KIND_NAMES[kind]] += 1
        image.store(b, host, pin=pin)  # after encoding: the base was still needed
        if wire.any(False):  # a receiver's result disagreed with the checksum: the bucket dense
            wire.bcast(flat)
            stats.refetched += 1
            stats.wire_bytes += flat.numel() * flat.element_size()
        del flat, host, payload
    if is_root:
        image.version = version
    return stats


def _send(wire: Wire, t: torch.Tensor, device: torch.device) -> None:
    wire.bcast(t if t.device == device else t.to(device))


def receive_delta(specs: list[Spec], *, wire: Wire, image: Image, version: int, device: torch.device,
                  dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES, stats: DeltaStats | None = None,
                  staging: Staging | None = None) -> Iterator[Chunk]:
    """Rollout side, a stream like `weight_sync.receive_weights`: per bucket, take the header
    and payload, rebuild the bucket in the image, check it, yield its weights (views into the
    image). Every bucket must be taken (`weight_sync.drain`)."""
    stats = stats if stats is not None else DeltaStats()
    staging = staging if staging is not None else Staging()
    chain = _agree(wire, image, stats)
    pin = device.type == "cuda"
    image.version = -1  # until every bucket is in: a sync that fails half way leaves no chain
    for b, bucket in enumerate(buckets(specs, bucket_bytes, dtype.itemsize)):
        n = sum(_numel(s) for _, s in bucket)
        header = torch.empty(HEADER, dtype=torch.int64, device=device)
        wire.bcast(header)
        kind, k, crc, nbytes = (int(x) for x in header.cpu())
        payload = staging.alloc(nbytes, torch.uint8, device) if nbytes else torch.empty(0, dtype=torch.uint8)
        if nbytes:
            wire.bcast(payload)
        host = payload.cpu()
        del payload
        if kind == DENSE:
            cur = image.store(b, host.view(dtype), pin=pin)
        else:
            cur = image.base(b) if chain else None
            if cur is None:
                raise RuntimeError(f"weight sync of version {version}: a delta bucket {b} without a base image")
            decode(cur, kind, host, k)
        del host
        bad = checksum(cur) != crc
        if wire.any(bad):
            dense = staging.alloc(n, dtype, device)
            wire.bcast(dense)
            stats.wire_bytes += n * dtype.itemsize
            if bad:
                cur = image.store(b, dense.cpu(), pin=pin)
                stats.refetched += 1
            del dense
        stats.wire_bytes += HEADER * 8 + nbytes
        stats.numel += n
        stats.changed += max(k, 0)
        stats.kinds[KIND_NAMES[kind]] += 1
        chunk = _views(cur, bucket)
        yield chunk
        del chunk
    image.version = version


def sync_member(*, trainer: Any, engine: Any, image: Image, specs: list[Spec], root: int, group: Any, version: int,
                device: torch.device, dtype: torch.dtype, is_root: bool, bucket_bytes: int = BUCKET_BYTES) -> dict:
    """One device's part of a delta sync (cluster/worker.py `sync_weights`): a trainer walks
    its full weights (the root sends), a rollout device loads the stream into its engine. The
    fields of its entry (an engine's: those of its `weight_sync` record)."""
    from dynaresize.roles.weight_sync import drain

    wire = Wire(group, root, device) if group is not None else None
    if trainer is not None:
        stats = send_delta(trainer.full_params(), specs, wire=wire, is_root=is_root, image=image, version=version,
                           device=device, dtype=dtype, bucket_bytes=bucket_bytes)
        return {"bytes": stats.wire_bytes, **(stats.fields() if is_root else {})}
    stats, staging = DeltaStats(), Staging()
    stream = receive_delta(specs, wire=wire, image=image, version=version, device=device, dtype=dtype,
                           bucket_bytes=bucket_bytes, stats=stats, staging=staging)
    try:
        engine.set_weights(stream, version)  # each bucket loaded before the next is received
    finally:
        left = drain(stream)  # the root sends every bucket: take what a failed load left
    if left:
        raise RuntimeError(f"the engine left {left} weight buckets of version {version}")
    out = staging.record(dtype)
    out.update(stats.fields(), num_params=stats.numel, num_buckets=sum(stats.kinds.values()),
               seconds=time.time() - stats.t0)
    return {"bytes": stats.wire_bytes, **out}
