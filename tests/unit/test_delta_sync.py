"""Delta weight sync (roles/delta_sync.py): each encoding rebuilds the new bucket bit for bit;
the smallest encoding wins at each change rate; a sync over a sync group of a root and two
engines sends every bucket dense first (a full sync), then only what changed; an engine whose
image went wrong gets the bucket dense again (checksum); one whose image is of another version
makes the whole sync full. The group's collectives run on threads here (the protocol's logic,
isolated); the e2e runs put them on gloo (tests/e2e/test_delta_sync_run.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from dynaresize.roles.delta_sync import (BITMAP, DENSE, INDEX, Image, decode, encode, encoded_bytes, receive_delta,
                                         resolve_mode, send_delta)
from dynaresize.roles.weight_sync import drain

SPECS = [("a.weight", (64, 33)), ("b.weight", (1000,)), ("c.weight", (17, 40))]
NUMEL = sum(torch.Size(s).numel() for _, s in SPECS)


def _changed(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    idx = torch.randperm(t.numel(), generator=g)[:int(frac * t.numel())]
    out[idx] = (out[idx].float() + 1.0).to(t.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("frac, kind", [(0.0, INDEX), (0.01, INDEX), (0.2, BITMAP), (0.99, DENSE)])
def test_each_encoding_rebuilds_the_bucket_bit_for_bit(dtype, frac, kind):
    old = torch.randn(5000, generator=torch.Generator().manual_seed(1)).to(dtype)
    new = _changed(old, frac, 2)
    new[7] = -0.0 if old[7] != 0 else 1.0  # a sign bit alone is a change
    got_kind, payload, k = encode(old, new)
    assert got_kind == kind
    assert k == int((old.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
                     != new.view(torch.int16 if dtype.itemsize == 2 else torch.int32)).sum())
    assert payload.numel() == encoded_bytes(5000, k, dtype.itemsize)[kind] == min(encoded_bytes(5000, k, dtype.itemsize).values())
    image = old.clone()
    decode(image, kind, payload, k)
    assert torch.equal(image.view(torch.uint8), new.view(torch.uint8))


def test_break_even_points():
    n = 1 << 20
    assert min(encoded_bytes(n, n // 40, 2).items(), key=lambda kv: kv[1])[0] == INDEX  # 2.5%
    assert min(encoded_bytes(n, n // 25, 2).items(), key=lambda kv: kv[1])[0] == BITMAP  # 4%
    assert min(encoded_bytes(n, int(0.95 * n), 2).items(), key=lambda kv: kv[1])[0] == DENSE
    assert resolve_mode("auto", torch.bfloat16) == "delta" and resolve_mode("auto", torch.float32) == "full"
    assert resolve_mode("delta", torch.float32) == "delta" and resolve_mode("full", torch.bfloat16) == "full"


class Hub:
    """The sync group's collectives between threads: member 0 is the root."""

    def __init__(self, n: int) -> None:
        self.barrier, self.slots = threading.Barrier(n), [None] * n

    def member(self, i: int) -> "ThreadWire":
        return ThreadWire(self, i)


class ThreadWire:
    def __init__(self, hub: Hub, i: int) -> None:
        self.hub, self.i = hub, i

    def _exchange(self, value):
        self.hub.slots[self.i] = value
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()
        return out

    def bcast(self, t: torch.Tensor) -> None:
        got = self._exchange(t.clone() if self.i == 0 else None)[0]
        if self.i:
            t.copy_(got)

    def any(self, flag: bool) -> bool:
        return any(self._exchange(bool(flag)))

    def gather(self, value: int) -> list[int]:
        return self._exchange(int(value))


class Engine:
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def set_weights(self, stream, version):
        for chunk in stream:
            self.weights.update({n: t.clone() for n, t in chunk})


def _sync(weights: dict[str, torch.Tensor], images: list[Image], engines: list[Engine], version: int,
          dtype=torch.bfloat16, break_image=None):
    hub = Hub(1 + len(engines))
    stats, errors = [None] * (1 + len(engines)), []

    def root():
        try:
            stats[0] = send_delta(iter(weights.items()), SPECS, wire=hub.member(0), is_root=True, image=images[0],
                                  version=version, device=torch.device("cpu"), dtype=dtype, bucket_bytes=4096)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def engine(i):
        try:
            from dynaresize.roles.delta_sync import DeltaStats

            st = DeltaStats()
            if break_image is not None and i == break_image and images[i].buckets:
                b = images[i].buckets[0]  # an image gone wrong, where the step changes nothing
                j = int(b.float().abs().argmax())
                b[j] = -b[j]
            stream = receive_delta(SPECS, wire=hub.member(i), image=images[i], version=version,
                                   device=torch.device("cpu"), dtype=dtype, bucket_bytes=4096, stats=st)
            engines[i - 1].set_weights(stream, version)
            drain(stream)
            stats[i] = st
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=root)] + [threading.Thread(target=engine, args=(i,))
                                                 for i in range(1, 1 + len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for e in engines:  # every engine holds the trainers' weights cast to the wire dtype
        for name, w in weights.items():
            assert torch.equal(e.weights[name].view(torch.uint8), w.to(dtype).view(torch.uint8)), name
    return stats


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SPECS}


def _step(w: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + lr * torch.randn(t.shape, generator=g).sign() for n, t in w.items()}


def test_a_chain_sends_full_then_only_what_changed():
    images, engines = [Image(), Image(), Image()], [Engine(), Engine()]
    w = _weights(0)
    first = _sync(w, images, engines, 1)
    assert {s.mode for s in first} == {"full"} and first[0].wire_bytes >= NUMEL * 2
    assert all(s.fields()["changed_fraction"] is None for s in first)
    w = _step(w, 1e-4, 1)  # a small step: few bf16 values move
    second = _sync(w, images, engines, 2)
    assert {s.mode for s in second} == {"delta"}
    frac = second[1].fields()["changed_fraction"]
    assert 0 < frac < 0.2 and second[1].changed == second[0].changed
    assert second[1].wire_bytes == second[0].wire_bytes < 0.3 * first[0].wire_bytes
    assert all(img.version == 2 for img in images)
    # an fp32 engine in delta mode: every changed value (all of them here), still exact
    f_images, f_engines = [Image(), Image()], [Engine()]
    _sync(w, f_images, f_engines, 2, dtype=torch.float32)
    st = _sync(_step(w, 1e-4, 2), f_images, f_engines, 3, dtype=torch.float32)
    assert st[1].mode == "delta" and st[1].fields()["changed_fraction"] > 0.99


def test_a_wrong_image_gets_the_bucket_dense_and_a_missed_version_gets_a_full_sync():
    images, engines = [Image(), Image(), Image()], [Engine(), Engine()]
    w = _weights(3)
    _sync(w, images, engines, 1)
    w = _step(w, 1e-4, 4)
    st = _sync(w, images, engines, 2, break_image=2)
    assert st[2].refetched == 1 and st[1].refetched == 0 and st[0].refetched == 1
    assert st[2].fields()["refetched_buckets"] == 1
    # engine 1 misses version 3 (a fresh image of an older version): version 4 goes full to all
    behind = Image()
    behind.version, behind.buckets = 2, [b.clone() for b in images[1].buckets]
    _sync(_step(w, 1e-4, 5), images[:2] + [Image()], [Engine()], 3)  # engine 2 alone gets version 3
    st = _sync(_step(w, 1e-4, 6), [images[0], behind], [Engine()], 4)
    assert [s.mode for s in st] == ["full", "full"]
