"""Weight sync from the trainers to the rollout engines: buckets in the engine's dtype, each
loaded before the next arrives.

After each training step every trainer gathers the full weights parameter by parameter over
the training group (FSDP2 `full_tensor`, roles/train_fsdp.py), and the sync root (the lowest
training device) packs them, in the fixed order of the trainable parameters, into buckets of
at most `bucket_bytes` in the wire dtype (the engine's: bf16 for a bf16 engine, fp32 for fp32)
and broadcasts each over the cached weight-sync group ({root} + rollout devices). Receivers
compute the same bucket boundaries from the parameter names and shapes alone, so nothing but
the weights crosses the wire. `receive_weights` is a stream: it yields one bucket's weights
(views into that bucket) and receives the next only when the engine asks for it, so a sync
holds at most two buckets of received weights outside the engine (the one being loaded and
the one arriving), whatever the model's size. Pulls, restores and resumes read the weights
from host memory (a snapshot or a checkpoint) through the same kind of stream (`host_weights`):
bounded host staging (pinned on CUDA) instead of the whole model on the device.

Buckets never split a fused unit (q/k/v of one layer, gate/up, a module's weight and bias):
vLLM loads a module once all its weights arrived (roles/vllm_weights.py), so a unit cut in
two would keep a third bucket alive; a unit larger than `bucket_bytes` is a bucket of its own.

Why buckets: per-tensor messages are what made published syncs slow (open-instruct's
per-parameter RPCs took >120 s before batching; SGLang's bucketed sync went from 130 s to 7 s
for an 80B model: github.com/allenai/open-instruct/pull/1535, github.com/sgl-project/sglang/pull/13824),
and one message of the whole model would need a second full copy on the root and the
receivers (a 7B model is 30.5 GB in fp32 where a vLLM device leaves ~10 GB free).

Invariants: a receiver gets exactly the trainers' weights cast to the wire dtype (bit-identical
in fp32, which deterministic mode uses and checks by digest); `Staging` counts, from the
tensors' own lifetimes, the most bytes of received weights alive at once (`staging_peak_bytes`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

BUCKET_BYTES = 256 << 20
Spec = tuple[str, tuple[int, ...]]
Chunk = list[tuple[str, torch.Tensor]]  # one bucket's (name, weight) pairs, in parameter order

# Parameters that vLLM fuses into one module (Qwen2/Llama families): loaded as one unit.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def fused_unit(name: str) -> str:
    """The unit a parameter loads with: its module, with q/k/v and gate/up of one layer one
    unit (a name without a module is a unit of its own)."""
    module, dot, _ = name.rpartition(".")
    if not dot:
        return name
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED[leaf]}" if leaf in _FUSED else module


def buckets(specs: Iterable[Spec], bucket_bytes: int = BUCKET_BYTES, elem_bytes: int = 4) -> list[list[Spec]]:
    """Consecutive parameters grouped so a bucket's bytes (`elem_bytes` per element) stay
    within `bucket_bytes`, consecutive parameters of one fused unit always in one bucket (a
    unit larger than `bucket_bytes` gets a bucket of its own)."""
    units: list[list[Spec]] = []
    for spec in specs:
        if units and fused_unit(units[-1][-1][0]) == fused_unit(spec[0]):
            units[-1].append(spec)
        else:
            units.append([spec])
    out: list[list[Spec]] = []
    size = 0
    for unit in units:
        n = sum(_numel(s) for _, s in unit) * elem_bytes
        if not out or (size + n > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].extend(unit)
        size += n
    return out


class Staging:
    """Bytes of received weights alive outside the engine: each staging buffer is counted from
    its allocation until the buffer and every view of it are gone (a view keeps its base
    alive), so `peak_bytes` is what the process really held, not what the code meant to."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.wire_bytes = 0  # bytes of weights handed to the engine, in the wire dtype
        self.num_buckets = 0
        self.numel = 0
        self.largest_bucket_bytes = 0
        self.t0 = time.time()

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device, *, pin: bool = False) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
        n = numel * t.element_size()
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.wire_bytes += n
        self.num_buckets += 1
        self.numel += numel
        self.largest_bucket_bytes = max(self.largest_bucket_bytes, n)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.live_bytes -= n

    def record(self, dtype: torch.dtype) -> dict:
        """The fields of a `weight_sync` record (docs/records.md) this staging measured."""
        return {"mode": "full", "changed_fraction": None,
                "wire_bytes": self.wire_bytes, "wire_dtype": str(dtype).replace("torch.", ""),
                "staging_peak_bytes": self.peak_bytes, "num_params": self.numel, "num_buckets": self.num_buckets,
                "largest_bucket_bytes": self.largest_bucket_bytes, "seconds": time.time() - self.t0}


def _views(flat: torch.Tensor, bucket: list[Spec]) -> Chunk:
    out: Chunk = []
    off = 0
    for name, shape in bucket:
        n = _numel(shape)
        out.append((name, flat[off:off + n].view(shape)))
        off += n
    return out


