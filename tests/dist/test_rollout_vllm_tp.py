"""A tensor-parallel (TP2) vLLM rollout replica spanning two Ray actors that, like device
workers, already belong to a 3-rank gloo world; compared with a one-rank engine of the same
fp32 weights, on a tiny tied-embedding GQA Qwen2 (4 query heads, 2 KV heads).

- the replica samples the one-rank engine's tokens for 12 seeded requests (some of forced
  length), log-probs within 1e-5, and both ranks return the same results, also when driven
  request by request (add / step / progress / abort);
- its communicators use torch.distributed (gloo), not vLLM's shared-memory all-reduce, and two
  replicas run on one node at once without interfering;
- `load_weights` then `weights_digest`: every rank's digest is `state_dict_digest` of the given
  weights; a rank given other weights changes every rank's digest;
- release leaves no /dev/shm segment, and a TP2 engine re-created in the same processes (one of
  which ran a one-rank engine before: its private group counter differs) generates the same;
- the worker world still works afterwards (a collective; a new group named alike on all ranks).

At most four vLLM ranks are alive at once (two replicas, ~1.7 GB each). Skips where vllm is
not installed or does not import.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.vllm]  # skipped without vLLM, failed under CI

ray = pytest.importorskip("ray")

from conftest import skip_or_fail_without_vllm  # noqa: E402

from _vllm_ranks import TEMPERATURE, RankBase, by_value, save_tiny_model, seeded_requests  # noqa: E402

KV_BYTES = 64 << 20
LOGPROB_TOL = 1e-5


def _plain(results):
    return [(tuple(r.sample_id), list(r.response_ids), list(r.logprobs), r.version) for r in results]


class Rank(RankBase):
    """A stand-in device worker: joins the gloo world, then hosts one engine (a TP rank or whole)."""

    def join(self, rank: int, world_size: int, init_method: str) -> str:
        from dynaresize.comm import rendezvous

        rendezvous.init_world(rank=rank, world_size=world_size, init_method=init_method, backend="gloo",
                              timeout_s=60.0, generation=0)
        return self.new_group("before")

    def use_model(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def start(self, tp_size: int = 1, tp_rank: int = 0, port: int = 0) -> dict:
        from dynaresize.config import ModelConfig
        from dynaresize.roles.base import TPPlacement
        from dynaresize.roles.rollout_vllm import VLLMRolloutEngine
        from dynaresize.roles.vllm_tp import _rpc_tp_info

        tp = TPPlacement(tp_size, tp_rank, "127.0.0.1", port) if tp_size > 1 else None
        self.engine = VLLMRolloutEngine(ModelConfig(path=self.model_dir), TEMPERATURE, kv_cache_bytes=KV_BYTES,
                                        max_model_len=128, max_num_seqs=16, prefix_caching=False, tp=tp)
        env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        sd = self.weights()
        self.engine.set_weights(sd, 0)
        info = self.engine._llm.collective_rpc(_rpc_tp_info)[0]
        leaked = {k: v for k, v in os.environ.items() if k in env and v != env[k]}
        return {**info, "timings": dict(self.engine.timings), "env_leaked": leaked,
                "load_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                "shapes_full": self.engine._shapes == {k: tuple(v.shape) for k, v in sd.items()}}

    def generate(self):
        return _plain(self.engine.generate(seeded_requests()))

    def stepped(self):
        """Half the requests, three iterations, the rest added and one of the first aborted."""
        reqs = seeded_requests()
        half = len(reqs) // 2
        self.engine.add(reqs[:half])
        got, steps, trace = {}, 0, []
        while self.engine.has_unfinished():
            got.update((tuple(r[0]), r) for r in _plain(self.engine.step()))
            steps += 1
            trace.append(sorted(self.engine.progress().items()))
            if steps == 3:
                self.engine.add(reqs[half:])
                running = [r.sample_id for r in reqs[:half] if tuple(r.sample_id) not in got]
                trace.append(self.engine.abort(running[:1]))
        return got, trace

    def load(self, perturb: float, version: int) -> dict:
        self.engine.load_weights(self.weights(perturb), version)
        return dict(self.engine.timings)

    def digest(self, perturb: float) -> tuple[str, str]:
        """(the engine's digest, `state_dict_digest` of the weights of `perturb`), every name."""
        from dynaresize.roles.vllm_weights import state_dict_digest

        sd = self.weights(perturb)
        return self.engine.weights_digest(sorted(sd)), state_dict_digest(sd, sorted(sd))

    def release(self) -> dict:
        import gc

        self.engine.release()
        self.engine = None
        gc.collect()
        return {"rid_env": os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def ranks():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tmp = tempfile.TemporaryDirectory(prefix="dynaresize-vllm-tp-test-")
    try:
        model_dir = save_tiny_model(os.path.join(tmp.name, "model"))
        by_value(__name__)
        remote = ray.remote(num_cpus=1)(Rank)
        actors = [remote.remote(model_dir) for _ in range(4)]
        problem = ray.get(actors[0].vllm_import_error.remote(), timeout=300)
        if problem:
            skip_or_fail_without_vllm(f"vllm does not import in a Ray actor: {problem}")
        from dynaresize.comm import rendezvous

        init = rendezvous.world_init_method("127.0.0.1", rendezvous.free_port())
        # Three join the worker world, their world ranks unlike their TP ranks (actor i: rank 2 - i);
        # the fourth only hosts a second replica's rank.
        names = ray.get([a.join.remote(2 - i, 3, init) for i, a in enumerate(actors[:3])], timeout=120)
        assert len(set(names)) == 1
        yield actors, save_tiny_model(os.path.join(tmp.name, "kv1"), kv_heads=1)
    finally:
        ray.shutdown()
        tmp.cleanup()


def _start_tp2(pair, timeout=600):
    from dynaresize.comm import rendezvous

    port = rendezvous.free_port()
    return ray.get([a.start.remote(2, i, port) for i, a in enumerate(pair)], timeout=timeout)


def test_tp2_replica_in_worker_processes(ranks):
    from dynaresize.config_load import build_config
    from dynaresize.roles.base import TPPlacement
    from dynaresize.roles.factory import rollout_engine_from_config
    from dynaresize.roles.vllm_weights import REPLICAS_DIFFER

    with pytest.raises(ValueError, match="rollout.tensor_parallel"):
        rollout_engine_from_config(build_config({"rollout": {"engine": "hf"}}),
                                   tp=TPPlacement(2, 0, "127.0.0.1", 29500))

    (a0, a1, a2, a3), kv1_model = ranks
    t_all = time.perf_counter()
    # The one-rank reference, on a0: afterwards a0's private group counter differs from a1's.
    one = ray.get(a0.start.remote(), timeout=600)
    assert one["size"] == 1
    ref = ray.get(a0.generate.remote(), timeout=300)
    ray.get(a0.release.remote(), timeout=120)

    shm_before = _shm()
    t0 = time.perf_counter()
    infos = _start_tp2([a0, a1])
    tp2_start = time.perf_counter() - t0
    assert [i["rank"] for i in infos] == [0, 1] and {i["size"] for i in infos} == {2}
    assert {i["dist_module"] for i in infos} == {"torch.distributed"}  # not vLLM's SHM all-reduce
    assert all(i["shapes_full"] and not i["env_leaked"] for i in infos)

    # (i), (ii): the one-rank engine's tokens, on both ranks alike.
    out = ray.get([a0.generate.remote(), a1.generate.remote()], timeout=300)
    assert out[0] == out[1]
    equal = sum(r[1] == s[1] for r, s in zip(ref, out[0]))
    lp_diff = max(abs(x - y) for r, s in zip(ref, out[0]) for x, y in zip(r[2], s[2]))
    assert equal == len(ref) == 12 and lp_diff <= LOGPROB_TOL, (equal, lp_diff)
    assert all(len(r[1]) == q.forced_length for q, r in zip(seeded_requests(), ref) if q.forced_length)

    # (iii): driven request by request with identical calls, both ranks agree step by step.
    stepped = ray.get([a0.stepped.remote(), a1.stepped.remote()], timeout=300)
    assert stepped[0] == stepped[1]
    got, trace = stepped[0]
    assert len(got) == 11 and all(got[r[0]][1] == r[1] for r in ref if r[0] in got)

    # (iv): in-place load; every rank's digest covers every rank's slice.
    ray.get([a.load.remote(0.05, 1) for a in (a0, a1)], timeout=300)
    d = ray.get([a.digest.remote(0.05) for a in (a0, a1)], timeout=300)
    assert d[0][0] == d[1][0] == d[0][1] == d[1][1]
    ray.get([a0.load.remote(0.05, 2), a1.load.remote(0.07, 2)], timeout=300)  # rank 1: other weights
    d = ray.get([a0.digest.remote(0.05), a1.digest.remote(0.07)], timeout=300)
    assert d[0][0] == d[1][0] and d[0][0] not in (d[0][1], d[1][1])
    assert d[0][0].startswith(REPLICAS_DIFFER + "model.layers.0.input_layernorm.weight")  # replicated norms
    t0 = time.perf_counter()
    loads = ray.get([a.load.remote(0.0, 3) for a in (a0, a1)], timeout=300)
    load_s = time.perf_counter() - t0
    assert ray.get([a.generate.remote() for a in (a0, a1)], timeout=300)[0] == [r[:3] + (3,) for r in out[0]]

    # Two replicas on one node at once (four ranks): no shared segment, the same tokens.
    infos2 = _start_tp2([a2, a3])
    assert {i["dist_module"] for i in infos2} == {"torch.distributed"}
    both = ray.get([a.generate.remote() for a in (a0, a1, a2, a3)], timeout=300)
    assert [[r[1] for r in b] for b in both] == [[r[1] for r in ref]] * 4
    ray.get([a.release.remote() for a in (a2, a3)], timeout=120)
    # One KV head, two ranks: each holds a copy of it (vLLM's num_kv_head_replicas); the digest
    # keeps one, and the shapes are the full ones.
    ray.get([a.use_model.remote(kv1_model) for a in (a2, a3)])
    kv1 = _start_tp2([a2, a3])
    assert all(i["shapes_full"] for i in kv1)
    d = ray.get([a.digest.remote(0.0) for a in (a2, a3)], timeout=300)
    assert d[0][0] == d[1][0] == d[0][1]
    kv1_out = ray.get([a.generate.remote() for a in (a2, a3)], timeout=300)
    assert kv1_out[0] == kv1_out[1]
    ray.get([a.release.remote() for a in (a2, a3)], timeout=120)

    # (v): release leaves no /dev/shm segment; re-created in the same processes, the same tokens.
    released = ray.get([a.release.remote() for a in (a0, a1)], timeout=120)
    assert all(r["rid_env"] is None for r in released)
    assert _shm() - shm_before == set(), _shm() - shm_before
    again_infos = _start_tp2([a0, a1])
    again = ray.get([a.generate.remote() for a in (a0, a1)], timeout=300)
    assert again[0] == again[1] and [r[1] for r in again[0]] == [r[1] for r in ref]
    ray.get([a.release.remote() for a in (a0, a1)], timeout=120)
    assert _shm() - shm_before == set()

    # (vi): the worker world still works, group names agree on all three ranks.
    assert ray.get([a.all_reduce.remote() for a in (a0, a1, a2)], timeout=120) == [[6.0, 6.0]] * 3
    after = ray.get([a.new_group.remote("after") for a in (a0, a1, a2)], timeout=120)
    assert len(set(after)) == 1
    print(f"\nTP2 replica: start {tp2_start:.1f} s ({infos[0]['timings']}), restart "
          f"{again_infos[0]['timings']['start_s']:.1f} s, one-rank start {one['timings']['start_s']:.1f} s; "
          f"tokens equal {equal}/12, max |log-prob TP1 - TP2| {lp_diff:.1e}; load {load_s:.2f} s "
          f"({loads}), {infos[0]['load_bytes']} bytes per rank per load; total {time.perf_counter() - t_all:.1f} s")
