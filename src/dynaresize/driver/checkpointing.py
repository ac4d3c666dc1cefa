"""Run checkpoints (periodic, final, on a stop) and resuming a run from its last one.

Layout of `RUN_DIR/checkpoint/` (beside the final policy in HF format, `config.json` and
`model.safetensors`, which every finished run rewrites):

    latest.json                  {"format", "step", "dir"}: the last complete checkpoint
    step-SSSSSS-NONCE/
      trainer/                   trainer state of version S (roles/checkpoint.py format:
                                 shards, sha256 each, manifest written last; loads at any W)
      rollout/                   parameters of version rollout_version(S): the weights that
                                 generate the samples of step S (one step off: S-1)
      rollout-vV/                streaming (staleness ETA >= 2) only: parameters of each version
                                 V = S-ETA+1 .. S-1, which the steps in flight S+1 .. S+ETA-1
                                 are generated with (version S is the trainer state's)
      driver.pkl                 driver state at the boundary: ledger of steps < S, controller
                                 and policy, rewards, resizes, fault counters, records offset
      driver.json                written last in the directory: digests of the three above

A checkpoint "of step S" is the boundary before step S: S optimizer steps applied, the
samples of steps < S consumed, none of step S generated (they are regenerated on resume with
the same ids, seeds and weights, so a resumed run equals an uninterrupted one). A streaming
checkpoint is the same cut with the steps in flight: it keeps the samples of steps >= S already
generated (`driver.pkl`'s `stream_samples`; a resume keeps them and re-issues only the others)
and every weight version those steps still need. Samples are kept and weights stored because
both are needed: a step's unfinished samples need its version's weights, and regenerating the
finished ones would cost their rollout again; the samples are token ids, small beside one copy
of the weights. Prompts are a function of the step (the data position is the step itself).

Crash safety: a checkpoint is written into a new directory (a fresh name), complete with
`driver.json`, before `latest.json` is replaced (tmp + rename) to point at it; older
directories are deleted only after. A crash at any moment leaves `latest.json` naming a
complete checkpoint (or no `latest.json` at all, before the first one).

Where: `checkpoint.dir` when set (a path every node sees, for runs on several nodes: the
trainers of a resumed run read their shards from it; docs/cluster.md), else RUN_DIR/checkpoint.
A `checkpoint.dir` belongs to one run: `owner.json` names the run directory, and another run
is refused (it would delete the first run's checkpoints). On resume, every worker checks it
sees the checkpoint before loading it.

Resume validates everything (`load_resume_point`: pointer, digests, manifests, every shard's
size and sha256) before the run directory is touched; any problem is one `CheckpointError` line.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynaresize.cluster.checkpoint_io import dir_bytes
from dynaresize.config_load import config_to_dict
from dynaresize.errors import CheckpointError
from dynaresize.pipeline.stepstate import rollout_version

FORMAT = "dynaresize.run-checkpoint.v1"
LATEST = "latest.json"


def _sha256(path: Path) -> str:
    from dynaresize.roles.checkpoint import file_sha256

    return file_sha256(path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


OWNER = "owner.json"


def checkpoint_root(run_dir: str | Path, checkpoint_dir: str | None) -> Path:
    """The absolute directory of a run's checkpoints (`checkpoint.dir`, else RUN_DIR/checkpoint)."""
    return Path(checkpoint_dir).expanduser().resolve() if checkpoint_dir else (Path(run_dir) / "checkpoint").resolve()


def claim_root(root: Path, run_dir: Path) -> None:
    """Make `root` this run's checkpoint directory; UserError if it is another run's."""
    from dynaresize.errors import UserError

    owner = root / OWNER
    me = str(Path(run_dir).resolve())
    if owner.is_file():
        try:
            theirs = json.loads(owner.read_text()).get("run_dir")
        except ValueError:
            theirs = None
        if theirs != me:
            raise UserError(f"checkpoint.dir={str(root)!r}: holds the checkpoints of another run ({theirs}); "
                            "give each run its own directory")
        return
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(owner, json.dumps({"run_dir": me}).encode())


