"""FSDPTrainer with `train.lora` across 2 processes (torch.multiprocessing + gloo, no Ray).

- Only the adapter trains: the trainer's names, state kinds and full params are the adapter's
  (wire names, roles/lora.py); the base weights stay the model's.
- Deterministic mode: the adapter and its moments after 3 steps are bit-identical at W = 1 and
  W = 2 (frozen base and trainable adapter in the same FSDP units).
- A reshard W=2 -> W=1 moves the adapter and its moments only (bytes: rank 1's rows of the
  fp64 master and two fp64 moments), the new trainer fills its base from the initial weights,
  and training continues as it would have at W=2.
- The step-0 adapter is the seed's (`initial_adapter`): lora_B zero, lora_A the same everywhere.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
NUM_MICRO_BATCHES = 5
NUM_STEPS = 3


def _model_cfg():
    from dynaresize.config import ModelConfig

    return ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       tie_word_embeddings=True)


def _spec():
    from dynaresize.config import LoraConfig
    from dynaresize.roles.train_spec import TrainerSpec
    from dynaresize.roles.train_state import OptimSettings

    optim = OptimSettings(lr=3e-2, betas=(0.9, 0.95), weight_decay=0.01, max_grad_norm=1.0)
    return TrainerSpec(model=_model_cfg(), optim=optim, deterministic=True, seed=7,
                       lora=LoraConfig(rank=4, alpha=8.0, dropout=0.1))


def _loss_fn(model, ids):
    if ids is None:
        ids = torch.zeros((1, 2), dtype=torch.long)
        return model(input_ids=ids, labels=ids).loss * 0.0, {}
    loss = model(input_ids=ids, labels=ids).loss
    return loss, {"loss_sum": float(loss), "num_tokens": ids[:, 1:].numel()}


def _step(trainer, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    mbs = [(i, torch.randint(0, 300, (2, 16), generator=gen)) for i in range(NUM_MICRO_BATCHES)]
    w = len(trainer.ranks)
    stats = trainer.compute_grads([(i, mb) for i, mb in mbs if i % w == trainer.index], _loss_fn,
                                  num_micro_batches=NUM_MICRO_BATCHES)
    stats.update(trainer.apply_optimizer())
    return stats


def _worker(rank: int, out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from dynaresize.reshard.layout import RowChunkLayout
    from dynaresize.roles.initial_weights import initial_weights
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_reshard import move_state

    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", WORLD), rank=rank,
                            world_size=WORLD, timeout=timeout)
    groups = {w: dist.new_group(list(range(w)), timeout=timeout) for w in (1, 2)}
    spec = _spec()

    def trainer(w, init=True):
        return FSDPTrainer(spec, ranks=range(w), rank=rank, group=groups[w],
                           init_model=initial_weights(spec.model) if init else None)

    for w in (1, 2):
        if rank < w:
            t = trainer(w)
            first = dict(t.full_params())
            stats = [_step(t, s) for s in range(NUM_STEPS)]
            state = {k: [p.clone() for p in t.pieces(k)] for k in spec.kinds()}
            base = {n: p.full_tensor().detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
            torch.save({"first": first, "stats": stats, "full": dict(t.full_params()), "names": t.names,
                        "state": state, "base": base, "layout": t.layout.describe(), "digest": t.digest(),
                        "kinds": spec.kinds()}, f"{out}/w{w}-r{rank}.pt")
        dist.barrier()

    t2 = trainer(2)
    for s in range(NUM_STEPS):
        _step(t2, s)
    t1 = trainer(1, init=False) if rank == 0 else None
    st = move_state(t2, t1, kinds=spec.kinds(), old_layout=t2.layout,
                    new_layout=RowChunkLayout(t2.layout.shapes, (0,)), rank=rank, spec=spec,
                    staging_bytes=4096, group=dist.group.WORLD)
    if t1 is not None:
        t1.load_scalars(t2.scalars())
        _step(t1, NUM_STEPS)
        torch.save({"after": dict(t1.full_params()), "stats": st.to_dict()}, f"{out}/reshard.pt")
    else:
        torch.save({"stats": st.to_dict()}, f"{out}/reshard-r1.pt")
    _step(t2, NUM_STEPS)
    full = dict(t2.full_params())
    if rank == 0:
        torch.save(full, f"{out}/w2-next.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_lora")
    mp.spawn(_worker, args=(str(out),), nprocs=WORLD, join=True)
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


@pytest.mark.dist
def test_only_the_adapter_trains_and_is_the_state(runs):
    from dynaresize.rl.models import build_model
    from dynaresize.roles.lora_model import adapter_specs, initial_adapter

    one = _load(runs, "w1-r0")
    spec = _spec()
    specs = adapter_specs(spec.model, spec.lora)
    assert one["names"] == [n for n, _ in specs] and all(n.endswith((".lora_A", ".lora_B")) for n in one["names"])
    assert [tuple(t.shape) for t in one["full"].values()] == [s for _, s in specs]
    assert one["kinds"] == ("param", "exp_avg", "exp_avg_sq")
    numel = sum(torch.Size(s).numel() for _, s in specs)
    assert sum(p.numel() for p in one["state"]["param"]) == numel  # the adapter's, nothing of the base
    start = initial_adapter(specs, 7)
    assert all(torch.equal(one["first"][n], start[n]) for n in start)
    assert all(not t.any() for n, t in start.items() if n.endswith("lora_B"))
    assert any(not torch.equal(one["full"][n], start[n]) for n in start if n.endswith("lora_B"))  # it trained
    model = dict(build_model(spec.model).named_parameters())
    from dynaresize.roles.lora_model import base_name

    for name, t in one["base"].items():  # the frozen base is the model's, unchanged by training
        assert torch.equal(t.to(torch.float32), model[base_name(name)].detach()), name


@pytest.mark.dist
def test_deterministic_lora_does_not_depend_on_world_size(runs):
    one, two = _load(runs, "w1-r0"), _load(runs, "w2-r0")
    assert one["digest"] == two["digest"]
    assert all(torch.equal(one["full"][k], two["full"][k]) for k in one["full"])
    assert [s["loss"] for s in one["stats"]] == [s["loss"] for s in two["stats"]]


@pytest.mark.dist
def test_reshard_moves_only_the_adapter_and_training_continues(runs):
    spec = _spec()
    from dynaresize.roles.lora_model import adapter_specs

    r0, r1 = _load(runs, "reshard"), _load(runs, "reshard-r1")
    # rank 0 receives rank 1's rows of the adapter and its two moments (fp64: deterministic), nothing else
    rows_of_1 = sum((s[0] - -(-s[0] // 2)) * torch.Size(s[1:]).numel() for _, s in adapter_specs(spec.model, spec.lora))
    assert r0["stats"]["bytes_received"] == rows_of_1 * 8 * 3
    assert r1["stats"]["bytes_received"] == 0
    straight = _load(runs, "w2-next")
    assert all(torch.equal(r0["after"][k], straight[k]) for k in straight)
