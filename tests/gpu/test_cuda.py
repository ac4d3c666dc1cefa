"""CUDA path checks (skipped without a GPU): the engine, the trainer and NCCL on one device.

Run on a GPU machine with `scripts/device_check.sh` (the machine's own python3, no Ray: these
tests import only the roles and the trainer).
"""

import gc

import pytest
import torch

from dynaresize.roles.device_memory import release_device_memory

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


def test_fsdp_trainer_step_sync_and_memory_on_cuda():
    """FSDP2 trainer on an NCCL world of one: a step on cuda:0 moves the weights, the full
    weights come back for the sync, the state lives on the GPU and is freed on release."""
    import torch.distributed as dist

    from dynaresize.comm import rendezvous
    from dynaresize.rl import grpo
    from dynaresize.rl.models import build_model
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import TrainerSpec
    from dynaresize.roles.train_state import OptimSettings

    port = rendezvous.free_port()
    rendezvous.init_world(rank=0, world_size=1, init_method=rendezvous.world_init_method("127.0.0.1", port),
                          backend="nccl", timeout_s=60, device_index=0)
    try:
        assert dist.get_backend() == "nccl"
        group = dist.new_group([0])
        for dtype in ("fp32", "bf16"):
            base = torch.cuda.memory_allocated()
            spec = TrainerSpec(model=_cfg(), optim=OptimSettings(lr=1e-2, max_grad_norm=1.0), compute_dtype=dtype)
            tr = FSDPTrainer(spec, ranks=(0,), rank=0, group=group, device="cuda", init_model=build_model(_cfg()))
            assert all(t.is_cuda for t in tr.pieces("param"))
            before = [t.clone() for t in tr.pieces("param")]
            mb = [grpo.TrainSample(sample_id=(0, 0, s), prompt_ids=[2, 10, 11], response_ids=[12, 13, 14],
                                   rollout_logprobs=[-7.0] * 3, advantage=1.0 - s) for s in range(2)]

            def loss_fn(model, batch):
                b = grpo.dummy_micro_batch() if batch is None else batch
                return grpo.micro_batch_loss(model, b, total_response_tokens=6, clip_eps=0.2), {}

            stats = tr.compute_grads([(0, mb)], loss_fn, num_micro_batches=1)
            tr.apply_optimizer()
            assert stats["grad_norm"] > 0 and stats["train_state_bytes"] > 0
            assert any(not torch.equal(a, b) for a, b in zip(before, tr.pieces("param")))
            full = dict(tr.full_params())
            assert all(t.is_cuda and t.dtype == torch.float32 for t in full.values())
            del full, before
            gc.collect()
            held = torch.cuda.memory_allocated() - base
            assert held >= stats["train_state_bytes"] > 0, dtype  # the state lives on the GPU
            tr.release()
            del tr
            gc.collect()
            release_device_memory(torch.device("cuda"))  # what a role switch does
            left = torch.cuda.memory_allocated() - base
            # Release gives back what the trainer held (a release that frees nothing fails here).
            assert left <= 0.1 * held, (dtype, left, held)
    finally:
        rendezvous.destroy_world()
