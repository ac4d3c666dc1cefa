"""The one-issuing-thread rule on real device workers (cluster/worker.py), gloo on CPU.

The race behind `dynaresize bench resize`'s crash: a worker's main thread swaps torch.distributed's
default process group out while an in-process vLLM engine starts (roles/vllm_world.py); a group
creation issued from a second thread at that moment finds no default group and fails with
"Default process group has not been initialized". Before the fix `prewarm_groups` ran on a
background thread and hit exactly that; now it runs on the thread that joined the world, queued
behind the swap. Both halves are shown here on two real `DeviceWorker` actors: the hazard itself
(a creation on a second thread during the swap fails), and the worker's pre-warm, sent while the
swap is held, succeeding on the issuing thread. A third check: the pool refuses group creation
from any thread but the issuing one.
"""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.dist

ray = pytest.importorskip("ray")


def _worker_class():
    from dynaresize.cluster.worker import DeviceWorker

    class SwapProbeWorker(DeviceWorker):
        """The product worker plus test probes that hold the vLLM world swap open."""

        def hold_vllm_world(self, seconds: float) -> float:
            from dynaresize.roles.vllm_world import vllm_world

            t0 = time.time()
            with vllm_world():  # our default group is hidden, as while an engine starts
                time.sleep(seconds)
            return t0

        def create_on_second_thread_during_swap(self, ranks: list[int]) -> str:
            """The old background pre-warm's pattern, without the pool's guard: a raw
            `new_group` on another thread while this thread holds the swap."""
            import torch.distributed as dist

            from dynaresize.roles.vllm_world import vllm_world

            seen: list[str] = []

            def create() -> None:
                try:
                    dist.new_group(ranks)
                    seen.append("created")
                except Exception as exc:  # noqa: BLE001 - the error is the finding
                    seen.append(f"{type(exc).__name__}: {exc}")

            with vllm_world():
                t = threading.Thread(target=create)
                t.start()
                t.join(30)
            return seen[0] if seen else "hung"

        def create_from_other_thread(self, ranks: list[int]) -> str:
            out: list[str] = []

            def create() -> None:
                try:
                    self.pool.create(ranks, critical=False, tag="probe")
                    out.append("created")
                except RuntimeError as exc:
                    out.append(str(exc))

            t = threading.Thread(target=create, name="not-the-issuer")
            t.start()
            t.join(30)
            return out[0]

    return ray.remote(concurrency_groups={"ctl": 1, "snap": 1})(SwapProbeWorker)  # as remote_worker_class


@pytest.fixture(scope="module")
def workers():
    from dynaresize.comm import rendezvous
    from dynaresize.config_load import build_config, config_to_dict

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = config_to_dict(build_config({"rollout": {"engine": "hf"}, "cluster": {"devices": 2, "rollout_devices": 1}}))
        cls = _worker_class()
        ws = [cls.options(num_cpus=1).remote(d, cfg) for d in range(2)]
        init = rendezvous.world_init_method("127.0.0.1", rendezvous.free_port())
        ray.get([w.init_world.remote(init, 2) for w in ws], timeout=120)
        yield ws
    finally:
        ray.shutdown()


def test_a_group_creation_on_a_second_thread_during_the_swap_fails(workers):
    # Rank 1 never reaches a matching new_group: rank 0's attempt must fail before it blocks.
    found = ray.get(workers[0].create_on_second_thread_during_swap.remote([0, 1]), timeout=60)
    assert "Default process group has not been initialized" in found, found


def test_a_pre_warm_sent_during_the_swap_runs_after_it_on_the_issuing_thread(workers):
    held = workers[0].hold_vllm_world.remote(2.0)
    time.sleep(0.3)  # the swap is open on worker 0
    sent = time.time()
    results = ray.get([w.prewarm_groups.remote([[0, 1], [1]]) for w in workers] + [held], timeout=120)
    for r in results[:2]:
        assert r["flags"] == [True, True] and r["t0"] >= sent
    assert results[0]["t0"] >= results[2] + 2.0  # worker 0 created them only once the swap was closed
    stats = ray.get([w.comm_stats.remote() for w in workers])
    assert all(s["groups_created_background"] >= 2 for s in stats)


def test_the_pool_refuses_a_creation_from_any_thread_but_the_issuing_one(workers):
    msg = ray.get(workers[0].create_from_other_thread.remote([0, 1]), timeout=60)
    assert "not the device's issuing thread" in msg and "not-the-issuer" in msg