class Checkpointer:
    def __init__(self, run: Any) -> None:
        self.run = run
        self.root = checkpoint_root(run.out, run.cfg.checkpoint.dir)
        if run.cfg.checkpoint.dir:
            claim_root(self.root, run.out)

    def periodic(self, boundary: int) -> None:
        every = self.run.cfg.checkpoint.every_steps
        if every and boundary % every == 0 and boundary < self.run.cfg.steps:
            self.save(boundary, "periodic")

    def save(self, boundary: int, kind: str, *, finish_pending: bool = True, live: bool | None = None) -> Path:
        """A checkpoint of `boundary`. `live`: every trainer is alive (default: any save but a
        stop's; a stop with every trainer alive passes True), so the workers write its shards;
        otherwise (a stop after a loss) the driver writes them from the snapshots."""
        run = self.run
        live = kind != "stop" if live is None else live
        if finish_pending:
            run._finish_pending()  # its resize record belongs to the state being saved
        t0 = time.time()
        rv = rollout_version(boundary, run.cfg.train.staleness)
        name = f"step-{boundary:06d}-{uuid.uuid4().hex[:8]}"
        out = self.root / name
        out.mkdir(parents=True)
        written = write_state(run, boundary, out / "trainer", live=live)
        extra = stream_versions(boundary, run.cfg.train.staleness)
        for v, sub in [(rv, "rollout"), *((v, f"rollout-v{v}") for v in extra)]:
            write_weights(run, v, out / sub, driver=not live)
        offset = run.rec.path.stat().st_size  # the recorder flushes every line
        state = {
            "format": FORMAT, "boundary": boundary, "rollout_version": rv, "ledger": run.ledger.state_before(boundary),
            "controller": run.controller, "next_resize_id": run.controller.next_resize_id,
            "rewards": run.rewards[:boundary], "resizes": run.resizes, "config": config_to_dict(run.cfg),
            "devices": run.cfg.cluster.devices, "rollout_devices": run.cfg.cluster.rollout_devices,
            "stats": {**run.stats, "faults_injected": run.stats["faults_injected"] + run.cluster.faults.num_fired,
                      "elapsed_s": t0 - run.t0},
            "records_offset": offset,
            "stream_samples": {s: list(buf.results) for s, buf in run.rollouts.items()
                               if s >= boundary and run.cfg.train.staleness >= 2},
        }
        _write_atomic(out / "driver.pkl", pickle.dumps(state))
        digests = {"driver.pkl": _sha256(out / "driver.pkl"),
                   "trainer/manifest.json": _sha256(out / "trainer" / "manifest.json"),
                   "rollout/manifest.json": _sha256(out / "rollout" / "manifest.json"),
                   **{f"rollout-v{v}/manifest.json": _sha256(out / f"rollout-v{v}" / "manifest.json") for v in extra}}
        _write_atomic(out / "driver.json", json.dumps({"format": FORMAT, "step": boundary, "rollout_version": rv,
                                                       "records_offset": offset, "kind": kind,
                                                       "sha256": digests}, indent=1).encode())
        _write_atomic(self.root / LATEST, json.dumps({"format": FORMAT, "step": boundary, "dir": name}).encode())
        for old in self.root.iterdir():  # earlier checkpoints and crashed attempts, after the pointer moved
            if old.is_dir() and old.name.startswith("step-") and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        run.rec.emit("checkpoint", step=boundary, path=str(out), cause=kind, seconds=time.time() - t0,
                     written_by=written,
                     records_offset=offset, rollout_version=rv, weight_versions=1 + len(extra),
                     stream_samples=sum(len(v) for v in state["stream_samples"].values()),
                     bytes=dir_bytes(out))
        return out


