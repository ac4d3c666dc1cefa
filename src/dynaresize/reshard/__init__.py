"""Reshard: moving flat-sharded trainer state when the training world changes size.

`layout` and `plan` are pure (no torch, importable anywhere); `execute` runs a plan with
torch.distributed point-to-point messages through a bounded staging buffer. Import
`dynaresize.reshard.execute` explicitly where torch is available.
"""

from dynaresize.reshard.layout import FlatLayout
from dynaresize.reshard.plan import Transfer, chunk_elems_for, plan_bytes, transfer_plan

__all__ = ["FlatLayout", "Transfer", "chunk_elems_for", "plan_bytes", "transfer_plan"]
