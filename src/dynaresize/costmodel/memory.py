"""Bytes per device: the one place that says how much memory a role's state takes.

Used by the simulator's bounds and resize costs (`costs.min_train_devices`,
`ModelPreset.train_state_bytes`), the emulator (the same bounds) and docs/gpu.md (its tables
are this module's output, checked by tests/unit/test_memory.py).

The trainer (FSDP2 with fp32 master weights, roles/train_fsdp.py) holds per parameter:
fp32 parameters (4 B), fp32 gradients (4 B) and two fp32 AdamW moments (8 B): 16 B, divided
over the W training devices. A frozen reference model (KL on) adds its fp32 copy (4 B). What
is transient (the all-gathered bf16 block of the layer being computed, activations, logits)
is not state: it lives in the share of memory the floor leaves free.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math

# fp32 master (4) + fp32 gradient (4) + two fp32 AdamW moments (8), as roles/train_fsdp.py
# holds them and measures them (`train_state_bytes` in its stats, docs/training.md).
TRAIN_STATE_BYTES_PER_PARAM = 16.0
# A frozen fp32 reference model, where the KL term needs one.
REFERENCE_BYTES_PER_PARAM = 4.0
# The share of a device's memory the sharded training state may take; the rest is for
# activations, the gathered block and communicator buffers.
TRAIN_STATE_HBM_FRACTION = 0.7


def train_state_bytes(num_params: float, *, reference: bool = False) -> float:
    """All trainers' state together, in bytes (divide by W for one device's share)."""
    per_param = TRAIN_STATE_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if reference else 0.0)
    return per_param * float(num_params)


def train_state_budget_bytes(hbm_bytes: float) -> float:
    """The bytes of one device the training state's share may use."""
    return TRAIN_STATE_HBM_FRACTION * float(hbm_bytes)


def min_train_devices_for(num_params: float, hbm_bytes: float, *, reference: bool = False) -> int:
    """The memory floor: the fewest training devices whose shares of the state fit their budget."""
    need = train_state_bytes(num_params, reference=reference)
    return max(1, math.ceil(need / train_state_budget_bytes(hbm_bytes)))