def packed_buckets(full: Iterator[tuple[str, torch.Tensor]], specs: list[Spec], *, is_root: bool,
                   device: torch.device, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES
                   ) -> Iterator[tuple[list[Spec], torch.Tensor | None]]:
    """Trainer side: consume the (collective: every trainer takes it) full-weight iterator
    bucket by bucket; yield each bucket's specs with, on the root, its weights packed into one
    flat tensor of the wire `dtype` (None elsewhere). Raises RuntimeError when the trainer's
    parameters are not `specs`, in order."""
    for bucket in buckets(specs, bucket_bytes, dtype.itemsize):
        flat = torch.empty(sum(_numel(s) for _, s in bucket), dtype=dtype, device=device) if is_root else None
        off = 0
        for name, shape in bucket:
            got_name, tensor = next(full)
            if got_name != name or tuple(tensor.shape) != tuple(shape):
                raise RuntimeError(f"weight sync: expected {name} {shape}, the trainer gave {got_name} "
                                   f"{tuple(tensor.shape)}")
            if is_root:
                flat[off:off + tensor.numel()].copy_(tensor.reshape(-1))
            off += tensor.numel()
            del tensor
        yield bucket, flat
        del flat


def send_weights(full: Iterator[tuple[str, torch.Tensor]], specs: list[Spec], *, root: int, group, is_root: bool,
                 device: torch.device, dtype: torch.dtype = torch.float32, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Trainer side: consume the (collective) full-weight iterator; the root broadcasts each
    bucket, cast to the wire `dtype`. Returns the bytes the root sent (0 elsewhere)."""
    import torch.distributed as dist

    sent = 0
    for _, flat in packed_buckets(full, specs, is_root=is_root, device=device, dtype=dtype, bucket_bytes=bucket_bytes):
        if is_root and group is not None:
            dist.broadcast(flat, src=root, group=group)
            sent += flat.numel() * flat.element_size()
        del flat
    return sent


def receive_weights(specs: list[Spec], *, root: int, group, device: torch.device,
                    dtype: torch.dtype = torch.float32, bucket_bytes: int = BUCKET_BYTES,
                    staging: Staging | None = None) -> Iterator[Chunk]:
    """Rollout side, a stream: receive one bucket, yield its weights (views into it), receive
    the next when asked. Hand it to the engine's `set_weights`; every bucket must be taken
    (the root broadcasts them all: `drain` what an engine left)."""
    import torch.distributed as dist

    staging = staging if staging is not None else Staging()
    for bucket in buckets(specs, bucket_bytes, dtype.itemsize):
        flat = staging.alloc(sum(_numel(s) for _, s in bucket), dtype, device)
        dist.broadcast(flat, src=root, group=group)
        chunk = _views(flat, bucket)
        del flat
        yield chunk
        del chunk  # before the next bucket is allocated: only the engine may still hold it


def host_weights(specs: list[Spec], read: Callable[[int, int], torch.Tensor], *, dtype: torch.dtype,
                 pin: bool, bucket_bytes: int = BUCKET_BYTES, staging: Staging | None = None) -> Iterator[Chunk]:
    """A stream of the weights held on the host as one flat vector (`read(lo, hi)`: elements
    [lo, hi) of it, a snapshot's or a checkpoint's): bucket by bucket, cast to `dtype` into a
    staging buffer (pinned when `pin`, so the engine's copy to the device is a DMA), never the
    whole model at once."""
    staging = staging if staging is not None else Staging()
    off = 0
    for bucket in buckets(specs, bucket_bytes, dtype.itemsize):
        n = sum(_numel(s) for _, s in bucket)
        flat = staging.alloc(n, dtype, torch.device("cpu"), pin=pin)
        flat.copy_(read(off, off + n))
        off += n
        chunk = _views(flat, bucket)
        del flat
        yield chunk
        del chunk


def drain(stream: Iterator[Chunk]) -> int:
    """Take the buckets an engine left in `stream` (a collective: the root sends them all);
    how many there were."""
    return sum(1 for _ in stream)


def chunks_of(weights: Mapping[str, Any] | Iterable[Chunk]) -> Iterator[Chunk]:
    """The chunks an engine loads: a state dict is one chunk, a stream is its buckets."""
    if isinstance(weights, Mapping):
        yield list(weights.items())
    else:
        yield from weights


def weights_digest(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float32) -> str:
    """A digest of named weights that does not depend on their order: sha256 over the sorted
    per-weight digests of (name, shape, bytes cast to `dtype`). Equal digests mean the trainers
    and an engine hold bit-identical weights (deterministic mode checks this after every sync);
    it streams, so the trainers never hold more than one full weight for it. -0.0 counts as
    0.0 (an engine's read-back cannot tell them apart)."""
    import hashlib

    entries = []
    for name, tensor in named:
        t = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        if t.is_floating_point():
            t = t + 0  # -0.0 -> +0.0
        h = hashlib.sha256(f"{name}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        entries.append((name, h.hexdigest()))
    return hashlib.sha256("\n".join(f"{n} {d}" for n, d in sorted(entries)).encode()).hexdigest()


def flatten(state: dict[str, torch.Tensor], specs: Iterable[Spec]) -> torch.Tensor:
    """The parameters of `state` named by `specs`, as one fp32 vector in that order."""
    return torch.cat([state[name].detach().reshape(-1).to(torch.float32) for name, _ in specs])


def unflatten(flat: torch.Tensor, specs: Iterable[Spec]) -> dict[str, torch.Tensor]:
    """Split a flat vector back into a state dict (views into `flat`)."""
    specs = list(specs)
    sizes = [_numel(shape) for _, shape in specs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flat weights have {flat.numel()} elements, the model needs {sum(sizes)}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for (name, shape), n in zip(specs, sizes):
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out
