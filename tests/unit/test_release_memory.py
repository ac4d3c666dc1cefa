"""Release means collected (roles/device_memory.py): a device leaving training drops its
trainer, and the trainer's tensors are gone before an engine starts in that memory, even
though FSDP2's modules and hooks hold them in reference cycles and vLLM freezes the GC at
start. One real FSDP2 trainer on a one-rank gloo world in this process."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from dynaresize.comm import rendezvous
from dynaresize.config import ModelConfig
from dynaresize.rl import grpo
from dynaresize.rl.models import build_model
from dynaresize.roles.train_fsdp import FSDPTrainer
from dynaresize.roles.train_spec import TrainerSpec
from dynaresize.roles.train_state import OptimSettings

CFG = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256)


@pytest.fixture
def group():
    import torch.distributed as dist

    port = rendezvous.free_port()
    rendezvous.init_world(rank=0, world_size=1, init_method=rendezvous.world_init_method("127.0.0.1", port),
                          backend="gloo", timeout_s=60)
    try:
        yield dist.new_group([0])
    finally:
        rendezvous.destroy_world()


def _trained(group) -> FSDPTrainer:
    spec = TrainerSpec(model=CFG, optim=OptimSettings(lr=1e-2, max_grad_norm=1.0))
    tr = FSDPTrainer(spec, ranks=(0,), rank=0, group=group, init_model=build_model(CFG))
    mb = [grpo.TrainSample(sample_id=(0, 0, s), prompt_ids=[2, 10, 11], response_ids=[12, 13, 14],
                           rollout_logprobs=[-7.0] * 3, advantage=1.0 - s) for s in range(2)]

    def loss_fn(model, batch):
        b = grpo.dummy_micro_batch() if batch is None else batch
        return grpo.micro_batch_loss(model, b, total_response_tokens=6, clip_eps=0.2), {}

    tr.compute_grads([(0, mb)], loss_fn, num_micro_batches=1)
    tr.apply_optimizer()
    return tr


def test_a_dropped_trainer_is_collected_before_the_gc_is_frozen(group):
    from dynaresize.cluster.worker import DeviceWorker

    worker = types.SimpleNamespace(trainer=_trained(group), train_ranks=(0,))
    param = worker.trainer.params[0]
    refs = [weakref.ref(param), weakref.ref(param._local_tensor), weakref.ref(worker.trainer.model)]
    del param
    gc.collect()
    gc.disable()  # no automatic collection may do the release's work
    try:
        DeviceWorker._drop_trainer(worker)  # the path every leave of the train role takes
        gc.freeze()  # what the vLLM engine's start does next (roles/rollout_vllm.py)
        alive = [r() is not None for r in refs]
    finally:
        gc.unfreeze()
        gc.enable()
    assert worker.trainer is None and worker.train_ranks == ()
    assert alive == [False, False, False]


def test_release_device_memory_collects_cycles_on_any_device():
    from dynaresize.roles.device_memory import release_device_memory

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    a.weights = torch.zeros(4)
    ref = weakref.ref(a.weights)
    del a, b
    gc.disable()
    try:
        release_device_memory(torch.device("cpu"))
        gone = ref() is None
    finally:
        gc.enable()
    assert gone
