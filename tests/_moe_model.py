"""Tiny mixture-of-experts HF folders built in code (no hub): random weights saved with
`save_pretrained` and the folder's own byte-level BPE tokenizer (with a chat template).

`write_moe_model(dir, family)`: `qwen3_moe` (Qwen3-MoE: 4 experts, top-2, q/k norms),
`qwen2_moe` (Qwen2-MoE: the same plus a gated shared expert) or `mixtral` (4 experts, top-2). `write_unmappable_model(dir)`: a GPT-2 folder, whose
Conv1D layers (transposed weights) the vLLM engine's weight path cannot map."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"Count the letters in word {w} and answer with a number: {n}" for n in range(50)
              for w in ("apple", "banana", "kiwi", "grape")]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _save(model, tok, directory: Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def write_moe_model(directory: Path, family: str = "qwen3_moe", **over) -> Path:
    import torch

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(**common, head_dim=32, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2, **over)
        cls = Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # a shared expert beside the routed ones, with its own sigmoid gate
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             num_experts=4, num_experts_per_tok=2, **over)
        cls = Qwen2MoeForCausalLM
    elif family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **over)
        cls = MixtralForCausalLM
    else:
        raise ValueError(f"unknown MoE family {family!r}")
    torch.manual_seed(0)
    return _save(cls(cfg), tok, directory)


def write_unmappable_model(directory: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=2, n_positions=256,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return _save(GPT2LMHeadModel(cfg), tok, directory)
