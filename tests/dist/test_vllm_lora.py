"""A real vLLM engine (CPU build, in a process of its own) under `train.lora`: started from a tiny
Qwen2 folder (bf16, q/k/v biases) and sent adapters only (rank 4, which vLLM's own LoRA would
refuse), it serves the merged weights: its greedy tokens equal those of transformers' model merged
by peft (`merge_and_unload`) and differ from the base's; its weights read back equal the folder's
base with each targeted weight merged (k_proj, up_proj and the biases untargeted: the base);
a second adapter, arriving as a pull's host stream (`host_weights`, small buckets), replaces the
first (merged from the base, not accumulated), and a zero adapter gives the base back exactly;
its digest is the adapter's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.slow]  # ~60 s: vLLM's import and start

SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import peft, torch
from transformers import AutoModelForCausalLM
from dynaresize.config import LoraConfig, ModelConfig
from dynaresize.roles.lora import lora_scale, merged_weight
from dynaresize.roles.rollout_vllm import VLLMRolloutEngine
from dynaresize.roles.vllm_weights import _rpc_digest, state_dict_digest
from dynaresize.roles.weight_sync import flatten, host_weights, weights_digest

folder = sys.argv[1]
R, ALPHA, TARGETS = 4, 8.0, ["q_proj", "v_proj", "gate_proj", "down_proj", "o_proj"]
PROMPTS = [[5, 40, 77, 12], [9, 3, 101], [250, 251, 17, 60, 2]]

def base_model():
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

BASE = {k: v.detach().clone() for k, v in base_model().state_dict().items()}

def make_adapter(seed, scale=1.0):
    torch.manual_seed(seed)
    m = peft.get_peft_model(base_model(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                                          init_lora_weights=False))
    out = {}
    for n, p in m.named_parameters():
        if ".lora_" in n:  # base_model.model.<module>.lora_A.default.weight -> <module>.lora_A
            mod, half = n.split(".lora_")
            out[mod.removeprefix("base_model.model.") + ".lora_" + half[0]] = p.detach().clone() * (scale if half[0] == "B" else 1)
    return out

def hf_greedy(adapter):
    m = peft.get_peft_model(base_model(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS))
    sd = {}
    for n, _ in m.named_parameters():
        if ".lora_" in n:
            mod, half = n.split(".lora_")
            sd[n] = adapter[mod.removeprefix("base_model.model.") + ".lora_" + half[0]]
    m.load_state_dict(sd, strict=False)
    merged = m.merge_and_unload().eval()
    return [merged.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(p):].tolist()
            for p in PROMPTS]

def merged_state(adapter):
    sd = dict(BASE)
    for n in adapter:
        if n.endswith(".lora_A"):
            mod = n[:-len(".lora_A")]
            sd[mod + ".weight"] = merged_weight(BASE[mod + ".weight"], adapter[n], adapter[mod + ".lora_B"],
                                                lora_scale(R, ALPHA), torch.float32)
    return sd

def engine_greedy(eng):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    outs = eng._llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                             SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]

def check(eng, adapter):
    names = eng.weight_names()
    served = eng._llm.collective_rpc(_rpc_digest, args=(names, torch.float32))[0]
    return {"tokens": engine_greedy(eng), "hf_tokens": hf_greedy(adapter),
            "readback_equal": served == state_dict_digest(merged_state(adapter), names),
            "readback_is_base": served == state_dict_digest(BASE, names),
            "digest_equal": eng.weights_digest(list(adapter)) == weights_digest(adapter.items())}

one, two = make_adapter(1, 30.0), make_adapter(2, 30.0)
zero = {n: (torch.zeros_like(t) if n.endswith("lora_B") else t) for n, t in two.items()}
eng = VLLMRolloutEngine(ModelConfig(path=folder), 1.0, kv_cache_bytes=32 << 20, max_model_len=128,
                        prefix_caching=False, lora=LoraConfig(rank=R, alpha=ALPHA, target_modules=tuple(TARGETS)))
eng.start(one, 0)
out = {"base_tokens": hf_greedy({n: torch.zeros_like(t) for n, t in one.items()}), "first": check(eng, one)}
specs = [(n, tuple(t.shape)) for n, t in two.items()]
flat = flatten(two, specs)
eng.set_weights(host_weights(specs, lambda lo, hi: flat[lo:hi], dtype=torch.float32, pin=False,
                             bucket_bytes=4096), 1)
out["second"] = check(eng, two)
eng.load_weights(zero, 2)
out["zero"] = check(eng, zero)
eng.release()
print("RESULT " + json.dumps(out))
"""


def write_qwen2_folder(directory: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _moe_model import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def test_vllm_engine_serves_the_merged_adapter_and_replaces_it(tmp_path):
    folder = write_qwen2_folder(tmp_path / "qwen2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, env=env,
                          timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    for phase in ("first", "second", "zero"):
        got = out[phase]
        assert got["tokens"] == got["hf_tokens"], (phase, got)
        assert got["readback_equal"] and got["digest_equal"], (phase, got)
    assert out["first"]["tokens"] != out["base_tokens"] and out["first"]["tokens"] != out["second"]["tokens"]
    assert not out["first"]["readback_is_base"] and not out["second"]["readback_is_base"]
    assert out["zero"]["readback_is_base"] and out["zero"]["tokens"] == out["base_tokens"]  # nothing accumulated
