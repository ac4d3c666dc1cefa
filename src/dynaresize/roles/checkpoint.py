"""Trainer checkpoints: one safetensors file per saved shard plus a JSON manifest written last.

Format (`FORMAT`): a checkpoint directory holds
- `shard-IIIII-of-WWWWW-sSTEP-NONCE.safetensors`, one per training rank at save time, with one
  1-D tensor per state kind (`param`, `exp_avg`, `exp_avg_sq`, optionally `ref`; fp32, or fp64
  from a deterministic run) holding that rank's pieces of the layout, concatenated;
- `manifest.json`: format, numel, parameter order (name, shape, offset), the layout saved
  (reshard/layout.py `describe()`), each shard's file name, pieces (global ranges), byte size
  and sha256, the replicated scalars (step counts, seed, RNG state), the optimizer settings and
  caller `extra` fields.

Invariants:
- Atomic: every file is written to a temporary name, fsynced and renamed; the manifest is
  written by one writer only after every shard file is in place. A crash mid-save leaves
  either the previous manifest (whose files carry other names and are untouched) or none,
  never a manifest that points at a missing or half-written shard. Saving into a directory
  that already holds a checkpoint replaces it atomically; files the new manifest does not
  name are deleted after it is in place.
- Reshard on load: a reader asks for any flat range [lo, hi) of a kind; the parts come from
  whichever saved pieces overlap it (reshard/sources.py), reading only those byte ranges
  (safetensors slices), so a checkpoint saved at W ranks in one layout loads at any W'.
- Every problem (missing manifest or shard, wrong size, sha256 mismatch, unreadable header,
  pieces that do not tile [0, numel)) raises `CheckpointError` with a one-line message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dynaresize.errors import CheckpointError
from dynaresize.reshard.sources import ShardSource, check_tiling

FORMAT = "dynaresize.shards.v2"
MANIFEST = "manifest.json"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_HASH_CHUNK_BYTES = 8 << 20


def _fsync_dir(path: Path) -> None:
    try:  # best effort: some filesystems do not allow opening a directory
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def save_shard(directory: str | Path, *, shard_index: int, num_shards: int, pieces: Sequence[Sequence[int]],
               tensors: Mapping[str, torch.Tensor], step: int) -> dict:
    """Write one rank's shard atomically (`tensors`: kind -> its `pieces` concatenated); return
    the manifest entry for it (pickles, JSON-safe)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"shard-{shard_index:05d}-of-{num_shards:05d}-s{step}-{uuid.uuid4().hex[:8]}.safetensors"
    tmp = directory / f".{name}.tmp"
    pieces = [[int(lo), int(hi)] for lo, hi in pieces]
    size = sum(hi - lo for lo, hi in pieces)
    cpu = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    for key, t in cpu.items():
        if t.dim() != 1 or t.numel() != size or t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"shard tensor {key} has shape {tuple(t.shape)} {t.dtype}, expected ({size},) fp32/fp64")
    save_file(cpu, str(tmp), metadata={"format": FORMAT, "pieces": json.dumps(pieces)})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    sha = file_sha256(tmp)
    nbytes = tmp.stat().st_size
    os.replace(tmp, directory / name)
    _fsync_dir(directory)
    return {"file": name, "index": shard_index, "pieces": pieces, "bytes": nbytes, "sha256": sha}


def encode_scalars(scalars: Mapping[str, Any]) -> dict:
    out = dict(scalars)
    if isinstance(out.get("rng_state"), (bytes, bytearray)):
        out["rng_state"] = base64.b64encode(bytes(out["rng_state"])).decode("ascii")
    return out


def decode_scalars(scalars: Mapping[str, Any]) -> dict:
    out = dict(scalars)
    if isinstance(out.get("rng_state"), str):
        out["rng_state"] = base64.b64decode(out["rng_state"])
    return out


