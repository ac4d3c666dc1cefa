"""Trainer checkpoints: one safetensors file per saved shard plus a JSON manifest written last.

Format (`FORMAT`): a checkpoint directory holds
- `shard-IIIII-of-WWWWW-sSTEP-NONCE.safetensors`, one per training rank at save time, with the
  1-D fp32 tensors `param`, `exp_avg`, `exp_avg_sq` of that rank's flat range [lo, hi);
- `manifest.json`: format, numel, parameter order (name, shape, offset), the saved rank set,
  each shard's file name, range, byte size and sha256, the replicated scalars (step counts,
  seed, RNG state), the optimizer settings and caller `extra` fields.

Invariants:
- Atomic: every file is written to a temporary name, fsynced and renamed; the manifest is
  written by one writer only after every shard file is in place. A crash mid-save leaves
  either the previous manifest (whose files carry other names and are untouched) or none,
  never a manifest that points at a missing or half-written shard. Saving into a directory
  that already holds a checkpoint replaces it atomically; files the new manifest does not
  name are deleted after it is in place.
- Reshard on load: a reader asks for any flat range [lo, hi) of a tensor; the pieces come from
  whichever saved shards overlap it, reading only those byte ranges (safetensors slices), so a
  checkpoint saved at W ranks loads at any W'.
- Every problem (missing manifest or shard, wrong size, sha256 mismatch, unreadable header,
  ranges that do not tile [0, numel)) raises `CheckpointError` with a one-line message.
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

FORMAT = "dynaresize.flat-shards.v1"
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


def save_shard(directory: str | Path, *, shard_index: int, num_shards: int, lo: int, hi: int,
               tensors: Mapping[str, torch.Tensor], step: int) -> dict:
    """Write one rank's shard atomically; return the manifest entry for it (pickles, JSON-safe)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"shard-{shard_index:05d}-of-{num_shards:05d}-s{step}-{uuid.uuid4().hex[:8]}.safetensors"
    tmp = directory / f".{name}.tmp"
    cpu = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in tensors.items()}
    for key, t in cpu.items():
        if t.dim() != 1 or t.numel() != hi - lo:
            raise ValueError(f"shard tensor {key} has shape {tuple(t.shape)}, expected ({hi - lo},)")
    save_file(cpu, str(tmp), metadata={"format": FORMAT, "lo": str(lo), "hi": str(hi)})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    sha = file_sha256(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, directory / name)
    _fsync_dir(directory)
    return {"file": name, "index": shard_index, "lo": lo, "hi": hi, "bytes": size, "sha256": sha}


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
                   settings: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> Path:
    """Write `manifest.json` last (tmp + rename), after checking the shards tile [0, numel)."""
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
    pos = 0
    for info in shards:
        if info.get("lo") != pos or not isinstance(info.get("hi"), int) or info["hi"] < pos:
            raise CheckpointError(f"checkpoint {directory}: shard ranges do not tile [0, {numel}) at {pos}")
        pos = info["hi"]
    if pos != numel:
        raise CheckpointError(f"checkpoint {directory}: shard ranges end at {pos}, expected {numel}")


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
        self._shards = sorted(self.manifest["shards"], key=lambda i: i["lo"])

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

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """The fp32 values [lo, hi) of flat tensor `key`, assembled from the overlapping shards."""
        if not 0 <= lo <= hi <= self.manifest["numel"]:
            raise ValueError(f"range [{lo}, {hi}) outside [0, {self.manifest['numel']})")
        out = torch.empty(hi - lo, dtype=torch.float32)
        for info in self._shards:
            a, b = max(lo, info["lo"]), min(hi, info["hi"])
            if a >= b:
                continue
            path = self._check_file(info)
            try:
                with safe_open(str(path), framework="pt") as fh:
                    piece = fh.get_slice(key)[a - info["lo"]:b - info["lo"]]
            except Exception as exc:  # safetensors raises several types on a bad header or key
                raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} unreadable "
                                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
            if piece.dtype != torch.float32 or piece.numel() != b - a:
                raise CheckpointError(f"checkpoint {self.directory}: shard {info['file']} tensor {key} malformed")
            out[a - lo:b - lo].copy_(piece)
        return out
