"""`dynaresize preflight` and the memory check at a run's start (commands/preflight.py): a
folder holding only a Qwen2-7B config.json is enough; the plan is costmodel.memory's output;
on CUDA a starting split that does not fit is exit 2 and the bounds keep only splits that fit."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dynaresize import cli
from dynaresize.commands import memory_plan, preflight
from dynaresize.config import ModelConfig
from dynaresize.costmodel import memory
from dynaresize.emulate.model import run_bounds
from dynaresize.errors import ConfigError

from _shapes import QWEN2_7B

GB = 1e9
GPU_DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
QWEN2_7B_CONFIG = {  # Qwen2-7B's config.json, the fields that shape it
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "Qwen2-7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2_7B_CONFIG))
    return d


def _args(*argv: str):
    return cli.build_parser().parse_args(["preflight", "--accelerator", "h100", *argv])


def test_the_reader_counts_every_parameter_from_config_json_alone(qwen_dir):
    from dynaresize.roles.model_shape import read_shape

    shape = read_shape(ModelConfig(path=str(qwen_dir)))
    assert sorted(p.name for p in qwen_dir.iterdir()) == ["config.json"]  # nothing else there, nothing written
    assert shape == memory.ModelShape(**{**QWEN2_7B.__dict__, "name": str(qwen_dir)})
    # the built-in model ties its embeddings: counted once, as the trainer holds it
    from dynaresize.rl.models import build_model

    tiny = read_shape(ModelConfig())
    assert tiny.tie_word_embeddings and tiny.num_params == sum(p.numel() for p in build_model(ModelConfig()).parameters())


# fp32 without activation checkpointing (the GPU defaults are bf16 with it: train.dtype auto)
FP32 = ("--set", "train.dtype=fp32", "--set", "train.activation_checkpointing=false")


def test_json_for_a_7b_on_eight_h100s(qwen_dir, capsys):
    rc = cli.main(["preflight", "--set", f"model.path={qwen_dir}", "--devices", "8", "--accelerator", "h100", "--json",
                   *FP32])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    n = out["model"]["num_params"]
    assert n == QWEN2_7B.num_params
    splits = {s["train"]: s for s in out["splits"]}
    assert sorted(splits) == list(range(1, 8)) and all(s["rollout"] + s["train"] == 8 for s in splits.values())
    assert not splits[1]["fits"] and "train needs" in splits[1]["limit"]
    four = splits[4]["train_parts"]
    assert four["parameters"] + four["gradients"] + four["moments"] == pytest.approx(16 * n / 4, abs=2)
    assert four["activations"] == out["activations_bytes"]["checkpointing_off"]  # train.activation_checkpointing off
    assert splits[4]["peak_bytes"]["train"] == pytest.approx(sum(four.values()), abs=8)
    cfg, _ = preflight.resolve(_args("--set", f"model.path={qwen_dir}", "--devices", "8", *FP32))
    for s in memory.plan_splits(QWEN2_7B, preflight.inputs_of(cfg), 80 * GB, num_devices=8, rollout_sizes=range(1, 8)):
        got = splits[s.train]
        assert (got["fits"], got["peak_bytes"]) == (s.fits, {"train": round(s.train_peak.total),
                                                             "rollout": round(s.rollout_peak.total)})
    # checkpointing on: smaller activations, more splits fit
    rc = cli.main(["preflight", "--set", f"model.path={qwen_dir}", "--devices", "8", "--accelerator", "h100", "--json"])
    ck = json.loads(capsys.readouterr().out)
    assert sum(s["fits"] for s in ck["splits"]) > sum(s["fits"] for s in out["splits"])


@pytest.mark.parametrize("argv, needle", [
    (["--set", "model.path={empty}"], "no config.json"),
    (["--set", "model.path={empty}/nope"], "no such folder"),
    (["--set", "model.path={qwen}", "--accelerator", "h900"], "accelerator='h900': unknown"),
    (["--set", "model.path={qwen}", "--accelerator", "h100:0"], "GiB > 0"),
])
def test_bad_input_is_one_line_exit_2(argv, needle, qwen_dir, tmp_path, capsys):
    argv = [a.format(empty=tmp_path, qwen=qwen_dir) for a in argv]
    rc = cli.main(["preflight", "--accelerator", "h100", "--devices", "8", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_inputs_follow_the_config():
    cfg, _ = preflight.resolve(_args("--set", "rollout.max_prompt_tokens=100", "--set", "rollout.max_new_tokens=50",
                                     "--set", "train.micro_batch_size=3", "--set", "train.kl_coef=0.1",
                                     "--set", "rollout.tensor_parallel=2"))
    inp = preflight.inputs_of(cfg)
    assert (inp.seq_tokens, inp.tokens, inp.reference, inp.tensor_parallel) == (150, 450, True, 2)
    # auto on CUDA: a bf16 engine, bf16 training with activation checkpointing
    assert (inp.engine, inp.engine_dtype, inp.train_dtype, inp.activation_checkpointing) == ("vllm", "bf16", "bf16", True)
    fp32 = preflight.inputs_of(preflight.resolve(_args(*FP32))[0])
    assert (fp32.train_dtype, fp32.activation_checkpointing) == ("fp32", False)
    det, _ = preflight.resolve(_args("--deterministic"))
    assert (preflight.inputs_of(det).engine, preflight.inputs_of(det).engine_dtype) == ("hf", "fp32")
    env = replace(cfg, task=replace(cfg.task, env="tests.fake:Env", max_turns=3))
    assert preflight.inputs_of(env).seq_tokens == 100 + 3 * 50
    capped = replace(env, task=replace(env.task, max_total_tokens=1000))
    assert preflight.inputs_of(capped).seq_tokens == 1000


def test_accelerator_memory_in_gib():
    assert preflight.parse_accelerator("h100") == ("h100", 80e9)
    assert preflight.parse_accelerator("H200:139.5") == ("h200", 139.5 * 2**30)


def test_start_check_off_cuda_changes_nothing():
    cfg, _ = preflight.resolve(_args("--devices", "8", "--rollout-devices", "4"))
    assert memory_plan.start_check(cfg, "cpu", 0.0, shape=QWEN2_7B) is cfg
    import torch

    if not torch.cuda.is_available():  # this machine: the run's own check leaves the config alone
        assert memory_plan.check_at_start(cfg) is cfg


def test_start_check_on_cuda_refuses_a_start_that_does_not_fit():
    cfg, _ = preflight.resolve(_args("--devices", "8", "--rollout-devices", "4", *FP32))
    with pytest.raises(ConfigError) as exc:
        memory_plan.start_check(cfg, "cuda", 80 * GB, shape=QWEN2_7B)
    (line,) = exc.value.errors
    fit = memory.split_fit(QWEN2_7B, preflight.inputs_of(cfg), 80 * GB, rollout=4, train=4)
    assert not fit.fits
    assert line.startswith("cluster.rollout_devices=4: the starting split 4 rollout : 4 train does not fit")
    assert f"train needs {fit.train_peak.total / GB:.1f} GB > 80.0 GB" in line


def test_start_check_on_cuda_raises_the_bounds_to_the_splits_that_fit():
    cfg, _ = preflight.resolve(_args("--devices", "8", "--rollout-devices", "2", *FP32))
    assert run_bounds(cfg).splits() == (1, 2, 3, 4, 5, 6, 7)
    checked = memory_plan.start_check(cfg, "cuda", 80 * GB, shape=QWEN2_7B)
    fitting = tuple(s.rollout for s in preflight.plan(cfg, QWEN2_7B, 80 * GB) if s.fits)
    assert fitting and run_bounds(checked).splits() == fitting
    assert checked.policy.min_train == 8 - max(fitting) > cfg.policy.min_train
    # a bigger device: every split fits, the bounds stay the policy's
    assert memory_plan.start_check(cfg, "cuda", 1000 * GB, shape=QWEN2_7B) is cfg


def test_run_checks_at_start_on_cuda(tmp_path, monkeypatch, capsys):
    """`dynaresize run` on a CUDA driver: the start split 4:4 of a 7B does not fit 80 GB, exit 2 in one
    line before anything starts (torch's CUDA queries faked: this machine has no GPU)."""
    import torch

    from dynaresize.rl import models

    d = tmp_path / "Qwen2-7B"  # the file names a run's config check looks for; empty: nothing reads them
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2_7B_CONFIG))
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("")
    monkeypatch.setattr(models, "check_model", lambda cfg: None)  # transformers would read the empty files
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80e9})())
    import dynaresize.driver.run as driver_run

    monkeypatch.setattr(driver_run, "run_job", lambda *a, **k: pytest.fail("the run started"))
    rc = cli.main(["run", "--set", f"model.path={d}", "--devices", "8", "--rollout-devices", "4", *FP32,
                   "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    assert "cluster.rollout_devices=4: the starting split 4 rollout : 4 train does not fit a 80.0 GB cuda device" in err


def _doc_blocks() -> list[tuple[str, str]]:
    """(command, output) of each preflight block in docs/gpu.md's memory section."""
    text = GPU_DOC.read_text().split("## Memory planned before start", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for chunk in text.split("    $ dynaresize preflight ")[1:]:
        lines = chunk.splitlines()
        out = []
        for line in lines[1:]:
            if line and not line.startswith("    "):
                break
            out.append(line[4:])
        blocks.append((lines[0], "\n".join(out).strip()))
    return blocks


def test_docs_gpu_preflight_tables_are_the_commands_output(qwen_dir, capsys, monkeypatch):
    blocks = _doc_blocks()
    assert len(blocks) == 2
    monkeypatch.chdir(qwen_dir.parent)  # the docs run it next to a folder named Qwen2-7B
    for command, shown in blocks:
        assert cli.main(["preflight", *command.split()]) == 0
        assert capsys.readouterr().out.strip() == shown
