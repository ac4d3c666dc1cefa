"""A real VLLMRolloutEngine inside Ray actors that, like device workers, already belong to a
gloo world (default process group + a cached group), on a tiny tied-embedding GQA Qwen2.

Two actors (ranks 0 and 1 of one world), one engine each (two engines at most):
- seeded sampling: the same tokens for a request alone or in a batch, and in both engines;
- log-probs equal the trainer's recompute (`rl.grpo.response_logprobs` on the HF model) within
  1e-4 (measured ~5e-7), before and after an in-place weight update;
- `load_weights` in place: the digest read back from the engine equals `state_dict_digest` of
  the new weights (the tied lm_head included, also when the trainer's names leave it out: a
  stale head kernel is flagged), and generation changes accordingly;
- the worker's world is intact: collectives on the old group, and a new group created after
  the engines gets the same name on both ranks; torch's thread count still obeys;
- `release` frees the KV cache's memory and a re-start gives the same tokens;
- the rollout.vllm_* config fields take effect in the live engine.

Skips (with the reason) only where vllm is not installed or does not import.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.vllm]  # skipped without vLLM, failed under CI (tests/conftest.py)

ray = pytest.importorskip("ray")

from conftest import skip_or_fail_without_vllm  # noqa: E402

from _vllm_ranks import TEMPERATURE, RankBase, by_value, save_tiny_model, seeded_requests  # noqa: E402

KV_BYTES = 256 << 20
LOGPROB_TOL = 1e-4


class EngineActor(RankBase):
    """A stand-in device worker: joins a gloo world, caches a group, then runs a vLLM engine."""

    def __init__(self, rank: int, model_dir: str) -> None:
        super().__init__(model_dir)
        self.rank = rank

    def preload(self) -> float:
        from dynaresize.roles.vllm_process import preload_vllm

        return preload_vllm()

    def join(self, init_method: str) -> str:
        from dynaresize.comm import rendezvous

        rendezvous.init_world(rank=self.rank, world_size=2, init_method=init_method, backend="gloo",
                              timeout_s=60.0, generation=0)
        return self.new_group("before")

    def start(self, perturb: float = 0.0, version: int = 0, **rollout) -> dict:
        from dynaresize.config_load import build_config
        from dynaresize.roles.factory import rollout_engine_from_config

        cfg = build_config({"model": {"path": self.model_dir}, "seed": 3,
                            "rollout": {"engine": "vllm", "temperature": TEMPERATURE,
                                        "vllm_kv_cache_bytes": KV_BYTES, **rollout}})
        if self.engine is None:
            self.engine = rollout_engine_from_config(cfg)
        self.engine.set_weights(self.weights(perturb), version)
        return dict(self.engine.timings)

    def load(self, perturb: float, version: int) -> dict:
        sd = self.weights(perturb)
        self.engine.load_weights(sd, version)
        return dict(self.engine.timings)

    def digests(self, perturb: float, trainer_names: bool = False) -> tuple[str, str, str]:
        """(engine, these weights, the initial weights) digests over every name, or over the
        names a trainer sends (`named_parameters`: the tied weight once, as the embedding)."""
        from dynaresize.config import ModelConfig
        from dynaresize.rl.models import build_model
        from dynaresize.roles.vllm_weights import state_dict_digest

        sd = self.weights(perturb)
        names = sorted(sd)
        if trainer_names:
            names = [n for n, _ in build_model(ModelConfig(path=self.model_dir)).named_parameters()]
            assert "lm_head.weight" not in names
        return self.engine.weights_digest(names), state_dict_digest(sd, names), state_dict_digest(self.weights(0.0), names)

    def corrupt_tied_head(self) -> None:
        """Make the lm_head's kernel compute with a copy of other weights (a stale head)."""
        def corrupt(worker):
            head = worker.model_runner.get_model().lm_head
            stale = head.weight.detach() * 1.5
            head.cpu_linear = lambda x, weight, bias: x @ stale.t()

        self.engine._llm.collective_rpc(corrupt)

    def generate(self, alone: bool = False, step: int = 0):
        reqs = seeded_requests(step)
        if alone:
            return [self.engine.generate([r])[0] for r in reqs]
        return self.engine.generate(reqs)

    def generate_one(self, request):
        return self.engine.generate([request])

    def stepped(self, step: int = 0) -> tuple[dict, list]:
        """The engine driven request by request: half the requests added, three iterations,
        the rest added mid-generation and one of the first aborted; (results by id, aborted,
        the aborted one's tokens so far as `progress` gave them just before)."""
        reqs = seeded_requests(step)
        half = len(reqs) // 2
        self.engine.add(reqs[:half])
        got, steps, aborted, made = {}, 0, [], ([], [])
        while self.engine.has_unfinished():
            got.update((r.sample_id, r) for r in self.engine.step())
            steps += 1
            if steps == 3:
                self.engine.add(reqs[half:])
                running = [r.sample_id for r in reqs[:half] if r.sample_id not in got]
                made = self.engine.progress()[running[0]]
                aborted = self.engine.abort(running[:1])
        return got, aborted, made

    def recompute_logprobs(self, results, perturb: float) -> float:
        """Max |engine log-prob - trainer recompute| over all tokens (HF model, same weights)."""
        import torch

        from dynaresize.config import ModelConfig
        from dynaresize.rl.grpo import TrainSample, response_logprobs
        from dynaresize.rl.models import build_model

        model = build_model(ModelConfig(path=self.model_dir))
        model.load_state_dict(self.weights(perturb))
        prompts = {r.sample_id: r.prompt_ids for r in seeded_requests(results[0].sample_id[0])}
        worst = 0.0
        with torch.no_grad():
            for res in results:
                sample = TrainSample(res.sample_id, prompts[res.sample_id], res.response_ids, res.logprobs, 0.0)
                ref = response_logprobs(model, [sample], temperature=TEMPERATURE)[0]
                worst = max(worst, float((ref - torch.tensor(res.logprobs)).abs().max()))
        return worst

    def settings(self) -> dict:
        return {**self.engine.engine_settings(), "loaded": self.engine.loaded, "kv": self.engine.alloc_kv_cache()}

    def threads(self) -> tuple[int, int]:
        import torch

        torch.set_num_threads(2)
        two = torch.get_num_threads()
        torch.set_num_threads(1)
        return two, torch.get_num_threads()

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def release(self) -> dict:
        import gc

        self.engine.release()
        gc.collect()
        return {"loaded": self.engine.loaded, "kv": self.engine.alloc_kv_cache(), **self.engine.timings}


