"""Moving trainer state between two layouts: the reshard of a resize, run on one rank.

`move_state` hands the state kinds it is given (parameters, AdamW moments, the frozen
reference) from the old trainer's shards to the new trainer's through the bounded staging
buffer of `reshard.execute`, writing straight into the new trainer's storage, so no rank ever
holds a second copy of the state. Every rank of either layout calls it, in the same order.

Imports torch, not Ray.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dynaresize.roles.train_fsdp import FSDPTrainer
from dynaresize.roles.train_spec import TrainerSpec


def move_state(old: FSDPTrainer | None, new: FSDPTrainer | None, *, kinds: Sequence[str], old_layout: Any,
               new_layout: Any, rank: int, spec: TrainerSpec, staging_bytes: int, group: Any = None,
               old_pieces: Mapping[str, Sequence[torch.Tensor]] | None = None) -> Any:
    """Move `kinds` of trainer state from `old`'s shards to `new`'s, through the bounded staging
    buffer (reshard.execute), writing straight into `new`'s storage. Called on every rank of
    either layout; `old_pieces` overrides `old.pieces` (moments kept after the old trainer went).
    Returns the `ReshardStats`."""
    from dynaresize.reshard.execute import reshard

    src = {k: old_pieces[k] for k in kinds} if old_pieces is not None else (
        {k: old.pieces(k) for k in kinds} if old is not None else None)
    out = {k: new.pieces(k) for k in kinds} if new is not None else None
    device = new.device if new is not None else (old.device if old is not None else None)
    _, stats = reshard(src, old_layout=old_layout, new_layout=new_layout, rank=rank, staging_bytes=staging_bytes,
                       out=out, group=group, kinds=kinds, dtypes={k: spec.dtype_of(k) for k in kinds}, device=device)
    if new is not None:
        new.mark_loaded(kinds)
    return stats
