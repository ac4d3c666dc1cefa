"""NCCL's failure semantics in the communicator layer (comm/rendezvous.py, comm/pool.py,
cluster/worker_recovery.py `reset_world`), with stand-ins for torch.distributed and the store.

What NCCL does and gloo does not, stood in here: a group creation (NCCL's split) blocks until
every rank of the world reaches it, with no timeout; `destroy_process_group` may wait on the
work of a dead peer. Fake clock, fake store: nothing sleeps.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from unittest import mock

import pytest
import torch.distributed.distributed_c10d as c10d

from dynaresize.comm import pool as pool_mod
from dynaresize.comm import rendezvous


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def monotonic(self) -> float:
        return self.t


class Store:
    """A world's store in which some ranks never check in (dead): `wait` for a missing key
    fails after its timeout, as a TCPStore's does, advancing the fake clock by that timeout."""

    def __init__(self, clock: Clock, *, others: list[int], on_wait=None) -> None:
        self.clock, self.others, self.on_wait = clock, others, on_wait
        self.keys: set[str] = set()
        self.waits = 0

    def set(self, key: str, value: bytes) -> None:
        self.keys.add(key)
        prefix = key.rsplit("/", 1)[0]
        self.keys.update(f"{prefix}/{r}" for r in self.others)  # the live peers arrive as well

    def check(self, keys) -> bool:
        return all(k in self.keys for k in keys)

    def wait(self, keys, timeout) -> None:
        self.waits += 1
        if self.on_wait:
            self.on_wait(self.waits)
        if not self.check(keys):
            self.clock.t += timeout.total_seconds()
            raise RuntimeError("wait timeout")  # DistStoreError is a RuntimeError


def _nccl_world(release: threading.Event, entered: list) -> SimpleNamespace:
    """torch.distributed as rank 0 of a 3-rank NCCL world sees it: `new_group` (the split)
    returns only once every rank is in it, here never (rank 2 is dead) until `release`."""

    def new_group(ranks, **kw):
        entered.append(list(ranks))
        release.wait()
        raise RuntimeError("released by the test")

    return SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 3, get_rank=lambda: 0,
                           new_group=new_group, destroy_process_group=lambda g=None: None)


def _create_in_thread(pool: pool_mod.CommPool, ranks) -> dict:
    out: dict = {}

    def body():
        try:
            out["created"] = pool.create(ranks, critical=True)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout=20.0)  # a guard, not a pause: the fixed code returns at once (fake clock)
    out["alive"] = t.is_alive()
    return out


@pytest.mark.parametrize("ranks", [(0, 1), (0, 1, 2)], ids=["dead non-member", "dead member"])
def test_group_creation_with_a_dead_rank_ends_in_bounded_time(ranks):
    """Rank 2 died; survivor rank 0 creates a group (collective over the world). With NCCL's
    split that would block for ever; the check-in ends it within the pool's timeout (fake
    clock), naming the missing rank, and no communicator is created."""
    clock, release, entered = Clock(), threading.Event(), []
    store = Store(clock, others=[1])
    try:
        with mock.patch.object(pool_mod, "dist", _nccl_world(release, entered)), \
                mock.patch.object(rendezvous, "_store", lambda: store, create=True), \
                mock.patch.object(rendezvous, "time", SimpleNamespace(monotonic=clock.monotonic), create=True):
            pool = pool_mod.CommPool(timeout_s=30.0)
            out = _create_in_thread(pool, ranks)
        assert not out["alive"], "group creation still blocked in the split with a dead rank"
        assert isinstance(out.get("error"), rendezvous.GroupCreationFailed), out
        assert "[2]" in str(out["error"]) and "30s" in str(out["error"])
        assert entered == [], "the split was entered although a rank never arrived"
        assert 30.0 <= clock.t - 50.0 <= 30.0 + rendezvous.CHECKIN_SLICE_S
        assert not pool.has(ranks) and pool.stats()["groups_created"] == 0
    finally:
        release.set()


