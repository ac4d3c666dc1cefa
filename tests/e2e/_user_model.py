"""A user's own HF model folder, built in code (no hub): a Llama-architecture causal LM with tied
input/output embeddings and grouped-query attention, saved in bf16, and its own byte-level BPE
tokenizer trained on the toy task's prompts, with a chat template."""

from __future__ import annotations

from pathlib import Path

from _moe_model import build_tokenizer  # tests/: the same byte-level BPE tokenizer and chat template


def write_user_model(directory: Path, *, max_positions: int = 256) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
