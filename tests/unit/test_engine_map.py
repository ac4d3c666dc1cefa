"""roles/engine_map.py: which module types the vLLM engine's weight path maps, from a folder's
config.json alone (GPT-2's Conv1D is named, MoE experts and routers pass), and the start's
check of the engine's weight names against the trainer's (one line naming engine module types
and trainer weights that do not meet)."""

from __future__ import annotations

import pytest

from dynaresize.config import ModelConfig
from dynaresize.roles.engine_map import engine_map_problem, start_mapping_problem, unmapped_modules

from _moe_model import write_moe_model, write_unmappable_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("engine-map")
    return {"gpt2": write_unmappable_model(base / "gpt2"), "qwen3_moe": write_moe_model(base / "qwen3moe"),
            "mixtral": write_moe_model(base / "mixtral", "mixtral")}


def test_conv1d_is_named_with_its_modules(folders):
    problem = engine_map_problem(ModelConfig(path=str(folders["gpt2"])))
    assert problem is not None and "Conv1D (transformer.h.0.attn.c_attn and 7 more)" in problem
    assert "rollout.engine=hf" in problem and "\n" not in problem


def test_moe_experts_routers_norms_and_the_builtin_model_map(folders):
    for family in ("qwen3_moe", "mixtral"):
        assert engine_map_problem(ModelConfig(path=str(folders[family]))) is None
    assert engine_map_problem(ModelConfig()) is None


def test_an_unknown_parameter_holder_is_unmapped():
    import torch

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2, 2, 2))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.norm = torch.nn.LayerNorm(2)
            self.odd = Odd()

    assert unmapped_modules(Net()) == {"Odd": ["odd"]}


class _Engine:
    """Stands in for vllm.LLM's collective_rpc: the module type of each engine weight."""

    def __init__(self, types):
        self.types = types

    def collective_rpc(self, fn, args=()):
        return [{n: self.types[n] for n in args[0]}]


def test_start_check_names_engine_module_types_and_trainer_weights():
    engine = {"model.embed_tokens.weight": (8, 4), "model.layers.0.block_sparse_moe.experts.w13": (2, 6, 4),
              "model.layers.0.block_sparse_moe.experts.w2": (2, 4, 3), "lm_head.weight": (8, 4)}
    trainer = {"model.embed_tokens.weight": (8, 4), "model.layers.0.mlp.experts.gate_up_proj": (2, 6, 4),
               "model.layers.0.mlp.experts.down_proj": (2, 4, 3)}
    llm = _Engine({n: "MoERunner" for n in engine} | {"lm_head.weight": "ParallelLMHead"})
    line = start_mapping_problem(llm, engine, trainer, tied=True, folder="/m")
    assert line.startswith("model.path='/m': the vLLM engine cannot map the trainer's weights")
    assert "engine module type MoERunner (model.layers.0.block_sparse_moe.experts.w13 and 1 more)" in line
    assert "trainer weights it has no place for (model.layers.0.mlp.experts.down_proj and 1 more)" in line
    assert "ParallelLMHead" not in line  # a tied lm_head may be left out
    assert start_mapping_problem(llm, engine, {**trainer}, tied=False, folder="/m").count("ParallelLMHead") == 1
    same = {n: s for n, s in engine.items() if n != "lm_head.weight"}
    assert start_mapping_problem(llm, engine, same, tied=True, folder="/m") is None
    wrong = {**same, "model.embed_tokens.weight": (4, 8)}
    llm.types["model.embed_tokens.weight"] = "VocabParallelEmbedding"
    assert "VocabParallelEmbedding (model.embed_tokens.weight (8, 4) vs (4, 8))" in start_mapping_problem(
        llm, engine, wrong, tied=True, folder="/m")


def test_mixtral_names_alias_to_vllm_only_where_the_engine_has_them_with_the_same_shape():
    from dynaresize.roles.vllm_moe import aliases

    engine = {"model.layers.0.block_sparse_moe.experts.w13": (4, 64, 64),
              "model.layers.0.block_sparse_moe.experts.w2": (4, 64, 32),
              "model.layers.0.block_sparse_moe.gate.weight": (4, 64), "model.norm.weight": (64,)}
    trainer = {"model.layers.0.mlp.experts.gate_up_proj": (4, 64, 64), "model.layers.0.mlp.experts.down_proj": (4, 64, 32),
               "model.layers.0.mlp.gate.weight": (4, 64), "model.norm.weight": (64,)}
    assert aliases(engine, trainer) == {
        "model.layers.0.mlp.experts.gate_up_proj": "model.layers.0.block_sparse_moe.experts.w13",
        "model.layers.0.mlp.experts.down_proj": "model.layers.0.block_sparse_moe.experts.w2",
        "model.layers.0.mlp.gate.weight": "model.layers.0.block_sparse_moe.gate.weight"}
    assert aliases(engine, {**trainer, "model.layers.0.mlp.experts.down_proj": (4, 32, 64)}).get(
        "model.layers.0.mlp.experts.down_proj") is None  # another shape: no alias
    same = {"model.layers.0.mlp.experts.gate_up_proj": (4, 64, 64)}
    assert aliases(same, same) == {}  # names that meet are left alone
