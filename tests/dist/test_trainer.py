"""ShardedTrainer across processes (torch.multiprocessing + gloo, no Ray): the same micro-batches
give the same parameters at W = 1, 2, 3, 4 training ranks, and a checkpoint saved at W=4 loads
at W=3 and W=1 to the identical state, from which training continues as if uninterrupted.

One spawn of 4 processes runs every case (a world of 4 with subgroups for W=2, 3), because
starting processes that import torch and transformers dominates the cost on 2 cores.
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

WORLD = 4
NUM_MICRO_BATCHES = 10  # not a multiple of 3 or 4: uneven micro-batch counts per rank
NUM_STEPS = 3


def _tiny_qwen2(tied: bool, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def _loss_fn(model, ids):
    return model(input_ids=ids, labels=ids).loss, ids[:, 1:].numel()


def _micro_batches(step: int) -> list[tuple[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [(i, torch.randint(0, 256, (2, 24), generator=gen)) for i in range(NUM_MICRO_BATCHES)]


def _mine(step: int, num_ranks: int, index: int) -> list[tuple[int, torch.Tensor]]:
    return [(i, mb) for i, mb in _micro_batches(step) if i % num_ranks == index]  # round robin by index


def _worker(rank: int, out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from dynaresize.roles.train_torch import OptimSettings, ShardedTrainer

    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", WORLD), rank=rank,
                            world_size=WORLD, timeout=timeout)
    groups = {w: dist.new_group(list(range(w)), timeout=timeout) for w in (2, 3)}  # same order everywhere
    groups[4] = dist.group.WORLD
    groups[1] = None
    settings = OptimSettings(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, max_grad_norm=1.0)
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        for w in (1, 2, 3, 4):
            if rank < w:
                trainer = ShardedTrainer.build_from_model(_tiny_qwen2(tied, 0), range(w), rank, settings, seed=7)
                stats = [trainer.train_step(_mine(s, w, rank), _loss_fn, group=groups[w],
                                            num_micro_batches=NUM_MICRO_BATCHES) for s in range(NUM_STEPS)]
                result = {"stats": stats, "shards": {k: v.clone() for k, v in trainer.state_shards().items()}}
                if rank == 0:
                    result["full"] = trainer.full_state_dict()
                if w == 4 and not tied:
                    trainer.save_checkpoint(f"{out}/ck4", group=groups[4], extra={"tag": tag})
                    trainer.train_step(_mine(NUM_STEPS, w, rank), _loss_fn, group=groups[w],
                                       num_micro_batches=NUM_MICRO_BATCHES)
                    result["next_full"] = trainer.full_state_dict()
                torch.save(result, f"{out}/{tag}-w{w}-r{rank}.pt")
            dist.barrier()
    for w in (3, 1):  # reshard on load, then one more step at the new size
        if rank < w:
            trainer = ShardedTrainer(_tiny_qwen2(False, 99), settings)
            trainer.load_checkpoint(f"{out}/ck4", range(w), rank, group=groups[w])
            result = {"shards": {k: v.clone() for k, v in trainer.state_shards().items()},
                      "scalars": trainer.scalars(), "full": trainer.full_state_dict()}
            trainer.train_step(_mine(NUM_STEPS, w, rank), _loss_fn, group=groups[w],
                               num_micro_batches=NUM_MICRO_BATCHES)
            result["next_full"] = trainer.full_state_dict()
            torch.save(result, f"{out}/load-w{w}-r{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()
    # Results are on disk; skip interpreter teardown, which costs seconds per process (torch +
    # transformers) on a loaded 2-core machine. An exception above still reaches mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_dist")
    mp.spawn(_worker, args=(str(out),), nprocs=WORLD, join=True)
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _flat(out: Path, prefix: str, w: int) -> dict[str, torch.Tensor]:
    parts = [_load(out, f"{prefix}-w{w}-r{r}")["shards"] for r in range(w)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.dist
@pytest.mark.parametrize("tag", ["untied", "tied"])
def test_final_params_do_not_depend_on_world_size(runs, tag):
    ref = _load(runs, f"{tag}-w1-r0")
    ref_state = _flat(runs, tag, 1)
    for w in (1, 2, 3, 4):
        got = _load(runs, f"{tag}-w{w}-r0")
        diff = _max_diff(ref["full"], got["full"])
        moments = max((ref_state[k].double() - v.double()).abs().max().item() for k, v in _flat(runs, tag, w).items())
        bitwise = all(torch.equal(ref["full"][k], got["full"][k]) for k in ref["full"])
        step_s = sum(s["step_s"] for s in got["stats"][1:]) / (NUM_STEPS - 1)
        print(f"{tag} W={w}: max param diff vs W=1 {diff:.3g} (bitwise {bitwise}), moments {moments:.3g}, "
              f"step {step_s * 1e3:.1f} ms")
        assert diff <= 1e-6 and moments <= 1e-6
        assert [s["loss_sum"] for s in got["stats"]] == pytest.approx([s["loss_sum"] for s in ref["stats"]], rel=1e-9)
        assert all(s["num_tokens"] == NUM_MICRO_BATCHES * 2 * 23 for s in got["stats"])
    assert _max_diff(ref["full"], _tiny_qwen2(tag == "tied", 0).state_dict()) > 1e-4  # training did move


@pytest.mark.dist
def test_checkpoint_saved_at_four_loads_at_three_and_one(runs):
    saved = _flat(runs, "untied", 4)
    saved_full = _load(runs, "untied-w4-r0")["full"]
    for w in (3, 1):
        loaded = _flat(runs, "load", w)
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), (w, k)
        ranks = [_load(runs, f"load-w{w}-r{r}") for r in range(w)]
        assert all(r["scalars"]["step"] == NUM_STEPS and r["scalars"]["lr_step"] == NUM_STEPS for r in ranks)
        for r in ranks:
            assert all(torch.equal(r["full"][k], saved_full[k]) for k in saved_full)


@pytest.mark.dist
def test_resumed_step_equals_uninterrupted_step(runs):
    straight = _load(runs, "untied-w4-r0")["next_full"]
    for w in (3, 1):
        diff = _max_diff(straight, _load(runs, f"load-w{w}-r0")["next_full"])
        print(f"resume W=4 -> W={w}: max param diff after one more step {diff:.3g}")
        assert diff <= 1e-6
