"""A group creation with a dead rank, on a real gloo world and its TCP store (comm/pool.py,
comm/rendezvous.py `checkin`): three processes join the world, rank 2 exits, and the survivors'
next creation ends with `GroupCreationFailed` naming rank 2 once the pool's timeout passed, with
no communicator made; abort-then-destroy leaves no world behind. (NCCL's split, which would
block for ever here, is stood in for by tests/unit/test_nccl_comm.py.) Slow: three processes
importing torch take ~30 s on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import socket

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TIMEOUT_S = 3.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from dynaresize.comm import rendezvous
    from dynaresize.comm.pool import CommPool

    rendezvous.init_world(rank=rank, world_size=3, init_method=f"tcp://127.0.0.1:{port}", backend="gloo",
                          timeout_s=60)
    pool = CommPool(timeout_s=TIMEOUT_S)
    pool.create((0, 1, 2), critical=False)  # every rank alive: made
    if rank == 2:
        os._exit(0)
    try:
        pool.create((0, 1), critical=True)
        outcome = "created"
    except rendezvous.GroupCreationFailed as exc:
        outcome = str(exc)
    made = pool.stats()["groups_created"]
    rendezvous.destroy_world()
    q.put((rank, outcome, made, dist.is_initialized()))


def test_creation_with_a_dead_rank_fails_naming_it():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, (r, outcome, made, live) in enumerate(got):
        assert r == rank
        assert "world ranks [2] did not arrive within 3s" in outcome, outcome
        assert made == 1 and not live  # only the first group; the world left cleanly
