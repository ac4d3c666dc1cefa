"""Giving a device's memory back when a role leaves it.

Invariant: after `release_device_memory`, torch's CUDA allocator holds no block that a released
role allocated: its free cached blocks go back to the device, and so do cuBLAS's workspaces,
which torch allocates through the same allocator, one per thread that ran a matmul (32 MiB each
on Hopper: the forward's thread and the autograd thread), and otherwise keeps for the process's
life. They come back on the next matmul, whichever role runs it. On the CPU it does nothing.
"""

from __future__ import annotations

import torch


def release_device_memory(device: torch.device) -> None:
    """Return cached and workspace memory to the device once no kernel of this process is in
    flight (call on the issuing thread, between collectives)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()  # not done by empty_cache; see the module docstring
    torch.cuda.empty_cache()
