"""Whether the vLLM engine's weight path can map a model folder, from its `config.json` alone.

The vLLM engine is loaded and read back under the trainer's (transformers') parameter names
(roles/vllm_weights.py, roles/vllm_moe.py). That works for the module types those names come
from: linear layers and embeddings (vLLM fuses q/k/v and gate/up, splits them back), norms
(plain vectors), an MoE layer's stacked experts (3-D `gate_up_proj` / `down_proj`, vLLM's
FusedMoE w13/w2) and its router (a 2-D `weight`). Any other module type that holds parameters
(GPT-2's transposed `Conv1D`, a custom layer) has no mapping: a run would fail inside an actor
when the engine starts. `engine_map_problem(model_cfg)` finds such module types on the model
built on torch's meta device (no weights read) and says which, once, before anything is
written; `commands/run.py` refuses the run with it (exit 2, one line naming the module type and
the folder). What the static check cannot see (vLLM naming a module otherwise than the
trainer, beyond the aliases of roles/vllm_moe.py such as Mixtral's `block_sparse_moe`) is
caught once when the engine starts, against the trainer's names (`check_start`).

Imports torch and transformers inside the functions (the caller decides when that cost is due).
"""

from __future__ import annotations

from typing import Any

from dynaresize.config import ModelConfig

NORM_SUFFIXES = ("Norm", "RMSNorm", "LayerNorm")
EXPERT_PARAMS = {"gate_up_proj": 3, "down_proj": 3}  # transformers 5's stacked experts (name: dims)


def _mappable(mod: Any, params: dict[str, Any]) -> bool:
    """Whether the vLLM weight path maps this module's own parameters."""
    import torch

    if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
        return True
    kind = type(mod).__name__
    dims = {n: p.dim() for n, p in params.items()}
    if kind.endswith(NORM_SUFFIXES) or isinstance(mod, torch.nn.LayerNorm):
        return all(d == 1 for d in dims.values())
    if kind.endswith("Experts"):
        return dims == EXPERT_PARAMS
    if "Router" in kind or kind.endswith("Gate"):
        return set(dims) <= {"weight", "bias"} and dims.get("weight") == 2
    return False


def unmapped_modules(model: Any) -> dict[str, list[str]]:
    """{module type: [module paths]} of the modules whose parameters the vLLM path cannot map."""
    out: dict[str, list[str]] = {}
    for name, mod in model.named_modules():
        params = dict(mod.named_parameters(recurse=False))
        if params and not _mappable(mod, params):
            out.setdefault(type(mod).__name__, []).append(name or "(the model)")
    return out


def engine_map_problem(model_cfg: ModelConfig) -> str | None:
    """One sentence naming the module types of `model_cfg`'s folder that the vLLM engine's weight
    path cannot map (None: every one maps, or the built-in model)."""
    if model_cfg.path is None:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_cfg.path))
    except Exception:  # rl.models.check_model reports what keeps the folder from loading
        return None
    bad = unmapped_modules(model)
    if not bad:
        return None
    kinds = "; ".join(f"{kind} ({paths[0]}{f' and {len(paths) - 1} more' if len(paths) > 1 else ''})"
                      for kind, paths in sorted(bad.items()))
    return (f"rollout.engine=vllm cannot map module type {kinds}: the vLLM weight path maps linear layers, "
            "embeddings, norms and stacked MoE experts and routers; use rollout.engine=hf")


def check_engine_map(cfg: Any) -> None:
    """Raise ConfigError (exit 2, one line) where the run's engine is vLLM (`resolve_engine`) and
    `engine_map_problem` names module types it cannot map."""
    from dynaresize.errors import ConfigError
    from dynaresize.roles.base import resolve_engine

    if resolve_engine(cfg) == "vllm" and (problem := engine_map_problem(cfg.model)):
        raise ConfigError([f"model.path={cfg.model.path!r}: {problem}"])


def _rpc_module_types(worker: Any, names: list[str]) -> dict[str, str]:
    """In vLLM's worker: {engine weight name: the type of the module holding it}."""
    modules = dict(worker.model_runner.get_model().named_modules())
    out = {}
    for name in names:
        path = name.rsplit(".", 1)[0]
        while path and path not in modules:
            path = path.rsplit(".", 1)[0] if "." in path else ""
        out[name] = type(modules.get(path)).__name__ if path in modules else "?"
    return out


def shapes_of(weights: Any) -> dict[str, tuple[int, ...]] | None:
    """{name: shape} of a state dict (None for a stream of chunks: it cannot be looked at twice)."""
    from collections.abc import Mapping

    return {n: tuple(t.shape) for n, t in weights.items()} if isinstance(weights, Mapping) else None


def check_start(llm: Any, shapes: dict[str, tuple[int, ...]], weights: Any, tied: bool,
                folder: str | None) -> dict[str, tuple[int, ...]]:
    """Once when an engine starts, with the state dict it is given: the trainer's names the
    engine holds under other names are set on it (`roles.vllm_moe.aliases`), then
    `start_mapping_problem` is raised as a `UserError` (one line). Returns the engine's weight
    shapes under the trainer's names."""
    from dynaresize.errors import UserError
    from dynaresize.roles.vllm_moe import _rpc_set_aliases, aliases
    from dynaresize.roles.vllm_weights import _rpc_weight_shapes

    given = shapes_of(weights)
    if given is None:
        return shapes
    if alias := aliases(shapes, given):
        llm.collective_rpc(_rpc_set_aliases, args=(alias,))
        shapes = llm.collective_rpc(_rpc_weight_shapes)[0]
    if problem := start_mapping_problem(llm, shapes, given, tied, folder):
        raise UserError(problem)
    return shapes


def start_mapping_problem(llm: Any, shapes: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]],
                          tied: bool, folder: str | None) -> str | None:
    """Checked once when a vLLM engine starts: the engine's weights (`shapes`, under the names it
    is loaded by) against the trainer's (`given`: name -> shape); one line naming the engine's
    module types whose weights the trainer lacks or shapes otherwise, and the trainer's weights
    the engine lacks (None: they match; a tied lm_head may be left out)."""
    missing = sorted(set(shapes) - set(given) - ({"lm_head.weight"} if tied else set()))
    wrong = sorted(n for n in set(shapes) & set(given) if tuple(shapes[n]) != tuple(given[n]))
    extra = sorted(set(given) - set(shapes))
    if not (missing or wrong or extra):
        return None
    types = llm.collective_rpc(_rpc_module_types, args=(missing + wrong,))[0] if missing or wrong else {}
    kinds: dict[str, list[str]] = {}
    for n in missing + wrong:
        kinds.setdefault(types.get(n, "?"), []).append(n if n in missing else f"{n} {shapes[n]} vs {given[n]}")
    parts = [f"engine module type {k} ({v[0]}{f' and {len(v) - 1} more' if len(v) > 1 else ''})"
             for k, v in sorted(kinds.items())]
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        parts.append(f"trainer weights it has no place for ({extra[0]}{more})")
    return (f"model.path={folder!r}: the vLLM engine cannot map the trainer's weights: {'; '.join(parts)}; "
            "use rollout.engine=hf")
