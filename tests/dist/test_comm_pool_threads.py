"""The communicator pool never holds its lock across a call that blocks on peers (gloo, CPU).

The hazard: a worker's background thread sits in `CommPool.create` (inside `new_group`, which
returns only when every rank of the world calls it) while its main thread needs a cached group
(`get`) for the step it is running; a peer reaches its own `new_group` only after that step.
With the lock held across `new_group` the main thread waits for the peer and the peer for the
main thread: a deadlock (reproduced by this test before the fix: the `get` never returned).
Two processes, one gloo world, no Ray.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

pytestmark = pytest.mark.dist


def _rank(rank: int, port: int, peer_may_create, out) -> None:
    from dynaresize.comm import rendezvous
    from dynaresize.comm.pool import CommPool

    rendezvous.init_world(rank=rank, world_size=2, init_method=rendezvous.world_init_method("127.0.0.1", port),
                          backend="gloo", timeout_s=60)
    pool = CommPool(timeout_s=60)
    try:
        pool.create((0, 1), critical=True)  # cached before the race
        if rank == 1:
            peer_may_create.wait(60)  # this rank reaches its next creation late (busy with a step)
            pool.create((0, 1), critical=False, tag="prewarm")
            out.put(("rank1", "created"))
            return
        creator = threading.Thread(target=pool.create, args=((0, 1),), kwargs={"critical": False, "tag": "prewarm"})
        creator.start()
        time.sleep(0.5)  # the creator is inside new_group, waiting for rank 1
        got: list = []
        reader = threading.Thread(target=lambda: got.append((pool.get((0, 1)), pool.has((0, 1)), pool.stats())))
        reader.start()
        reader.join(10)
        out.put(("get_returned", bool(got)))
        with pytest.raises(RuntimeError, match="being created by another thread"):
            pool.create((0, 1), critical=False, tag="prewarm")
        out.put(("second_creator_refused", True))
        peer_may_create.set()  # now rank 1 joins, and the creation completes
        creator.join(30)
        out.put(("created", pool.has((0, 1), tag="prewarm") and not creator.is_alive()))
    finally:
        rendezvous.destroy_world()


def test_a_reader_is_not_held_behind_a_group_creation_waiting_for_a_peer():
    from dynaresize.comm import rendezvous

    ctx = mp.get_context("spawn")
    event, out = ctx.Event(), ctx.Queue()
    port = rendezvous.free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, event, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.time() + 120
        while len(results) < 4 and time.time() < deadline:
            try:
                key, value = out.get(timeout=max(0.1, deadline - time.time()))
            except Exception:
                break
            results[key] = value
            if key == "get_returned" and not value:
                event.set()  # let the stuck ranks finish before failing
    finally:
        event.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert results.get("get_returned") is True, results
    assert results.get("second_creator_refused") is True and results.get("created") is True, results
    assert results.get("rank1") == "created"
