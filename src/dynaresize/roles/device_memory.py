"""Giving a device's memory back when a role leaves it.

Release means collected: a leaving trainer's FSDP2 modules, hooks and DTensors form reference
cycles, so dropping the last outside reference frees nothing until the cyclic collector runs,
and an engine started meanwhile finds the memory still taken (vLLM checks the free memory at
start; a parked engine wakes into what it had). `release_device_memory` therefore runs
`gc.collect()` first, then gives cached blocks back. Order matters with vLLM: its start freezes
the GC (roles/rollout_vllm.py), and an object still uncollected when the heap is frozen stays
until the freeze ends, so every release that precedes an engine's start or wake calls this
first (cluster/worker_resize.py `free_train_memory`, the trainer's `release`).

Invariant: after `release_device_memory`, no unreachable object of this process still holds a
tensor, and torch's CUDA allocator holds no block that a released role allocated: its free
cached blocks go back to the device, and so do cuBLAS's workspaces, which torch allocates
through the same allocator, one per thread that ran a matmul (32 MiB each on Hopper: the
forward's thread and the autograd thread), and otherwise keeps for the process's life. They
come back on the next matmul, whichever role runs it. On the CPU only the collection runs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def release_device_memory(device: torch.device) -> None:
    """Collect unreachable objects, then return cached and workspace memory to the device once
    no kernel of this process is in flight (call on the issuing thread, between collectives)."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()  # not done by empty_cache; see the module docstring
    torch.cuda.empty_cache()


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes free on `device` as the driver sees them (CUDA `mem_get_info`: other processes'
    use counted), None where there is no such figure (the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def wake_problem(need_bytes: int, free_bytes: int | None, what: str) -> str | None:
    """One line saying why `what` cannot wake into the free memory, or None when it fits (or
    nothing is known)."""
    if free_bytes is None or need_bytes <= 0 or free_bytes >= need_bytes:
        return None
    gib = 1 << 30
    return (f"{what} cannot wake: it needs {need_bytes / gib:.2f} GiB back and the device has "
            f"{free_bytes / gib:.2f} GiB free (another process or a role not yet released holds the rest)")


def bytes_freed_by(action: Callable[[], object], device: torch.device) -> int:
    """Run `action` (an engine's sleep); the bytes it gave back to `device` (0 on the CPU)."""
    before = free_device_bytes(device)
    action()
    after = free_device_bytes(device)
    return max(0, after - before) if before is not None and after is not None else 0


def check_wake(need_bytes: int, device: torch.device, what: str) -> None:
    """Collect and free cached memory, then raise a one-line `RuntimeError` when `what` cannot
    get back the `need_bytes` it gave up on `device` (`wake_problem`)."""
    release_device_memory(device)
    problem = wake_problem(need_bytes, free_device_bytes(device), f"{what} on {device}")
    if problem:
        raise RuntimeError(problem)
