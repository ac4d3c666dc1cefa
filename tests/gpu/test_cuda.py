"""CUDA path checks (skipped without a GPU): the engine, the trainer and NCCL on one device.

Run on a GPU machine with `scripts/device_check.sh`.
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cfg():
    from dynaresize.config import ModelConfig

    return ModelConfig()


def test_engine_generates_on_cuda_with_seeded_tokens():
    from dynaresize.rl.models import build_model
    from dynaresize.roles.base import GenRequest
    from dynaresize.roles.rollout_hf import HFRolloutEngine

    engine = HFRolloutEngine(_cfg(), 1.0, batch_rows=4, device="cuda")
    engine.set_weights(build_model(_cfg()).state_dict(), 0)
    reqs = [GenRequest(sample_id=(0, 0, s), prompt_ids=[2, 10, 11, 12], max_new_tokens=16, seed=100 + s,
                       forced_length=16) for s in range(4)]
    a = engine.generate(reqs)
    b = engine.generate(reqs[:1])
    assert all(len(r.response_ids) == 16 for r in a)
    assert a[0].response_ids == b[0].response_ids  # a sample's tokens do not depend on its batch


def test_trainer_step_and_nccl_world_of_one(tmp_path):
    import torch.distributed as dist

    from dynaresize.comm import rendezvous
    from dynaresize.rl.models import build_model
    from dynaresize.roles.train_torch import ShardedTrainer

    port = rendezvous.free_port()
    rendezvous.init_world(rank=0, world_size=1, init_method=rendezvous.world_init_method("127.0.0.1", port),
                          backend="nccl", timeout_s=60, device_index=0)
    try:
        assert dist.get_backend() == "nccl"
        model = build_model(_cfg()).cuda().train()
        trainer = ShardedTrainer.build_from_model(model, (0,), 0)
        batch = torch.randint(4, 2000, (2, 12), device="cuda")

        def loss_fn(m, mb):
            return m(input_ids=mb, labels=mb).loss

        before = trainer.state_shards()["param"].clone()
        stats = trainer.train_step([(0, batch)], loss_fn, group=None, num_micro_batches=1)
        assert stats["step"] == 1
        assert not torch.equal(before, trainer.state_shards()["param"])
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert float(t.sum()) == 4.0
    finally:
        rendezvous.destroy_world()
