"""The CUDA path, checked on one GPU in one process: what `scripts/device_check.sh` runs.

Built for the GPU machine lent for checks (Python with a CUDA torch, transformers,
safetensors, numpy; no Ray, no vLLM, no network): it imports the project from `src/` and
needs nothing else, because the roles and the trainer import without Ray. One line per check,
`ok` or `FAILED`, and exit status 1 when any failed:

- cuda: the device, torch's version and the device's free memory;
- fsdp: one bf16 FSDP2 training step on `cuda:0` in a one-rank NCCL world (the parameters
  move, the gradient norm is finite and positive), with the bytes of trainer state it holds;
- engine: the HF rollout engine generating on CUDA; a request's tokens are the same alone as
  in a batch (per-request seeds);
- sync: the trainer's full weights loaded into the engine in place, the engine's digest read
  back equal to the trainer's;
- export: the weights saved as an HF folder load in transformers and give the same logits;
- memory: tearing the engine down and releasing the trainer give their GPU memory back
  (`torch.cuda.mem_get_info`, and torch's own count);
- times: the sync and generation times.

`--cpu` runs the same checks on the CPU with gloo (no memory check): the CPU test suite runs
it, so the script itself is tested where no GPU is (tests/unit/test_device_check.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

FAILURES: list[str] = []


def say(name: str, ok: bool, text: str) -> None:
    print(f"{name}: {'ok' if ok else 'FAILED'} ({text})", flush=True)
    if not ok:
        FAILURES.append(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU with gloo (tests)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"cuda: FAILED (no torch in {sys.executable}: {exc})")
        return 1

    if not args.cpu and not torch.cuda.is_available():
        print(f"cuda: FAILED (no CUDA device: torch {torch.__version__} sees none; this check needs a GPU)")
        return 1
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    backend = "gloo" if args.cpu else "nccl"
    if not args.cpu:
        free, total = torch.cuda.mem_get_info()
        say("cuda", True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                          f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    from dynaresize.comm import rendezvous

    rendezvous.init_world(rank=0, world_size=1, init_method=rendezvous.world_init_method("127.0.0.1",
                          rendezvous.free_port()), backend=backend, timeout_s=120, device_index=0)
    try:
        _checks(torch, device, args.cpu)
    except Exception as exc:  # a crash is a failed check, with its cause on one line
        say("crash", False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        rendezvous.destroy_world()
    print(f"device check: {'FAILED: ' + ', '.join(FAILURES) if FAILURES else 'all ok'}")
    return 1 if FAILURES else 0


def _checks(torch, device, cpu: bool) -> None:
    import torch.distributed as dist

    from dynaresize.config import ModelConfig
    from dynaresize.rl import grpo
    from dynaresize.rl.models import build_model, build_tokenizer, complete_state_dict, save_hf
    from dynaresize.roles.base import GenRequest
    from dynaresize.roles.device_memory import release_device_memory
    from dynaresize.roles.rollout_hf import HFRolloutEngine
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import TrainerSpec
    from dynaresize.roles.train_state import OptimSettings
    from dynaresize.roles.weight_sync import weights_digest

    cfg = ModelConfig()
    mem = _Memory(torch, enabled=not cpu)

    # fsdp: one bf16 step on a one-rank world
    base = mem.used()
    spec = TrainerSpec(model=cfg, optim=OptimSettings(lr=1e-2, max_grad_norm=1.0), compute_dtype="bf16")
    trainer = FSDPTrainer(spec, ranks=(0,), rank=0, group=dist.new_group([0]), device=str(device),
                          init_model=build_model(cfg))
    before = [t.detach().clone() for t in trainer.pieces("param")]
    batch = [grpo.TrainSample(sample_id=(0, 0, s), prompt_ids=[2, 10, 11], response_ids=[12, 13, 14, 15],
                              rollout_logprobs=[-7.0] * 4, advantage=1.0 - s) for s in range(2)]

    def loss_fn(model, mb):
        b = grpo.dummy_micro_batch() if mb is None else mb
        return grpo.micro_batch_loss(model, b, total_response_tokens=8, clip_eps=0.2), {}

    t0 = time.perf_counter()
    stats = trainer.compute_grads([(0, batch)], loss_fn, num_micro_batches=1)
    trainer.apply_optimizer()
    _sync(torch, cpu)
    step_s = time.perf_counter() - t0
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.pieces("param")))
    on_device = all(t.device.type == device.type for t in trainer.pieces("param"))
    norm = float(stats["grad_norm"])
    say("fsdp", moved and on_device and math.isfinite(norm) and norm > 0,
        f"bf16 step on {device} in a one-rank {dist.get_backend()} world: {step_s:.2f} s, grad norm {norm:.3g}, "
        f"state {stats['train_state_bytes'] / 2**20:.1f} MiB, parameters moved {moved}")
    del before
    held = mem.used()

    # engine: generation on the device, per-request seeds
    engine = HFRolloutEngine(cfg, 1.0, batch_rows=8, device=str(device))
    t0 = time.perf_counter()
    full = dict(trainer.full_params())
    engine.set_weights(full, 1)
    _sync(torch, cpu)
    sync_s = time.perf_counter() - t0
    requests = [GenRequest(sample_id=(0, 0, s), prompt_ids=[2, 10, 11, 12], max_new_tokens=32, seed=100 + s,
                           forced_length=32) for s in range(8)]
    t0 = time.perf_counter()
    batch_out = engine.generate(requests)
    _sync(torch, cpu)
    gen_s = time.perf_counter() - t0
    alone = engine.generate(requests[3:4])[0]
    say("engine", all(len(r.response_ids) == 32 for r in batch_out)
        and alone.response_ids == batch_out[3].response_ids,
        f"8 x 32 tokens on {device} in {gen_s:.2f} s; a request alone gives the tokens it gave in the batch")

    # sync: the engine computes with exactly the trainer's weights
    same = engine.weights_digest() == weights_digest(full.items())
    say("sync", same, f"trainer -> engine in place, {sum(t.numel() for t in full.values()) / 1e6:.2f}M parameters "
                      f"in {sync_s:.3f} s; digest read back from the engine equals the trainer's: {same}")

    # export: the HF folder loads in transformers and computes the same logits
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="dynaresize-check-") as tmp:
        model = build_model(cfg)
        host = {k: v.detach().float().cpu() for k, v in full.items()}
        model.load_state_dict(complete_state_dict(host, model), strict=True)
        save_hf(model, build_tokenizer(cfg.vocab_size), Path(tmp))
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device)
        names = dict(loaded.named_parameters())
        same_weights = weights_digest((n, names[n]) for n in full) == weights_digest(full.items())
        ids = torch.tensor([[2, 10, 11, 12]], device=device)
        with torch.no_grad():
            a = loaded(ids).logits.float().cpu()
            b = model.to(device)(ids).logits.float().cpu()
        diff = float((a - b).abs().max())
        say("export", same_weights and diff == 0.0, f"HF folder loaded by transformers holds the trainer's weights: "
                                                    f"{same_weights}; max logit difference {diff:.2e}")
        del loaded, model, names
    del full

    # memory: teardown and release give the device memory back
    engine_held = mem.used()
    engine.release()
    trainer.release()
    del trainer, engine
    gc.collect()
    if mem.enabled:
        release_device_memory(device)  # what a role switch does (cuBLAS workspaces included)
        after, alloc_after = mem.used(), torch.cuda.memory_allocated()
        grew = mem.peak_alloc - mem.base_alloc
        kept = alloc_after - mem.base_alloc
        returned = max(held, engine_held) - after
        say("memory", grew > 0 and kept <= 0.1 * grew and returned > 0,
            f"tensors: {grew / 2**20:.1f} MiB allocated over the start, {kept / 2**20:.1f} MiB left after teardown "
            f"and release; device (mem_get_info): {returned / 2**20:.1f} MiB returned, "
            f"{(after - base) / 2**20:.1f} MiB still used over the start (communicators, CUDA context)")
        if kept > 0.1 * grew:
            print(f"  held: {_held_cuda_tensors(torch)}")
            print(f"  allocated at: {_live_blocks(torch)}")
    else:
        print("memory: skipped (CPU run: no device memory to measure)")
    print(f"times: weight sync {sync_s * 1e3:.1f} ms, generation {gen_s:.2f} s (8 x 32 tokens), "
          f"training step {step_s:.2f} s")


def _held_cuda_tensors(torch) -> str:
    """Which CUDA tensors Python still reaches after a teardown, by size and holder: the clue a
    failed memory check needs (tensors only C++ holds, e.g. an autograd graph, are not listed)."""
    found: dict[tuple, list[int]] = {}
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
        except Exception:  # objects that cannot be inspected
            continue
        holders = []
        for ref in gc.get_referrers(obj):
            if isinstance(ref, dict):
                holders.append("dict[" + ",".join(str(k) for k in list(ref)[:2]) + "]")
            elif not isinstance(ref, list):
                holders.append(type(ref).__qualname__)
        key = (tuple(obj.shape), str(obj.dtype).replace("torch.", ""), tuple(holders[:2]))
        entry = found.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += obj.untyped_storage().nbytes()
    total = sum(b for _, b in found.values())
    top = sorted(found.items(), key=lambda kv: -kv[1][1])[:6]
    return (f"{total / 2**20:.1f} MiB reachable from Python in {sum(n for n, _ in found.values())} tensors; "
            + "; ".join(f"{n} x {list(shape)} {dt} held by {'/'.join(h) or '?'} ({b / 2**20:.1f} MiB)"
                        for (shape, dt, h), (n, b) in top))


def _live_blocks(torch) -> str:
    """Where the blocks still allocated were allocated (torch's memory history, recorded since
    the start): the project frames nearest each allocation, biggest first."""
    where: dict[str, int] = {}
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if "dynaresize" in f["filename"] or "check" in f["filename"]]
            name = " < ".join(f"{Path(f['filename']).name}:{f['line']}" for f in frames[:3]) or "?"
            where[name] = where.get(name, 0) + int(block.get("size", 0))
    top = sorted(where.items(), key=lambda kv: -kv[1])[:6]
    return "; ".join(f"{w} ({b / 2**20:.1f} MiB)" for w, b in top) or "no history"


class _Memory:
    """Device memory in use (total - free, `torch.cuda.mem_get_info`), or 0 on the CPU."""

    def __init__(self, torch, *, enabled: bool) -> None:
        self.torch, self.enabled = torch, enabled
        self.base_alloc = torch.cuda.memory_allocated() if enabled else 0
        if enabled:  # so that a failed memory check can say where the leftovers were allocated
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.peak_alloc = self.base_alloc

    def used(self) -> int:
        """Device bytes in use now; also keeps the peak of torch's allocated bytes."""
        if not self.enabled:
            return 0
        self.torch.cuda.synchronize()
        self.peak_alloc = max(self.peak_alloc, self.torch.cuda.memory_allocated())
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)


def _sync(torch, cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