def write_state(run: Any, boundary: int, directory: Path, *, live: bool) -> str:
    """The trainer state of `boundary` into `directory`; who wrote its shards. `live` (a
    periodic or final save, or a stop with every trainer alive): each trainer writes its own
    shard of the state it holds when that is `boundary`'s, else the live workers write the
    snapshot's shards (cluster/checkpoint_io.py). A stop after a loss: from the snapshot of
    `boundary`, whose trainers may be gone, written by the driver."""
    from dynaresize.cluster import checkpoint_io, snapshot

    cluster = run.cluster
    if live:
        trainer = cluster.assignment.devices("train")[0]
        step = cluster.wait([(trainer, cluster.workers[trainer].trainer_scalars.remote())], "checkpoint")[0]["step"]
        if step == boundary:
            return checkpoint_io.write_trainer_checkpoint(cluster, directory, version=boundary)["written_by"]
        return checkpoint_io.write_snapshot_checkpoint(cluster, run.snapshots[boundary], directory)["written_by"]
    snapshot.write_checkpoint(run.snapshots[boundary], directory)
    return "driver"


def write_weights(run: Any, version: int, directory: Path, *, driver: bool) -> None:
    """Parameters of `version` (a rollout version the checkpoint needs) from its snapshot into
    `directory`: shards written by live workers, or by the driver on a stop after a loss."""
    from dynaresize.cluster import checkpoint_io, snapshot

    if driver:
        snapshot.write_checkpoint(run.snapshots[version], directory, params_only=True)
    else:
        checkpoint_io.write_snapshot_checkpoint(run.cluster, run.snapshots[version], directory, params_only=True)


def export_hf(run: Any, directory: Path) -> str:
    """The final weights as an HF folder in `directory`, gathered and written on the first
    trainer (cluster/checkpoint_io.py); the tokenizer files by the driver (small). Who wrote
    the weights."""
    from dynaresize.cluster import checkpoint_io

    by = checkpoint_io.export_hf(run.cluster, directory)
    if run.job.tokenizer is not None:
        run.job.tokenizer.save_pretrained(directory)
    return by


@dataclass
class ResumePoint:
    run_dir: Path
    step_dir: Path
    boundary: int
    rollout_version: int
    driver: dict

    @property
    def config(self) -> dict:
        return self.driver["config"]

    def load_into(self, cluster: Any) -> None:
        """Trainers from the trainer checkpoint (resharded to the cluster's split), rollout devices
        from the rollout weights."""
        from dynaresize.types import ROLLOUT, TRAIN

        a = cluster.assignment
        train, roll = a.devices(TRAIN), a.devices(ROLLOUT)
        step_dir = self.step_dir.resolve()  # workers run elsewhere: never a path relative to this process
        seen = cluster.wait([(d, w.sees_path.remote(str(step_dir))) for d, w in enumerate(cluster.workers)],
                            "resume: checkpoint visible")
        blind = [d for d, ok in enumerate(seen) if not ok]
        if blind:
            raise CheckpointError(f"checkpoint {step_dir}: not visible to device(s) {blind} (their node does not "
                                  "see this path; on several nodes put checkpoints where every node sees them: "
                                  "checkpoint.dir on a shared filesystem, docs/cluster.md)")
        calls = [(d, cluster.workers[d].load_checkpoint.remote(str(step_dir / "trainer"), train)) for d in train]
        calls += [(d, cluster.workers[d].load_rollout_checkpoint.remote(str(step_dir / "rollout"),
                                                                      self.rollout_version)) for d in roll]
        cluster.wait(calls, "resume: load checkpoint")

    def rollout_snapshot(self, version: int | None = None) -> Any:
        """Rollout weights of `version` (default: the oldest the checkpoint holds) as a
        parameters-only snapshot (for a recovery before the first sync, or a streaming pull)."""
        from dynaresize.cluster.snapshot import params_only
        from dynaresize.roles.checkpoint import CheckpointReader

        version = self.rollout_version if version is None else version
        sub = "rollout" if version == self.rollout_version else f"rollout-v{version}"
        reader = CheckpointReader(self.step_dir / sub)
        m = reader.manifest
        meta = {"scalars": m["scalars"], "params": m["params"], "settings": m.get("settings", {})}
        return params_only(version, reader.read("param", 0, m["numel"]).numpy(), meta)

    @property
    def stream_samples(self) -> dict[int, list]:
        """Streaming: step -> (device, GenResult) of the samples generated before the checkpoint."""
        return dict(self.driver.get("stream_samples") or {})


