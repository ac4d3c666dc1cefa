"""Recovery from lost devices without a restart, and the clean stop when there is none.

`Recovery.recover(window, lost)` (docs/faults.md has the why of each step):
1. settle the survivors (no one may still run anything of the old world; a survivor still
   busy past the groups' timeout is wedged and counts as lost, with that reason);
2. kill the lost workers (`ray.kill`), record a `fault` record per lost device, attributing
   injected faults;
3. the controller rebuilds the assignment on the survivors within the bounds
   (`on_devices_lost`); if no legal split is left, `stop_run` ends the run cleanly;
4. the survivors join a new world generation (fresh port and store), their pools cleared,
   and the groups of the new split are made;
5. trainer state comes back from the latest full snapshot (taken every K steps), and the steps
   trained since are replayed from their kept scored samples (driver/snapshots.py), up to the
   state after the last step whose samples the ledger counts as consumed; a full snapshot of
   that state is taken (the new base); every rollout device gets the weights of the version its
   next samples need; the window then redoes only what is not done, re-issuing unfinished
   samples with their ids and seeds;
6. a `recovery` record says what was lost and how long it took (from detection to restored),
   and which Ray nodes the run no longer has a device on (`lost_nodes`: a whole node lost).

A lost node loses the object store in which its trainers' snapshot shards live; each shard has
a replica on another node (cluster/snapshot.py), so step 5 is the same after a node loss.

`stop_run(run, window, reason)`: drop (with the reason) every sample generated but not
consumed, write a checkpoint of the last consistent point (the latest full snapshot: steps
trained after it cannot be replayed without trainers, so their samples count as not consumed
and are dropped too), write the summary, raise RunStopped.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from dynaresize.cluster import regroup, snapshot
from dynaresize.cluster.watchdog import DevicesLost
from dynaresize.driver.ledger import sample_record, token_sha1
from dynaresize.errors import DynaresizeError, ResizeRefused
from dynaresize.pipeline.stepstate import Window, rollout_version
from dynaresize.rl.seeds import sample_seed

MAX_ATTEMPTS = 3  # a further loss during recovery starts it again on the fewer survivors


class RunStopped(DynaresizeError):
    """The run stopped cleanly before its last step (a consistent checkpoint was written). Exit 1."""

    exit_code = 1


class Recovery:
    def __init__(self, run: Any) -> None:
        self.run = run

    def recover(self, w: Window, exc: DevicesLost) -> None:
        run, cluster = self.run, self.run.cluster
        t_start = time.time()
        lost = {**cluster.watchdog.lost, **exc.lost}
        t_detect = min([cluster.watchdog.lost_at.get(r, t_start) for r in lost] or [t_start])
        where = exc.where
        lost_ids: list[int] = []
        wedged_ids: list[int] = []
        down: set[str] = set()  # Ray nodes found dead: their devices are lost, their object stores gone
        for attempt in range(MAX_ATTEMPTS):
            down |= _with_node_down(cluster, lost)
            survivors = [r for r in range(cluster.num_devices) if r not in lost]
            wedged = regroup.settle(cluster, survivors)
            wedged_ids += [cluster.ids[r] for r in wedged]
            lost.update(wedged)
            survivors = [r for r in survivors if r not in wedged]
            regroup.kill(cluster, sorted(lost))
            run.snapshots.after_loss(down)  # ranks of this generation still: before the survivors re-form
            self._fault_records(w.step, lost, where)
            lost_ids += [cluster.ids[r] for r in sorted(lost)]
            try:
                assignment = run.controller.on_devices_lost(tuple(sorted(lost)))
            except ResizeRefused as why:
                stop_run(run, w, f"cannot recover from the loss of devices {sorted(lost_ids)}: {why}")
            t_world = time.time()
            try:
                regroup.new_generation(cluster, survivors, assignment)
                run.assignment = assignment
                t_restore = time.time()
                rehomed = snapshot.rehome(cluster, dict(run.snapshots.items()), down)
                t_rehomed = time.time()
                train = run.snapshots[run.snapshots.latest_full()]
                target = w.step + 1 if w.trained is not None else w.step  # the version the window stands at
                snapshot.restore(cluster, train)
                t_replay = time.time()
                replayed = self._replay(train.version, target, w.step)
                t_replayed = time.time()
                rv = self._engine_version(w, target)
                snapshot.load_rollout(cluster, run.snapshots[rv], fresh=True)
                run.engine_version = rv
                break
            except DevicesLost as again:  # ranks of the new generation
                lost, where = dict(again.lost), f"recovery ({again.where})"
        else:
            stop_run(run, w, f"devices kept failing during recovery: lost {sorted(lost_ids)}")
        run.pending, run.last_critical_s = None, None
        w.after_recovery()
        recovered = [a for a in cluster.faults.faults if a.attributed and not a.recovered]
        for a in recovered:
            a.recovered = True
        run.stats["faults_recovered"] += len(recovered)
        t_end = time.time()
        rec = run.rec.emit("recovery", step=w.step, lost_devices=sorted(lost_ids), recovery_s=t_end - t_detect,
                           num_devices=cluster.num_devices, wedged_devices=sorted(wedged_ids),
                           detect_to_start_s=t_start - t_detect, settle_s=t_world - t_start,
                           world_s=t_restore - t_world, restore_s=t_end - t_restore, generation=cluster.generation,
                           rollout_version=rv, where=where,
                           lost_nodes=_lost_nodes(cluster, lost_ids), rehomed_shards=rehomed,
                           rehome_s=t_rehomed - t_restore, restored_version=train.version, trainer_version=target,
                           replayed_steps=replayed, replay_s=t_replayed - t_replay,
                           assignment={"rollout": [cluster.ids[r] for r in assignment.devices("rollout")],
                                       "train": [cluster.ids[r] for r in assignment.devices("train")]})
        run.stats["recoveries"].append({k: rec[k] for k in ("step", "lost_devices", "recovery_s", "num_devices")})

    def _replay(self, base: int, target: int, step: int) -> list[int]:
        """Train the steps base .. target-1 again on the restored trainers, from their kept scored
        samples, in order (deterministic mode: the state they reach equals the lost one); a weight
        version the window still needs whose parameters snapshot the loss broke is taken again on
        the way; then a full snapshot of `target`: the new base. Returns the steps replayed."""
        from dynaresize.rl import grpo

        run, snaps = self.run, self.run.snapshots
        trainers = run.assignment.devices("train")
        keep = run.stream.keep_from(step) if run.stream else step - 1
        done = []
        for s in range(base, target):
            if s >= keep and s not in snaps:
                snaps.params_now(s, trainers)
            scored = snaps.replay[s]
            mbs = grpo.micro_batches(scored.samples, run.cfg.train.micro_batch_size)
            total = grpo.total_response_tokens(scored.samples)
            if run.stream:  # as streaming trains (the loss scaled once the step's tokens are known), in one part
                stats = run.cluster.train_part(s, list(enumerate(mbs)), begin=True, num_micro_batches=len(mbs),
                                               total_tokens=total)
            else:
                stats = run.cluster.train(s, mbs, total)
            for st in stats:
                run.rec.emit("span", device=st["device"], name="train:replay", start_s=run.rel(st["t0"]),
                             end_s=run.rel(st["t1"]), step=s, cat="train")
            done.append(s)
        if done:
            snaps.recovered(target, trainers)
        return done

    def _engine_version(self, w: Window, latest: int) -> int:
        """The version the rollout devices need: that of the next rollout still to finish."""
        cfg = self.run.cfg
        s = w.step if w.scored is None else w.step + 1
        return min(rollout_version(s, cfg.train.staleness), latest)

    def _fault_records(self, step: int, lost: dict[int, str], where: str) -> None:
        run, cluster = self.run, self.run.cluster
        for r, why in sorted(lost.items()):
            dev = cluster.ids[r]
            armed = cluster.faults.attribute(dev)
            at = cluster.watchdog.lost_at.get(r)
            fired = armed.fired_t if armed else None
            run.rec.emit("fault", step=step, device=dev, fault_kind=armed.spec.kind if armed else "lost",
                         point=armed.spec.point if armed else where, injected=armed is not None,
                         fault_step=armed.spec.step if armed else None, reason=why,
                         detect_s=(at - fired) if at and fired else None,
                         node=cluster.nodes[dev] if getattr(cluster, "nodes", None) else None)


def _with_node_down(cluster: Any, lost: dict[int, str]) -> set[str]:
    """Add to `lost` every device on the node of a lost device whose raylet is gone (a lost node:
    its other workers may still answer for a moment, but they cannot last); the dead nodes."""
    from dynaresize.cluster.placement import nodes_down

    if not getattr(cluster, "nodes", None) or not lost:
        return set()
    down = nodes_down(cluster.node_addresses, {cluster.node_of(r) for r in lost})
    now = time.time()
    for r in range(cluster.num_devices):
        if r not in lost and cluster.node_of(r) in down:
            lost[r] = f"its node {cluster.node_of(r)[:8]} is down (raylet gone)"
            cluster.watchdog.lost_at.setdefault(r, now)
    return down


def _lost_nodes(cluster: Any, lost_ids: list[int]) -> list[str]:
    """The Ray nodes the run no longer has a device on: nodes of lost devices that no survivor shares."""
    if not getattr(cluster, "nodes", None):
        return []
    kept = {cluster.nodes[d] for d in cluster.ids}
    return sorted({cluster.nodes[d] for d in lost_ids} - kept)


def stop_run(run: Any, w: Window, reason: str, *, trainers: tuple[int, ...] = ()) -> NoReturn:
    """End the run at its last consistent point: checkpoint, dropped samples, summary; raise.
    `trainers`: the training devices when none was lost (a stop for another reason): their
    state now becomes a full snapshot, so no trained step is given up."""
    try:
        run.snapshots.after_loss(set())  # a full snapshot done but not yet collected counts
        latest = max(run.snapshots, default=None)
        if trainers and latest is not None and run.snapshots[latest].others is None:
            run.snapshots.recovered(latest, trainers, cause="stop")
    except Exception:  # noqa: BLE001 - a further loss: what was collected stands
        pass
    boundary = run.snapshots.latest_full()
    why = f"run stopped at step {boundary}: {reason}"
    for e in run.ledger.entries.values():  # trained after the last full snapshot: no trainer left to replay them
        if e.consumed_step is not None and e.consumed_step >= boundary:
            e.consumed_step, e.times_consumed = None, e.times_consumed - 1
    dropped = run.ledger.stop_at(boundary, why)
    for step, buf in sorted(run.rollouts.items()):  # generated ahead, never scored
        for device, res in buf.results:
            if step >= boundary and res.sample_id not in run.ledger.entries:
                run.ledger.generated(sample_id=res.sample_id, version=res.version, device=device,
                                     num_tokens=len(res.response_ids), token_sha1=token_sha1(res.response_ids),
                                     seed=sample_seed(run.cfg.seed, *res.sample_id), versions=res.versions,
                                     turns=getattr(res, "turns", 0), stop_reason=getattr(res, "stop_reason", ""))
                run.ledger.dropped(res.sample_id, why)
                dropped.append(run.ledger.entries[res.sample_id])
    for entry in sorted(dropped, key=lambda e: e.sample_id):
        run.rec.emit("sample", **sample_record(entry))
    run.pending = None  # its background ops may involve lost devices: the checkpoint needs none
    path = run.ckpt.save(boundary, "stop", finish_pending=False, live=bool(trainers))  # alive: they write it
    run._finish(stopped=why)
    raise RunStopped(f"{why} (consistent checkpoint of step {boundary} in {path}; "
                     f"continue with `dynaresize run --resume {run.out}`)")
