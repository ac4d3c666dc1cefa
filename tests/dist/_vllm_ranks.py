"""What the vLLM engine tests share (tests/dist/test_rollout_vllm*.py): the tiny model saved as
an HF folder, the seeded requests, and the base of their stand-in device workers (a rank that
joins a gloo world, caches groups, runs collectives and builds weights).

`by_value(module)` registers this module and the test module with Ray's pickler: Ray's workers
cannot import tests/ by name.
"""

from __future__ import annotations

import sys

TEMPERATURE = 0.8


def by_value(test_module: str) -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules[test_module])


def save_tiny_model(out_dir: str, kv_heads: int = 2) -> str:
    """Tied embeddings, GQA (4 query heads, `kv_heads` KV heads), head size 32: an HF directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dynaresize.rl.models import build_tokenizer, save_hf

    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).float()
    save_hf(model, build_tokenizer(512), out_dir)
    return out_dir


def seeded_requests(step: int = 0) -> list:
    """Three prompts of different lengths, four samples each: synthetic lengths and natural (EOS) ones."""
    from dynaresize.rl.seeds import sample_seed
    from dynaresize.roles.base import GenRequest

    out = []
    for p in range(3):
        prompt = [2] + [10 + 7 * p + k for k in range(3 + 4 * p)]
        for s in range(4):
            forced = 6 + 5 * s if s % 2 else None
            out.append(GenRequest((step, p, s), prompt, 12, sample_seed(5, step, p, s), forced))
    return out


class RankBase:
    """A stand-in device worker's common part: its model folder, groups and collectives."""

    def __init__(self, model_dir: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.model_dir = model_dir
        self.engine = None
        self.groups: dict = {}

    def vllm_import_error(self) -> str | None:
        from dynaresize.roles.base import vllm_import_error

        return vllm_import_error()

    def new_group(self, tag: str) -> str:
        """A group over the whole world (a collective); its name, to compare across ranks."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=60))
        self.groups[tag] = group
        return c10d._world.pg_names[group]

    def all_reduce(self) -> list[float]:
        """rank + 1 summed over the world and over every cached group."""
        import torch
        import torch.distributed as dist

        out = []
        for group in [None, *self.groups.values()]:
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t, group=group)
            out.append(float(t))
        return out

    def weights(self, perturb: float = 0.0) -> dict:
        """The saved model's state dict, perturbed by seeded noise when `perturb`."""
        import torch

        from dynaresize.config import ModelConfig
        from dynaresize.rl.models import build_model

        sd = {k: v.detach().clone() for k, v in build_model(ModelConfig(path=self.model_dir)).state_dict().items()}
        if perturb:
            g = torch.Generator().manual_seed(123)
            sd = {k: v + perturb * torch.randn(v.shape, generator=g) for k, v in sd.items()}
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied: one tensor
        return sd
