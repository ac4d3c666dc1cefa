"""A model's shape for the memory plan, from its `config.json` alone: no weights are read.

`read_shape(model_cfg)` builds the causal LM transformers names for the folder's config on
torch's meta device (shapes, no storage), so every parameter is counted exactly as the trainer
and the engine hold it, whatever the architecture (a tied embedding counted once). The built-in
tiny model (`model.path` unset) is read from its `ModelConfig` the same way. The weight-sync
staging (two consecutive buckets at most) comes from `roles.weight_sync.buckets`, the function
the sync itself packs with.

Invariant: nothing is loaded but `config.json` (the folder may hold nothing else). Errors are
`ConfigError`s naming `model.path` (exit 2, one line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynaresize.config import ModelConfig
from dynaresize.costmodel.memory import ModelShape
from dynaresize.errors import ConfigError


def _hf_config(model_cfg: ModelConfig) -> Any:
    if model_cfg.path is None:
        from dynaresize.rl.models import qwen2_config

        return qwen2_config(model_cfg)
    folder = Path(model_cfg.path)
    where = f"model.path={model_cfg.path!r}"
    if not folder.is_dir():
        raise ConfigError([f"{where}: no such folder"])
    if not (folder / "config.json").is_file():
        raise ConfigError([f"{where}: no config.json in the folder (preflight reads only the model's config.json)"])
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{where}: config.json is not readable JSON ({exc})"]) from None
    from transformers import AutoConfig

    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not model_type:
        raise ConfigError([f"{where}: config.json names no model_type"])
    try:  # from the dict: AutoConfig.from_pretrained(folder) would be the same, without the file check
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # an unknown model_type, a malformed field: one line
        first = (str(exc).strip().splitlines() or ["no message"])[0]
        raise ConfigError([f"{where}: transformers cannot read its config.json ({type(exc).__name__}: {first})"]) from None


def read_shape(model_cfg: ModelConfig) -> ModelShape:
    """The model's exact shape and parameter counts (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dynaresize.roles.weight_sync import buckets

    hf = _hf_config(model_cfg)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or ["no message"])[0]
        raise ConfigError([f"model.path={model_cfg.path!r}: no causal LM for its config ({type(exc).__name__}: {first})"]) from None
    named = list(model.named_parameters())  # distinct parameters: a tied weight appears once
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in no_split]
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    layer_params = max(block_params, default=0)
    num_params = sum(p.numel() for _, p in named)
    specs = [(name, tuple(p.shape)) for name, p in named]
    staging = []
    for elem in (2, 4):  # two consecutive buckets at most are alive on a receiver
        sizes = [sum(int(torch.Size(s).numel()) for _, s in b) * elem for b in buckets(specs, elem_bytes=elem)]
        staging.append((elem, max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))))
    heads = int(hf.num_attention_heads)
    text = getattr(hf, "get_text_config", lambda: hf)()
    return ModelShape(
        name=model_cfg.path or "built-in",
        num_params=int(num_params),
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        vocab_size=int(text.vocab_size),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        layer_params=int(layer_params or num_params),
        root_params=int(num_params - sum(block_params)),
        largest_param=int(max(p.numel() for _, p in named)),
        sync_staging_bytes=tuple(staging),
    )
