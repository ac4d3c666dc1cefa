"""The KL reference under `train.lora` (cluster/worker_train.py `_loss_fn`): the worker's own loss
function, on peft's wrap of the policy, takes the reference log-probs from the same module with
the adapter disabled (no second model): the KL is 0 while lora_B is zero (the policy is the
base), > 0 once the adapter moved, and equals the KL to a separate copy of the base."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dynaresize.config_load import build_config
from dynaresize.rl import grpo
from dynaresize.rl.models import build_model
from dynaresize.roles.lora_model import initial_adapter, trainable_specs, wire_name, wrap

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 300}


def _worker(lora: bool):
    from dynaresize.cluster.worker import DeviceWorker

    train = {"kl_coef": 0.1, **({"lora": {"rank": 2, "alpha": 4.0}} if lora else {})}
    cfg = build_config({"model": TINY, "rollout": {"prompts_per_step": 1, "samples_per_prompt": 2,
                                                   "max_new_tokens": 8}, "train": train})
    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None
    worker.cfg = cfg
    worker.trainer = SimpleNamespace(ref=None if lora else build_model(cfg.model))  # without LoRA: a second copy
    return worker, cfg


def _kl(worker, model) -> float:
    samples = [grpo.TrainSample(sample_id=(0, 0, i), prompt_ids=[2, 5 + i, 6], response_ids=[9, 40 + i, 77, 3],
                                rollout_logprobs=[-3.0] * 4, advantage=1.0 - 2 * i) for i in range(2)]
    fn = worker._loss_fn(grpo.total_response_tokens(samples))
    _, stats = fn(model, samples)
    return stats["kl_sum"]


def _lora_policy(cfg, b_value: float):
    model = wrap(build_model(cfg.model), cfg.train.lora)
    start = initial_adapter(trainable_specs(cfg.model, cfg.train.lora), cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (w := wire_name(name)) is not None:
                p.copy_(start[w] if w.endswith("lora_A") else torch.full_like(p, b_value))
    return model


def test_lora_kl_is_to_the_base_with_the_adapter_disabled():
    worker, cfg = _worker(lora=True)
    assert _kl(worker, _lora_policy(cfg, 0.0)) == 0.0
    moved = _lora_policy(cfg, 0.05)
    kl = _kl(worker, moved)
    assert kl > 0
    # the same KL as against a separate frozen copy of the base (the path without LoRA)
    plain, _ = _worker(lora=False)
    assert abs(_kl(plain, moved) - kl) <= 1e-6 * max(1.0, kl)
    assert all(not p.requires_grad or wire_name(n) for n, p in moved.named_parameters())