@pytest.fixture(scope="module")
def actors():
    # address="local": a cluster of our own, even while another `ray start` cluster runs here.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tmp = tempfile.TemporaryDirectory(prefix="dynaresize-vllm-test-")
    try:
        model_dir = save_tiny_model(os.path.join(tmp.name, "model"))
        # By value: Ray's workers cannot import this test module by name.
        by_value(__name__)
        remote = ray.remote(num_cpus=1)(EngineActor)
        pair = [remote.remote(rank, model_dir) for rank in range(2)]
        problem = ray.get(pair[0].vllm_import_error.remote(), timeout=300)
        if problem:
            skip_or_fail_without_vllm(f"vllm does not import in a Ray actor: {problem}")
        from dynaresize.comm import rendezvous

        init = rendezvous.world_init_method(rendezvous.node_ip(), rendezvous.free_port())
        names = ray.get([a.join.remote(init) for a in pair], timeout=120)
        assert names[0] == names[1]
        yield pair
    finally:
        ray.shutdown()
        tmp.cleanup()


def test_vllm_engine_in_a_worker_with_a_gloo_world(actors):
    a, b = actors
    t0 = time.perf_counter()
    # Engine A from config with non-default vllm_* settings; engine B with the defaults, its
    # imports done ahead by `preload` (what a worker can do off the critical path).
    preload_b = ray.get(b.preload.remote(), timeout=600)
    start_a, start_b = ray.get([a.start.remote(vllm_max_num_seqs=3, vllm_max_model_len=128),
                                b.start.remote()], timeout=600)
    settings = ray.get(a.settings.remote())
    assert (settings["max_num_seqs"], settings["max_model_len"]) == (3, 128)
    assert settings["kv_cache_memory_bytes"] == KV_BYTES and settings["kv"] == KV_BYTES
    assert settings["tied_embeddings"] and settings["logprobs_mode"] == "processed_logprobs"
    assert not settings["enable_chunked_prefill"] and settings["dtype"] == "float32"
    assert ray.get(b.settings.remote())["max_num_seqs"] == 64  # the config default

    # The worker's world survived the engines' creation, and group names still agree.
    assert ray.get([x.all_reduce.remote() for x in actors]) == [[3.0, 3.0]] * 2
    after = ray.get([x.new_group.remote("after") for x in actors])
    assert after[0] == after[1]
    assert ray.get([x.threads.remote() for x in actors]) == [(2, 1)] * 2

    # Seeded sampling: alone == batched, engine A == engine B (batch of 12 with max_num_seqs 3 vs 64).
    batched, alone, other = ray.get([a.generate.remote(), a.generate.remote(alone=True), b.generate.remote()])
    tokens = [r.response_ids for r in batched]
    assert tokens == [r.response_ids for r in alone] == [r.response_ids for r in other]
    # Request by request (add / step / abort): admitted mid-generation, the same tokens as alone.
    stepped, aborted, made = ray.get(a.stepped.remote())
    assert len(aborted) == 1 and aborted[0] not in stepped
    by_id = {r.sample_id: r for r in alone}
    assert 1 <= len(made[0]) == len(made[1]) and made[0] == by_id[aborted[0]].response_ids[:len(made[0])]
    assert set(stepped) == {r.sample_id for r in alone} - set(aborted)
    assert all(stepped[r.sample_id].response_ids == r.response_ids for r in alone if r.sample_id in stepped)
    reqs = seeded_requests(0)
    for req, res in zip(reqs, batched):
        assert res.sample_id == req.sample_id and res.version == 0 and len(res.logprobs) == len(res.response_ids)
        if req.forced_length is not None:
            assert len(res.response_ids) == req.forced_length  # EOS ignored
        else:
            assert len(res.response_ids) == req.max_new_tokens or res.response_ids[-1] == 1  # EOS kept
    batch_noise = max(abs(x - y) for r, s in zip(batched, alone) for x, y in zip(r.logprobs, s.logprobs))
    engine_noise = max(abs(x - y) for r, s in zip(batched, other) for x, y in zip(r.logprobs, s.logprobs))
    assert batch_noise <= LOGPROB_TOL and engine_noise <= LOGPROB_TOL
    recompute_gap = ray.get(a.recompute_logprobs.remote(batched, 0.0))
    assert recompute_gap <= LOGPROB_TOL

    # max_model_len takes effect: a request past 128 tokens is refused.
    from dynaresize.roles.base import GenRequest
    from dynaresize.roles.vllm_weights import STALE_HEAD

    with pytest.raises(ray.exceptions.RayTaskError, match="max_model_len 128"):
        ray.get(a.generate_one.remote(GenRequest((9, 0, 0), [2] * 100, 40, 1)))

    # In-place update: the engine's own weights read back equal the new state dict.
    engine_digest, new_digest, old_digest = ray.get(a.digests.remote(0.0))
    assert engine_digest == new_digest == old_digest
    load = ray.get(a.load.remote(0.05, 1))
    engine_digest, new_digest, old_digest = ray.get(a.digests.remote(0.05))
    assert engine_digest == new_digest != old_digest
    engine_digest, new_digest, _ = ray.get(a.digests.remote(0.05, trainer_names=True))
    assert engine_digest == new_digest  # the tie checked inside, though lm_head is not named
    ray.get(a.corrupt_tied_head.remote())
    engine_digest, new_digest, _ = ray.get(a.digests.remote(0.05, trainer_names=True))
    assert engine_digest == STALE_HEAD + new_digest  # a stale head never matches the trainers
    ray.get(a.load.remote(0.05, 1))  # a reload re-dispatches the head
    engine_digest, new_digest, _ = ray.get(a.digests.remote(0.05, trainer_names=True))
    assert engine_digest == new_digest
    updated = ray.get(a.generate.remote())
    assert [r.response_ids for r in updated] != tokens and {r.version for r in updated} == {1}
    assert ray.get(a.recompute_logprobs.remote(updated, 0.05)) <= LOGPROB_TOL  # lm_head not stale

    # Release frees the KV cache; a re-start (same weights) gives the same tokens.
    rss_before = ray.get(a.rss_bytes.remote())
    released = ray.get(a.release.remote())
    rss_after = ray.get(a.rss_bytes.remote())
    assert not released["loaded"] and released["kv"] == 0
    assert rss_before - rss_after > KV_BYTES // 2, (rss_before, rss_after)
    restart = ray.get(a.start.remote(0.05, 2))
    again = ray.get(a.generate.remote())
    assert [r.response_ids for r in again] == [r.response_ids for r in updated] and {r.version for r in again} == {2}

    # Both engines gone: the world still works and agrees on group names.
    ray.get([x.release.remote() for x in actors])
    assert ray.get([x.all_reduce.remote() for x in actors]) == [[3.0, 3.0, 3.0]] * 2
    last = ray.get([x.new_group.remote("last") for x in actors])
    assert last[0] == last[1]
    print(f"\nvLLM engine: start A {start_a}, preload B {preload_b:.1f} s, start B {start_b}, load {load}, release {released}, "
          f"restart {restart}, log-prob differences: alone vs batched {batch_noise:.1e}, engine A vs B "
          f"{engine_noise:.1e}, engine vs trainer recompute {recompute_gap:.1e}; RSS freed "
          f"{(rss_before - rss_after) / 2**20:.0f} MiB, total {time.perf_counter() - t0:.1f} s")
