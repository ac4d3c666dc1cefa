"""`model.path` checked before anything starts: what a folder lacks, as one line.

`model_path_problem(path)` returns None for a folder `transformers` can load a causal LM and its
tokenizer from, else one sentence saying what is wrong: no such folder, a file, an empty
folder, no `config.json` (or one without a `model_type`, or an MoE one asking for the router's
load-balancing loss, which the policy loss does not add), no weights, no tokenizer, a weight
index naming shards that are missing, or a hub id (`Qwen/Qwen2.5-0.5B`) while the hub is off
(`HF_HUB_OFFLINE=1`) and it is not in the local HF cache. `config_load.build_config` adds it as
a `model.path` config error, so a bad folder is exit 2 before a run directory is written.

Pure filesystem and JSON: importing transformers would import torch (seconds) at config time,
and the config layer imports neither. Whether transformers has a causal-LM class for the
folder's `model_type` needs transformers: `rl.models.model_problem` adds that check.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# The weight files `from_pretrained` looks for (sharded: an index naming its shards).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# A tokenizer `AutoTokenizer` can build: the fast file, or a slow tokenizer's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
TOKENIZER_GLOBS = ("*.model", "*.tiktoken")  # sentencepiece (spiece.model, ...), tiktoken vocabularies
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TRUE = ("1", "true", "yes", "on")


def hub_offline(env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    return any(str(env.get(k, "")).strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_hub_id(path: str) -> bool:
    """`name` or `org/name`, not an existing path (transformers asks the hub for such a string)."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def cached_snapshot(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The local HF cache's snapshot folder of `repo_id` (its `main`), or None."""
    try:
        from huggingface_hub import snapshot_download  # installed with transformers; no torch
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except Exception:  # not cached, a malformed id, an unreadable cache: all "not there"
        return None


def model_path_problem(path: str) -> str | None:
    """None if `path` holds a loadable causal-LM folder (as far as files tell), else one sentence."""
    if not path.strip():
        return "empty: give the model's folder, or leave model.path unset for the built-in model"
    folder = Path(path)
    if not folder.exists():
        if looks_like_hub_id(path):
            if not hub_offline():
                return None  # transformers downloads it from the hub
            folder = cached_snapshot(path)
            if folder is None:
                return ("no such folder, and as a Hugging Face hub id it is not in the local HF cache while the hub "
                        "is off (HF_HUB_OFFLINE=1): download it first, or give the model's folder")
        else:
            hint = " (a leading ~ is not expanded: give the full path)" if path.startswith("~") else ""
            return f"no such folder{hint}"
    if not folder.is_dir():
        return "is a file, not a folder (model.path is the folder holding config.json, weights and tokenizer files)"
    names = {p.name for p in folder.iterdir()}
    if not names:
        return "the folder is empty (an HF causal-LM folder holds config.json, weights and tokenizer files)"
    missing = []
    if "config.json" not in names:
        missing.append("no config.json")
    if not any(n in names for n in WEIGHT_FILES):
        missing.append(f"no weights (none of {', '.join(WEIGHT_FILES)})")
    if not (any(n in names for n in TOKENIZER_FILES) or any(next(folder.glob(g), None) for g in TOKENIZER_GLOBS)):
        missing.append(f"no tokenizer (none of {', '.join(TOKENIZER_FILES)}: save the tokenizer with the model)")
    if missing:
        return "; ".join(missing)
    return _config_problem(folder / "config.json") or _shards_problem(folder, names)


def _config_problem(file: Path) -> str | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"config.json is unreadable ({type(exc).__name__}: {_first_line(exc)})"
    if not isinstance(data, dict) or not data.get("model_type"):
        return "config.json names no model_type (transformers reads the architecture from it)"
    text = data.get("text_config")
    return router_loss_problem(text if isinstance(text, dict) else data)


def router_loss_problem(config: dict) -> str | None:
    """An MoE config asking for the router's load-balancing loss, which the policy loss does not
    add (transformers adds it only where it computes the LM loss from labels): refused rather
    than silently dropped. `output_router_logits` false (the default, and what Qwen3-MoE and
    Mixtral checkpoints ship) trains the router through the policy gradient alone."""
    coef = config.get("router_aux_loss_coef")
    if config.get("output_router_logits") is True and isinstance(coef, (int, float)) and coef > 0:
        return (f"config.json sets output_router_logits=true with router_aux_loss_coef={coef}: dynaresize's policy "
                "loss does not add the MoE router's load-balancing loss, so it would be dropped; set "
                "output_router_logits to false in config.json to train without it")
    return None


def _shards_problem(folder: Path, names: set[str]) -> str | None:
    """A weight index whose shards are not all there (unless the unsharded file is there too)."""
    for index in (n for n in WEIGHT_FILES if n.endswith(".index.json") and n in names):
        if index.removesuffix(".index.json") in names:
            continue  # from_pretrained takes the single file
        try:
            shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index} is unreadable ({type(exc).__name__}: {_first_line(exc)})"
        lost = [s for s in shards if not (folder / s).is_file()]
        if lost:
            return f"{index} names {len(lost)} weight file(s) missing from the folder (first: {lost[0]})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
