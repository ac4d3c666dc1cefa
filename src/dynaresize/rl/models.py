"""The policy model and its tokenizer: a tiny Qwen2 built in code, or any HF causal-LM directory.

Invariants:
- `build_model(cfg)` with `cfg.path is None` gives bit-identical fp32 weights in every process
  for the same `cfg` (random init under a forked RNG seeded by `cfg.init_seed`; the caller's
  global RNG state is left untouched).
- `build_tokenizer(vocab_size)` is built entirely in code (no hub, no files, no training) and
  has exactly `vocab_size` entries, so its ids match the tiny model's embedding rows.
- `save_hf(model, tokenizer, out_dir)` writes a directory that
  `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load,
  and the loaded tokenizer encodes exactly as the built one.

Why byte-level BPE: transformers 5 loads any `qwen2` checkpoint's tokenizer as
`Qwen2Tokenizer`, which rebuilds a byte-level BPE (Qwen's split regex, NFC, ByteLevel) from
the saved vocab and merges and ignores the saved pipeline. So the built-in tokenizer is that
same pipeline with a vocabulary and merges written by hand here: specials (`<pad>` 0, `<eos>` 1,
`<bos>` 2, `<unk>` 3), the 256 byte symbols (any text encodes), consonant-vowel syllables, a few common
English words, then pseudo-words of shape consonant-vowel-consonant-vowel (" bako", " tedu"),
one token each, taken round-robin over first letters so each letter gets the same share; the
toy task (rl/tasks.py) uses those letter groups as token classes. Merges are written in rank
order and each word's chain is computed by running BPE on the merges before it, so BPE
reproduces every vocabulary word as one token (tests/unit/test_rl_models.py checks it).

Importing this module imports neither torch nor transformers (the toy reward needs only the
word lists); the builders import them when called.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dynaresize.config import ModelConfig
from dynaresize.errors import ConfigError
from dynaresize.rl.model_path import model_path_problem

if TYPE_CHECKING:
    import torch

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
# UNK is never produced (bytes cover all text) but named, or Qwen2Tokenizer adds one on load.
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
COMMON_WORDS = (
    "the a an of to and or in on with for is are be say write words word only use please "
    "count letter letters start starts starting begin each every all no not as that this "
    "it by from at answer question task reply list give example like"
).split()
VOWELS = "aeiou"
CONSONANTS = "bdfghklmnprstvz"  # first letters of the pseudo-words, in vocabulary order
SPACE = "\u0120"  # "Ġ": the byte-level symbol of a space


def pseudo_words() -> list[str]:
    """All consonant-vowel-consonant-vowel pseudo-words, grouped by first letter (375 each)."""
    return ["".join(p) for p in itertools.product(CONSONANTS, VOWELS, CONSONANTS, VOWELS)]


def _apply_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE as `tokenizers` runs it: merge the lowest-ranked adjacent pair (leftmost) until none."""
    while len(symbols) > 1:
        best = min(range(len(symbols) - 1), key=lambda i: (ranks.get((symbols[i], symbols[i + 1]), 1 << 60), i))
        if (symbols[best], symbols[best + 1]) not in ranks:
            break
        symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
    return symbols