def write_manifest(directory: str | Path, *, infos: Sequence[Mapping[str, Any]], numel: int,
                   params: Sequence[Mapping[str, Any]], ranks: Sequence[int], scalars: Mapping[str, Any],
                   settings: Mapping[str, Any], layout: Mapping[str, Any] | None = None,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """Write `manifest.json` last (tmp + rename), after checking the pieces tile [0, numel)."""
    directory = Path(directory)
    shards = sorted((dict(i) for i in infos), key=lambda i: i["index"])
    _check_tiling(directory, shards, numel)
    for info in shards:
        path = directory / info["file"]
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: shard {info['file']} missing or wrong size before manifest")
    manifest = {
        "format": FORMAT, "numel": numel, "step": int(scalars.get("step", 0)), "world": len(ranks),
        "ranks": list(ranks), "params": [dict(p) for p in params], "shards": shards,
        "layout": dict(layout) if layout is not None else None,
        "scalars": encode_scalars(scalars), "settings": dict(settings), "extra": dict(extra or {}),
    }
    tmp = directory / f".{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)
    keep = {info["file"] for info in shards}
    for path in directory.iterdir():  # files of earlier saves and crashed temporaries
        stale_shard = path.name.startswith("shard-") and path.suffix == ".safetensors" and path.name not in keep
        if stale_shard or (path.name.startswith(".") and path.name.endswith(".tmp")):
            path.unlink(missing_ok=True)
    return directory / MANIFEST


def _check_tiling(directory: Path, shards: list[dict], numel: int) -> None:
    try:
        pieces = [(int(lo), int(hi)) for info in shards for lo, hi in info["pieces"]]
        check_tiling(pieces, numel, f"checkpoint {directory}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(str(exc).splitlines()[0] if isinstance(exc, ValueError) else
                              f"checkpoint {directory}: malformed shard pieces") from None


def read_manifest(directory: str | Path) -> dict:
    """Load and check the manifest; raise `CheckpointError` when absent or malformed."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} missing (no complete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} unreadable ({type(exc).__name__})") from None
    required = ("format", "numel", "step", "ranks", "params", "shards", "scalars")
    if not isinstance(manifest, dict) or any(k not in manifest for k in required):
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} lacks required fields {required}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: format {manifest['format']!r}, expected {FORMAT!r}")
    _check_tiling(directory, sorted(manifest["shards"], key=lambda i: i.get("index", 0)), manifest["numel"])
    return manifest


class CheckpointReader:
    """Reads flat ranges of the saved tensors, touching only the shard files that overlap them.

    With `verify`, every shard file is checked against its size and sha256 the first time it is
    touched (this reads the whole file once: the price of detecting corruption).
    """

    def __init__(self, directory: str | Path, *, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.verify = verify
        self._checked: set[str] = set()
        shards = sorted(self.manifest["shards"], key=lambda i: i["index"])
        self._source = ShardSource([(info["pieces"], self._fetcher(info)) for info in shards],
                                   int(self.manifest["numel"]), f"checkpoint {self.directory}")

    def _check_file(self, info: dict) -> Path:
        path = self.directory / info["file"]
        if info["file"] in self._checked:
            return path
        if not path.is_file():
            raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} missing (partial checkpoint)")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} has {size} bytes, "
                                  f"manifest says {info['bytes']} (truncated or partial)")
        if self.verify and file_sha256(path) != info["sha256"]:
            raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} sha256 mismatch (corrupt)")
        self._checked.add(info["file"])
        return path

    def _fetcher(self, info: dict):
        def fetch(key: str, a: int, b: int) -> torch.Tensor:
            path = self._check_file(info)
            try:
                with safe_open(str(path), framework="pt") as fh:
                    piece = fh.get_slice(key)[a:b]
            except Exception as exc:  # safetensors raises several types on a bad header or key
                raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} unreadable "
                                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
            if piece.dtype not in (torch.float32, torch.float64) or piece.numel() != b - a:
                raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} tensor {key} malformed")
            return piece

        return fetch

    @property
    def source(self) -> ShardSource:
        return self._source

    def read(self, key: str, lo: int, hi: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values [lo, hi) of flat tensor `key` (saved dtype, or cast to `dtype`),
        assembled from the overlapping shards."""
        return self._source.read(key, lo, hi, dtype=dtype)
