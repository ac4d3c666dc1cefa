"""Device-worker methods that write checkpoints and the HF export themselves (mixed into DeviceWorker).

Checkpoint bytes never pass through the driver's memory (cluster/checkpoint_io.py drives
these): each trainer writes its own shard of the trainer state straight into the checkpoint
directory (`save_checkpoint_shard`, roles/checkpoint.py format), a worker writes a snapshot
shard it is handed by reference (`write_snapshot_shard`: Ray resolves the reference on the
worker's node, so the arrays go object store -> this worker -> disk), and the HF export is
gathered on the first trainer, which writes it (`export_hf`). Each returns only the small
manifest entry (file, pieces, bytes, sha256) and metadata; the driver writes the index.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch


class CheckpointMixin:
    """Methods of `DeviceWorker` (attributes: see DeviceWorker)."""

    def save_checkpoint_shard(self, directory: str, version: int, num_shards: int) -> dict:
        """Write this trainer's state of `version` as shard `index` of `num_shards` into
        `directory`; its manifest entry and the metadata the driver's index needs."""
        from dynaresize.roles.checkpoint import save_shard

        t0 = time.time()
        tr = self.trainer
        if tr is None or tr.step != version:
            raise RuntimeError(f"checkpoint of version {version} asked, device {self.device} holds "
                               f"{'no trainer' if tr is None else f'version {tr.step}'}")
        info = save_shard(directory, shard_index=tr.index, num_shards=num_shards, pieces=tr.local_pieces(),
                          tensors=tr.export_state(), step=version)
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(tr.spec.optim).items()}
        return {"info": info, "numel": tr.layout.numel, "params": tr.param_meta(), "scalars": tr.scalars(),
                "layout": tr.layout.describe(), "settings": settings, "t0": t0, "t1": time.time(),
                "device": self.device}

    def write_snapshot_shard(self, directory: str, index: int, num_shards: int, pieces: Sequence[Sequence[int]],
                             version: int, param: np.ndarray, others: dict | None = None) -> dict:
        """Write shard `index` of a snapshot (its arrays, resolved by Ray on this worker) into
        `directory`; its manifest entry."""
        from dynaresize.roles.checkpoint import save_shard

        arrays = {"param": param, **(others or {})}
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in arrays.items()}
        return save_shard(directory, shard_index=index, num_shards=num_shards, pieces=pieces, tensors=tensors,
                          step=version)

    def export_hf(self, directory: str) -> dict | None:
        """The full weights in HF format (config.json, model.safetensors) written by the first
        trainer into `directory`. Collective over the training group: every trainer gathers the
        full weights parameter by parameter; only the first keeps them."""
        from dynaresize.roles.lora_model import save_export

        t0 = time.time()
        first = self.trainer.index == 0
        state: dict[str, Any] = {}
        for name, t in self.trainer.full_params():
            if first:
                state[name] = t.cpu()
        if not first:
            return None
        save_export(self.cfg.model, self.cfg.train.lora, state, directory)  # LoRA: merged, and the adapter
        if not (Path(directory) / "config.json").is_file():
            raise RuntimeError(f"HF export: {directory} has no config.json after the save (transformers skipped it)")
        return {"device": self.device, "t0": t0, "t1": time.time()}
