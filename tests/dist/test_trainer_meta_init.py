"""A trainer builds its model on meta and materialises only its shard (roles/initial_weights.py).

Two gloo ranks (torch.multiprocessing, no Ray), each building FSDPTrainers of a tiny tied Qwen2:
- from `InitialWeights` (meta, fully_shard, to_empty, this rank's rows filled) and from the full
  model (the old path): every parameter and reference shard bitwise equal, for the built-in model
  (fp64 deterministic masters and fp32) and for a model folder saved in bf16;
- the folder's trainer reads from the safetensors only its own rows (`rows_read`), never a
  whole parameter, and the storages of its local parameter tensors sum to about half of the
  model's bytes (its shard, FSDP's padding included).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _model_cfg(path=None):
    from dynaresize.config import ModelConfig

    return ModelConfig(path=path, vocab_size=301, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       tie_word_embeddings=True)


def _storage_bytes(trainer) -> int:
    seen: dict[int, int] = {}
    for p in trainer.params:
        s = p.to_local().untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _worker(rank: int, out: str, folder: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from dynaresize.rl.models import build_model
    from dynaresize.roles.initial_weights import InitialWeights
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import TrainerSpec, empty_model
    from dynaresize.roles.train_state import OptimSettings

    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    optim = OptimSettings(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0)
    result = {}
    for label, cfg in (("builtin", _model_cfg()), ("folder", _model_cfg(folder))):
        for det in (True, False):
            spec = TrainerSpec(model=cfg, optim=optim, deterministic=det, with_ref=True, seed=3)
            rows = InitialWeights.of(cfg, empty_model(cfg))
            new = FSDPTrainer(spec, ranks=range(WORLD), rank=rank, group=dist.group.WORLD, init_model=rows)
            old = FSDPTrainer(spec, ranks=range(WORLD), rank=rank, group=dist.group.WORLD,
                              init_model=build_model(cfg))
            key = f"{label}-{'det' if det else 'fp32'}"
            result[key] = {
                "equal": all(torch.equal(a, b) for k in ("param", "ref") for a, b in zip(new.pieces(k), old.pieces(k))),
                "dtypes": sorted({str(t.dtype) for t in new.pieces("param")}),
                "whole": rows.whole, "rows_read": rows.rows_read,
                "shapes": {n: list(p.shape) for n, p in zip(new.names, new.params)},
                "local_rows": {n: int(p.to_local().shape[0]) for n, p in zip(new.names, new.params)},
                "storage_bytes": _storage_bytes(new),
                "model_bytes": sum(p.numel() for p in new.params) * new.params[0].to_local().element_size(),
                "pending": sorted(new.pending),
            }
    torch.save(result, f"{out}/r{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.dist
def test_trainers_build_on_meta_and_hold_only_their_shard(tmp_path):
    from dynaresize.rl.models import build_model, build_tokenizer, save_hf

    folder = tmp_path / "model"
    save_hf(build_model(_model_cfg()).to(torch.bfloat16), build_tokenizer(301), folder)  # a bf16 checkpoint
    mp.spawn(_worker, args=(str(tmp_path), str(folder)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        print(f"rank {r}: " + ", ".join(f"{k} {g['storage_bytes'] / g['model_bytes']:.1%} of {g['model_bytes']} B"
                                        for k, g in res.items()))
        for key, got in res.items():
            assert got["equal"], f"rank {r} {key}: a shard differs from the full-build path"
            assert got["pending"] == []
            # the shard: about 1/2 of the model (padding of odd row counts at most a row a parameter)
            assert got["storage_bytes"] <= got["model_bytes"] / 2 * 1.05, (key, got["storage_bytes"], got["model_bytes"])
            assert got["storage_bytes"] >= got["model_bytes"] / 2 * 0.95
        assert res["builtin-det"]["dtypes"] == ["torch.float64"] and res["builtin-fp32"]["dtypes"] == ["torch.float32"]
        assert res["builtin-det"]["whole"] and not res["folder-det"]["whole"]
        folder_read = res["folder-fp32"]
        assert folder_read["rows_read"], "nothing was read from the safetensors"
        for name, lo, hi in folder_read["rows_read"]:  # only this rank's rows, params and reference alike
            rows = folder_read["shapes"][name][0]
            chunk = math.ceil(rows / WORLD)
            assert (lo, hi) == (min(rows, r * chunk), min(rows, (r + 1) * chunk)) and hi - lo < rows
        read = sum(hi - lo for _, lo, hi in folder_read["rows_read"])
        assert read == 2 * sum(folder_read["local_rows"].values())  # the policy and its reference