def _verify_dir(directory: Path) -> dict:
    from dynaresize.roles.checkpoint import read_manifest

    manifest = read_manifest(directory)
    for info in manifest["shards"]:
        path = directory / info["file"]
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: shard {info['file']} missing (partial checkpoint)")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: shard {info['file']} has {path.stat().st_size} bytes, "
                                  f"manifest says {info['bytes']} (truncated)")
        if _sha256(path) != info["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: shard {info['file']} sha256 mismatch (corrupt)")
    return manifest


def stream_versions(boundary: int, staleness: int) -> list[int]:
    """Versions a streaming checkpoint of step `boundary` stores beside its oldest (`rollout/`)
    and the trainer state: those of the steps in flight, boundary-staleness+1 .. boundary-1."""
    if staleness < 2:
        return []
    return list(range(rollout_version(boundary, staleness) + 1, boundary))


def load_resume_point(run_dir: str | Path) -> ResumePoint:
    """The last complete checkpoint of `run_dir`, fully verified; CheckpointError otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir}: not found")
    root = checkpoint_root(run_dir, _saved_checkpoint_dir(run_dir))
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"run directory {run_dir}: no checkpoint to resume from ({latest} missing)")
    try:
        pointer = json.loads(latest.read_text())
        step_dir = root / pointer["dir"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint pointer {latest}: unreadable") from None
    marker = step_dir / "driver.json"
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {step_dir}: driver.json missing (partial checkpoint)")
    try:
        info = json.loads(marker.read_text())
        digests = info["sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {step_dir}: driver.json unreadable") from None
    for rel, digest in digests.items():
        path = step_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {step_dir}: {rel} missing (partial checkpoint)")
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint {step_dir}: {rel} sha256 mismatch (corrupt)")
    for sub in ("trainer", "rollout", *(rel.split("/")[0] for rel in digests if rel.startswith("rollout-v"))):
        _verify_dir(step_dir / sub)
    try:
        driver = pickle.loads((step_dir / "driver.pkl").read_bytes())
    except Exception as exc:  # noqa: BLE001 - any unpickling problem is a bad checkpoint
        raise CheckpointError(f"checkpoint {step_dir}: driver.pkl unreadable ({type(exc).__name__})") from None
    if driver.get("format") != FORMAT or driver.get("boundary") != info.get("step"):
        raise CheckpointError(f"checkpoint {step_dir}: driver state does not match driver.json")
    return ResumePoint(run_dir=run_dir, step_dir=step_dir, boundary=int(driver["boundary"]),
                       rollout_version=int(driver["rollout_version"]), driver=driver)


def _saved_checkpoint_dir(run_dir: Path) -> str | None:
    """`checkpoint.dir` of the run in `run_dir` (its saved config.json), or None."""
    try:
        return (json.loads((run_dir / "config.json").read_text()).get("checkpoint") or {}).get("dir")
    except (OSError, ValueError, AttributeError):
        return None


def end_partial_line(path: Path) -> None:
    """A run that died mid-write may leave a last line without its newline: end it, so the
    records appended next start on a line of their own (the cut line stays, unparseable)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")


def resume_records(run: Any, point: ResumePoint) -> None:
    """Append the `resume` record; every sample the run consumed after the checkpoint (a run that
    went on, then crashed) is rolled back: a `sample` record says so (the last record of a
    sample id is its state)."""
    offset = int(point.driver["records_offset"])
    path = run.rec.path
    tail = path.read_bytes()[offset:] if path.is_file() else b""
    rolled_back = []
    for line in tail.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if rec.get("kind") == "sample" and rec.get("consumed_step") is not None:
            rolled_back.append(rec)
    why = f"rolled back: the run resumed from the checkpoint of step {point.boundary}"
    for rec in rolled_back:
        fields = {k: v for k, v in rec.items() if k != "kind"}
        run.rec.emit("sample", **{**fields, "consumed_step": None, "dropped": why})
    run.rec.emit("resume", step=point.boundary, checkpoint=str(point.step_dir), num_devices=run.cfg.cluster.devices,
                 rollout_devices=run.assignment.num_rollout, records_offset=offset, rolled_back_samples=len(rolled_back))
