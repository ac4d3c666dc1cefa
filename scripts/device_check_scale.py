"""The data path at model scale, checked on one GPU: the second part of `scripts/device_check.sh`.

What a tiny model on the CPU cannot show, measured where the GPU machine lent for checks can
(one device, no Ray, no vLLM): one line per check, `ok`, `FAILED` or a plain figure, and exit
status 1 when a check failed.

- peer: what vLLM's custom all-reduce would meet in one of our TP actors (it sees only its own
  GPU: `CUDA_VISIBLE_DEVICES=0`), beside what `tp_engine_kwargs` passes for a CUDA TP rank;
- sync7b: `receive_weights` of a Qwen2-7B-shaped model in bf16 over a one-rank NCCL world, the
  engine taking each bucket as it arrives: the device's peak bytes over the start
  (`max_memory_allocated`) against two buckets (what preflight plans for sync staging);
- release: a trainer dropped with the GC frozen (as the vLLM engine's start leaves it): its
  parameter unreachable (weakref dead) and its bytes given back;
- step1.5b: one FSDP2 step of a Qwen2-1.5B-shaped model on 4k tokens, fp32 and bf16, with and
  without activation checkpointing: seconds and peak bytes, beside preflight's planned peak
  (costmodel/memory.trainer_peak) for the same shape and inputs;
- new_group: the device bytes (`mem_get_info`) each eager one-rank NCCL group takes.

`--cpu` runs every check on tiny shapes with gloo (no memory figures), so the CPU test suite
runs the code itself (tests/dist/test_device_check.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import weakref

FAILURES: list[str] = []
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)


def say(name: str, ok: bool | None, text: str) -> None:
    """One line; `ok` None is a figure, not a check."""
    print(f"{name}: {'' if ok is None else 'ok ' if ok else 'FAILED '}({text})", flush=True)
    if ok is False:
        FAILURES.append(name)


def gib(n: float) -> str:
    """Bytes in GiB, or in KiB where that would print as zero (the CPU run's tiny shapes)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 or n == 0 else f"{n / 2**10:.1f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU with gloo (tests)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(f"cuda: FAILED (no CUDA device: torch {torch.__version__} sees none; this check needs a GPU)")
        return 1
    from dynaresize.comm import rendezvous

    rendezvous.init_world(rank=0, world_size=1, init_method=rendezvous.world_init_method("127.0.0.1",
                          rendezvous.free_port()), backend="gloo" if args.cpu else "nccl", timeout_s=120,
                          device_index=0)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    for check in (_peer, _sync7b, _release, _step, _new_group):
        try:
            check(torch, device, args.cpu)
        except Exception as exc:  # a crash is a failed check, with its cause on one line
            say(check.__name__.lstrip("_"), False, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        finally:
            gc.collect()
            if not args.cpu:
                torch.cuda.empty_cache()
    rendezvous.destroy_world()
    print(f"scale check: {'FAILED: ' + ', '.join(FAILURES) if FAILURES else 'all ok'}")
    return 1 if FAILURES else 0


def _hf_model_config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, max_position_embeddings=32768, attn_implementation="sdpa")


def _peer(torch, device, cpu: bool) -> None:
    from dynaresize.roles.vllm_tp import TPPlacement, tp_engine_kwargs

    kwargs = tp_engine_kwargs(TPPlacement(rank=0, size=2, master_addr="127.0.0.1", master_port=29500), cuda=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
    count = 0 if cpu else torch.cuda.device_count()
    try:  # what the custom all-reduce's peer probe asks of rank 0 about rank 1 (device 1)
        peer = "n/a on the CPU" if cpu else str(torch.cuda.can_device_access_peer(0, 1))
    except Exception as exc:  # device 1 is not visible: the probe itself fails
        peer = f"cannot ask ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
    say("peer", kwargs.get("disable_custom_all_reduce") is True,
        f"CUDA_VISIBLE_DEVICES={visible}: {count} device(s) visible, peer access 0->1: {peer}; a CUDA TP rank "
        f"gets disable_custom_all_reduce={kwargs.get('disable_custom_all_reduce')}")


def _specs(torch, shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_model_config(shape))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _sync7b(torch, device, cpu: bool) -> None:
    import torch.distributed as dist

    from dynaresize.roles.weight_sync import Staging, buckets, receive_weights

    specs = _specs(torch, TINY if cpu else QWEN2_7B)
    dtype = torch.bfloat16
    sizes = [sum(math.prod(s) for _, s in b) * 2 for b in buckets(specs, elem_bytes=2)]
    planned = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
    if not cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = 0 if cpu else torch.cuda.memory_allocated()
    staging = Staging()
    t0 = time.perf_counter()
    loaded = 0
    for chunk in receive_weights(specs, root=0, group=dist.group.WORLD, device=device, dtype=dtype, staging=staging):
        loaded += sum(t.numel() for _, t in chunk)  # the engine's load: it keeps nothing of the bucket
        del chunk
    if not cpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = staging.peak_bytes if cpu else torch.cuda.max_memory_allocated() - base
    total = sum(math.prod(s) for _, s in specs)
    say("sync7b", loaded == total and peak <= planned,
        f"{total / 1e9:.3g}B parameters in {len(sizes)} bf16 buckets, {gib(total * 2)} on the wire in "
        f"{seconds:.2f} s; peak held {gib(peak)} (staging count {gib(staging.peak_bytes)}), two largest "
        f"consecutive buckets {gib(planned)}; the whole model in fp32 would be {gib(total * 4)}")


def _trainer(torch, device, shape: dict, *, dtype: str, ckpt: bool):
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from dynaresize.config import ModelConfig
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import TrainerSpec
    from dynaresize.roles.train_state import OptimSettings

    with torch.device(device):  # built where it trains: a 1.5B model's init on the host takes minutes
        init = Qwen2ForCausalLM(_hf_model_config(shape))
    spec = TrainerSpec(model=ModelConfig(), optim=OptimSettings(lr=1e-6), compute_dtype=dtype,
                       activation_checkpointing=ckpt)
    return FSDPTrainer(spec, ranks=(0,), rank=0, group=dist.new_group([0]), device=str(device), init_model=init)


def _release(torch, device, cpu: bool) -> None:
    from dynaresize.roles.device_memory import release_device_memory

    base = 0 if cpu else torch.cuda.memory_allocated()
    trainer = _trainer(torch, device, TINY if cpu else QWEN2_1_5B, dtype="bf16", ckpt=True)
    held = 0 if cpu else torch.cuda.memory_allocated() - base
    probe = weakref.ref(trainer.params[0])
    trainer.release()  # what a device leaving training does (cluster/worker_resize.py) ...
    del trainer
    release_device_memory(device)
    gc.freeze()  # ... before the vLLM engine's start freezes the GC: a leftover cycle would stay
    try:
        left = 0 if cpu else torch.cuda.memory_allocated() - base
        reachable = probe() is not None
    finally:
        gc.unfreeze()
    say("release", not reachable and left <= 0.01 * max(held, 1),
        f"trainer held {gib(held)}; after release with the GC frozen: parameter reachable {reachable}, "
        f"{gib(left)} still allocated")


def _step(torch, device, cpu: bool) -> None:
    from dynaresize.costmodel import memory
    from dynaresize.rl import grpo

    shape = TINY if cpu else QWEN2_1_5B
    tokens = 64 if cpu else 4096
    prompt = 64 if not cpu else 8
    plan_shape = _plan_shape(torch, shape)
    for dtype in ("fp32", "bf16"):
        for ckpt in (False, True):
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = 0 if cpu else torch.cuda.memory_allocated()
            trainer = _trainer(torch, device, shape, dtype=dtype, ckpt=ckpt)
            sample = grpo.TrainSample(sample_id=(0, 0, 0), prompt_ids=[2 + i % 50 for i in range(prompt)],
                                      response_ids=[3 + i % 50 for i in range(tokens - prompt)],
                                      rollout_logprobs=[-math.log(shape["vocab_size"])] * (tokens - prompt),
                                      advantage=1.0)  # behaviour log-probs near uniform: ratio ~1, unclipped

            def loss_fn(model, mb):
                b = grpo.dummy_micro_batch() if mb is None else mb
                return grpo.micro_batch_loss(model, b, total_response_tokens=tokens - prompt, clip_eps=0.2,
                                             chunk_tokens=1024), {}

            t0 = time.perf_counter()
            stats = trainer.compute_grads([(0, [sample])], loss_fn, num_micro_batches=1)
            trainer.apply_optimizer()
            if not cpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            peak = 0 if cpu else torch.cuda.max_memory_allocated() - base
            inp = memory.MemoryInputs(micro_batch_size=1, seq_tokens=tokens, train_dtype=dtype,
                                      activation_checkpointing=ckpt, logprob_chunk_tokens=1024, engine_release="teardown")
            planned = memory.trainer_peak(plan_shape, inp, 1)
            tensors = planned.total - planned.as_dict()["context_comms"]  # what torch allocates
            norm = float(stats["grad_norm"])
            say(f"step1.5b {dtype} ckpt={'on' if ckpt else 'off'}", math.isfinite(norm) and norm > 0,
                f"{plan_shape.num_params / 1e9:.3g}B, {tokens} tokens: {seconds:.2f} s, peak {gib(peak)} "
                f"allocated; preflight plans {gib(tensors)} of tensors ({gib(planned.total)} with context and "
                f"communicators)" + ("" if cpu else f", measured/planned {peak / tensors:.2f}"))
            trainer.release()
            del trainer


def _plan_shape(torch, shape: dict):
    """The preflight ModelShape of `shape` (roles/model_shape.read_shape reads it from a folder)."""
    import json
    import tempfile

    from dynaresize.config import ModelConfig
    from dynaresize.roles.model_shape import read_shape

    with tempfile.TemporaryDirectory(prefix="dynaresize-shape-") as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"model_type": "qwen2", **shape}, f)
        return read_shape(ModelConfig(path=tmp))


def _new_group(torch, device, cpu: bool) -> None:
    import torch.distributed as dist

    costs = []
    for _ in range(4):
        if not cpu:
            torch.cuda.synchronize()
        free0 = 0 if cpu else torch.cuda.mem_get_info()[0]
        group = dist.new_group([0], device_id=None if cpu else device)
        x = torch.ones(1, device=device)
        dist.all_reduce(x, group=group)  # the communicator exists once it has run
        if not cpu:
            torch.cuda.synchronize()
        costs.append(0 if cpu else free0 - torch.cuda.mem_get_info()[0])
    say("new_group", None, "device bytes per eager one-rank group: " + ", ".join(f"{c / 2**20:.0f} MiB" for c in costs))


if __name__ == "__main__":
    sys.exit(main())