def _vocab_and_merges(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import pre_tokenizers

    tokens = list(SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(tokens)} specials and byte symbols "
                         "of the built-in tokenizer")
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    known = set(tokens)

    def add(a: str, b: str) -> None:
        if (a, b) not in ranks:
            ranks[(a, b)] = len(merges)
            merges.append((a, b))
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)

    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    for syl in syllables:
        add(syl[0], syl[1])
    for syl in syllables:
        add(SPACE, syl)
    for word in COMMON_WORDS:
        for form in (SPACE + word, word):
            segs = _apply_bpe(list(form), ranks)
            while len(segs) > 1:  # chain the remaining pieces left to right
                add(segs[0], segs[1])
                segs = [segs[0] + segs[1]] + segs[2:]
    by_letter = [[w for w in pseudo_words() if w[0] == c] for c in CONSONANTS]
    for group in itertools.zip_longest(*by_letter):
        for w in group:
            if w is not None:
                add(SPACE + w[:2], w[2:])
    tokens = tokens[:vocab_size]
    tokens += [f"<|reserved_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # A prefix of the merges whose results are in the vocabulary is itself a valid BPE.
    return vocab, [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses the same expression).
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` of exactly `vocab_size` tokens, built in code (Qwen2's pipeline).

    Encoding adds no special tokens (like Qwen2); decoding maps byte symbols back to text.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _vocab_and_merges(vocab_size)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                   unk_token=UNK, model_max_length=4096)


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer that matches `build_model(cfg)`."""
    if cfg.path is None:
        return build_tokenizer(cfg.vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.path)
    if tok.pad_token_id is None:  # many causal LMs ship without one; padding needs an id
        tok.pad_token = tok.eos_token
    return tok


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids, with whatever special tokens the tokenizer adds itself (none built in)."""
    return list(tokenizer(text)["input_ids"])


def qwen2_config(cfg: ModelConfig) -> Any:
    """The transformers config of the tiny built-in model (MLP 4x hidden; GQA and tied
    embeddings by default, as in small Qwen2.5 and Llama-3.2 checkpoints)."""
    from transformers import Qwen2Config

    specials = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}  # the first ids of build_tokenizer
    return Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=specials[PAD], eos_token_id=specials[EOS], bos_token_id=specials[BOS],
        attn_implementation="sdpa",
    )


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config of the policy model: the built-in one, or the folder's."""
    if cfg.path is None:
        return qwen2_config(cfg)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.path)


def max_positions(cfg: ModelConfig) -> int:
    """The longest sequence (prompt + response) the model takes: its max_position_embeddings."""
    return int(getattr(hf_config(cfg), "max_position_embeddings", 1 << 30))


def model_problem(cfg: ModelConfig) -> str | None:
    """What keeps `cfg.path` from loading as a causal LM, as one sentence (None: it loads, or the
    built-in model): the folder's files (`rl.model_path`, also checked at config time), then
    whether transformers reads its config.json and has a causal-LM class for its model_type.
    Imports transformers (and so torch)."""
    if cfg.path is None:
        return None
    if problem := model_path_problem(cfg.path):
        return problem
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(cfg.path)
    except Exception as exc:  # an unknown model_type, custom code, a malformed field: one line
        first = (str(exc).strip().splitlines() or ["no message"])[0]
        return f"transformers {transformers.__version__} cannot read its config.json ({type(exc).__name__}: {first})"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        return (f"model_type {config.model_type!r} ({archs}) is not a causal LM transformers {transformers.__version__} "
                "knows (AutoModelForCausalLM has no class for it)")
    return None


def check_model(cfg: ModelConfig) -> None:
    """Raise ConfigError (exit 2: one line naming model.path and what is wrong) if `model_problem`
    finds something; call it before anything is written."""
    if problem := model_problem(cfg):
        raise ConfigError([f"model.path={cfg.path!r}: {problem}"])


def build_model(cfg: ModelConfig) -> "torch.nn.Module":
    """The policy in fp32, in eval mode; identical weights in every process for the same cfg."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    if cfg.path is not None:
        # sdpa: deterministic on CPU at a fixed thread count (measured), and fast.
        import transformers

        # transformers >= 4.56 calls the argument `dtype` and warns about `torch_dtype`.
        dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(cfg.path, attn_implementation="sdpa",
                                                     **{dtype_arg: torch.float32})
        return model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = Qwen2ForCausalLM(qwen2_config(cfg))
    return model.to(torch.float32).eval()


def save_hf(model: "torch.nn.Module", tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write `config.json`, `model.safetensors`, generation and tokenizer files to `out_dir`."""
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per save would cut into the run's own progress bar
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def tied_aliases(model: "torch.nn.Module") -> dict[str, str]:
    """{state-dict key: the parameter name it shares storage with} for every key that is not
    itself in `named_parameters()` (a tied `lm_head.weight` -> `model.embed_tokens.weight`)."""
    canonical = {p.data_ptr(): n for n, p in model.named_parameters()}
    names = set(canonical.values())
    return {k: canonical[t.data_ptr()] for k, t in model.state_dict().items()
            if k not in names and t.data_ptr() in canonical}


def complete_state_dict(state: Mapping[str, Any], model: "torch.nn.Module") -> dict[str, Any]:
    """`state` keyed by parameter name, plus the tied aliases `model.load_state_dict` wants."""
    out = dict(state)
    for alias, name in tied_aliases(model).items():
        if alias not in out and name in out:
            out[alias] = out[name]
    return out


def num_parameters(model: "torch.nn.Module") -> int:
    return sum(p.numel() for p in model.parameters())