def test_an_abort_ends_a_check_in_at_once():
    """The world is aborted (the ctl thread, on a loss) while rank 0 waits for a dead rank:
    the creation ends at the next slice, not at the timeout."""
    clock, release, entered = Clock(), threading.Event(), []
    flag = mock.patch.object(rendezvous, "_aborted", False)

    def abort_on_third_wait(n: int) -> None:
        if n == 3:
            rendezvous._aborted = True

    store = Store(clock, others=[1], on_wait=abort_on_third_wait)
    try:
        with flag, mock.patch.object(pool_mod, "dist", _nccl_world(release, entered)), \
                mock.patch.object(rendezvous, "_store", lambda: store), \
                mock.patch.object(rendezvous, "time", SimpleNamespace(monotonic=clock.monotonic)):
            out = _create_in_thread(pool_mod.CommPool(timeout_s=600.0), (0, 1, 2))
            assert "aborted" in str(out.get("error")), out
            assert clock.t - 50.0 <= 3 * rendezvous.CHECKIN_SLICE_S
            # and a creation in the aborted world is refused before any check-in
            waits = store.waits
            with pytest.raises(rendezvous.GroupCreationFailed, match="aborted"):
                pool_mod.CommPool(timeout_s=600.0).create((0, 1), critical=False)
            assert store.waits == waits and entered == []
    finally:
        release.set()


def test_small_groups_get_the_short_timeout():
    assert pool_mod.group_timeout_s(2, 600.0) == pool_mod.SMALL_GROUP_S < 600.0
    assert pool_mod.group_timeout_s(pool_mod.SMALL_GROUP_RANKS + 1, 600.0) == 600.0
    assert pool_mod.group_timeout_s(2, 5.0) == 5.0  # never longer than the pool's


def test_reset_world_aborts_before_it_destroys():
    """A survivor re-forming the world after a loss aborts its communicators first: NCCL's
    `destroy_process_group` may wait on a dead peer's work; an aborted communicator cannot."""
    from dynaresize.cluster.worker_recovery import RecoveryMixin

    calls: list[str] = []
    live = {"on": True}

    def abort(group=None):
        calls.append("abort")
        live["on"] = False

    def destroy(group=None):
        calls.append("destroy" if live["on"] else "destroy (nothing live)")
        live["on"] = False

    fake_dist = SimpleNamespace(is_initialized=lambda: live["on"], destroy_process_group=destroy)
    worker = SimpleNamespace(
        pool=SimpleNamespace(clear=lambda: calls.append("pool.clear")), device=3,
        _drop_trainer=lambda: calls.append("drop trainer"), moments=SimpleNamespace(reset=lambda: None),
        _full=None, _full_version=None, _parked=None,
        cfg=SimpleNamespace(cluster=SimpleNamespace(backend="nccl"), timeouts=SimpleNamespace(collective_s=30.0)))
    with mock.patch.object(rendezvous, "dist", fake_dist), mock.patch.object(c10d, "_abort_process_group", abort), \
            mock.patch.object(rendezvous, "init_world", lambda **kw: calls.append("init")), \
            mock.patch.object(rendezvous, "_live", object()):
        RecoveryMixin.reset_world(worker, "tcp://127.0.0.1:1", 1, 2, 1)
    assert "abort" in calls, calls
    assert "destroy" not in calls[:calls.index("abort")], calls
    assert calls.index("abort") < calls.index("init"), calls


def test_reshard_messages_are_batched_p2p_on_the_callers_group():
    """Every message of a reshard is one `batch_isend_irecv` on the caller's group (NCCL runs a
    batch on that group's communicator; a lone send/recv may make a hidden 2-rank one), never a
    plain send or recv. A stand-in world: rank 0's sends to rank 1 are recorded and answered."""
    import torch
    import torch.distributed as dist

    from dynaresize.reshard import execute
    from dynaresize.reshard.plan import transfer_plan

    group = object()
    batches: list[list] = []

    def refuse(*a, **kw):
        raise AssertionError("a plain send/recv: it may create a pair communicator on NCCL")

    def batch(ops):
        batches.append([(op.op, op.peer, op.group, op.tensor.numel()) for op in ops])
        return [SimpleNamespace(wait=lambda: None)]

    class Op:
        def __init__(self, op, tensor, peer, group):
            self.op, self.tensor, self.peer, self.group = op, tensor, peer, group

    fake = SimpleNamespace(send=refuse, recv=refuse, isend=dist.isend, irecv=dist.irecv, P2POp=Op,
                           batch_isend_irecv=batch, ProcessGroup=dist.ProcessGroup)
    full = {"param": torch.arange(40, dtype=torch.float32)}
    plan = transfer_plan(40, (0,), (0, 1), chunk_elems=8)
    with mock.patch.object(execute, "dist", fake):
        _, stats = execute.execute_plan(plan, rank=0, old_shards=full, new_numel_local=20, staging_bytes=64,
                                        group=group)
    sent = [t for t in plan if t.src == 0 and t.dst == 1]
    assert stats.num_messages == len(sent) == len(batches) > 0
    assert all(b == [(dist.isend, 1, group, t.numel * 4)] for b, t in zip(batches, sent))
