"""Pacing: device workers that take as long as an emulated accelerator would (emulate/model.py).

Worker side (`PacedMixin`, mixed into `DeviceWorker`): `paced(start, emulated_s, method, *args)`
runs `method` (the real work), then sleeps until `start + emulated_s / time_scale`, where
`start` is when the driver dispatched the call. So every device of a stage (the trainers of one
step, the participants of a sync) ends at the same time however late each began (on a loaded
host a worker may start seconds after the others), as on the emulated hardware. The result's
`t1` becomes the paced end, so spans and op records show the emulated duration; the result also
says `paced_from` (= start), `paced_s` (the wall seconds it was paced to), `real_s` (from the
dispatch to the end of the real work) and `overrun` (True when that took longer than the paced
time). Background resize ops are not slept out on the worker (it has one issuing thread, which
must go on): the driver stamps their result with the paced end instead (`DriverPacing.stamp`).

Overruns: a rollout or training call whose real work overran its paced time makes its step
`overrun`: that stage took the machine's time, not the model's (the excess counts 1:1 on the
run's clock, emulate/clock.py). Weight syncs and resize ops are short in the model (0.05-1.3 s
for a 7B on an H100) and have a latency floor here (Ray calls, gloo on CPU) that no smaller
model removes: what they take beyond their paced time is the step's overhead, not an overrun.

Driver side (`DriverPacing`, one per `Cluster`): which calls are paced and to what (from the
run's `emulate.model.Emulator`); the rollout router's work split (`rollout_chunks`: the simulator's
replicas, each replica's share sent at once as one continuous batch, paced or not; streaming:
the simulator's shares, cut at an engine's slots, `engine_slots`); driver-side pacing of a
resize's critical ops (`after_op`); the run's clock, on which every paced interval is put
(emulate.clock.EmulatedClock); and the real and paced times of the stage calls, which the runtime
takes per step (`overrun`, `real_fraction`). Without `cluster.emulate` nothing is paced: every
helper hands the call through unchanged.

16 emulated devices run on 2 cores because a paced worker sleeps most of its time: the real
work (a few real tokens per sample) must stay well under the paced time, which `overrun` checks.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


from dynaresize.emulate.clock import EmulatedClock
from dynaresize.emulate.model import Emulator, time_scale_of
from dynaresize.pipeline.dispatch import replica_shares, stream_shares


def pace(result: Any, start: float, emulated_s: float, time_scale: float, *,
         clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> Any:
    """Sleep until `start + emulated_s / time_scale`; annotate a dict `result` (see the module)."""
    target = start + max(float(emulated_s), 0.0) / time_scale
    now = clock()
    if now < target:
        sleep(target - now)
    if isinstance(result, dict):
        result = dict(result)
        result["t1"] = max(float(result.get("t1", now)), target)
        result.update(paced_from=start, paced_s=target - start, real_s=now - start, overrun=now > target)
    return result


class PacedMixin:
    """`DeviceWorker` methods that pace another method (attributes: `cfg`)."""

    def paced(self, start: float, emulated_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
        return pace(getattr(self, method)(*args, **kwargs), start, emulated_s, time_scale_of(self.cfg.cluster))


class PacedRequests(list):
    """The requests one rollout device serves at once, and its emulated busy seconds; for the
    streaming router also when its body ends (all but its longest request delivered, `body_s`)
    and which request is the longest (`longest`, a sample id)."""

    def __init__(self, requests, pace_s: float, body_s: float | None = None, longest: Any = None) -> None:
        super().__init__(requests)
        self.pace_s = float(pace_s)
        self.body_s = float(pace_s if body_s is None else body_s)
        self.longest = None if longest is None else tuple(longest)


class DriverPacing:
    """The driver's side of pacing (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.emulator: Emulator | None = Emulator.from_config(cfg)
        self.samples_per_prompt = int(cfg.rollout.samples_per_prompt)
        self.max_num_seqs = int(cfg.rollout.vllm_max_num_seqs)
        self.time_scale = time_scale_of(cfg.cluster)
        self.clock = EmulatedClock(self.time_scale)  # paced work counts time_scale x (emulate/clock.py)
        self._lock = threading.Lock()
        self._stage_calls: list[tuple[float, float]] = []  # (real_s, paced_s) of rollout and training calls

    @property
    def on(self) -> bool:
        return self.emulator is not None

    def call(self, worker: Any, method: str, *args: Any, pace_s: float | None = None, **kwargs: Any) -> Any:
        """`worker.method.remote(*args, **kwargs)`, paced to `pace_s` emulated seconds from now when emulating."""
        if self.emulator is None or pace_s is None:
            return getattr(worker, method).remote(*args, **kwargs)
        return worker.paced.remote(time.time(), pace_s, method, *args, **kwargs)

    def stamp(self, result: Any, start: float, pace_s: float | None) -> Any:
        """A background op's result as if paced to `pace_s` emulated seconds from `start`
        (emulating), without sleeping: its `t1` becomes the paced end when that is later."""
        if self.emulator is None or pace_s is None or not isinstance(result, dict):
            return result
        end = float(result.get("t1", start))
        return pace(result, start, pace_s, self.time_scale, clock=lambda: end, sleep=lambda _s: None)

    # ------------------------------------------------------------------ stages

    def rollout_chunks(self, step: int, groups: list[list[Any]], num_devices: int, *,
                       stream: bool = False) -> list[list[Any]]:
        """The router's queue. One-step-off: one item per rollout replica, its share of the
        step's requests sent at once (`pipeline.dispatch.replica_shares`, the simulator's split),
        paced to the replica's modelled time when emulating: the same items either way. With
        `stream`: the streaming pipeline's shares of consecutive samples, at most an engine's
        slots each (`_stream_chunks`), paced when emulating: again the same items either way.
        Evaluation (step < 0) keeps its groups; requests not in `groups` are left out."""
        if num_devices < 1 or step < 0:
            return list(groups)
        if stream:
            return self._stream_chunks(step, groups, num_devices)
        flat = [r for g in groups for r in g]
        shares = replica_shares([r.sample_id for r in flat], num_devices, self.samples_per_prompt)
        if self.emulator is None:
            return [[flat[i] for i in share] for share in shares]
        index, present = self.emulator.sample_index, {self.emulator.sample_index(r.sample_id) for r in flat}
        paced = {tuple(i for i in positions if i in present): pace_s
                 for positions, pace_s in self.emulator.rollout_plan(step, num_devices)}
        chunks = []
        for share in shares:
            mine = [flat[i] for i in share]
            key = tuple(index(r.sample_id) for r in mine)
            if key not in paced:  # the split is the simulator's by construction: say so if not
                raise RuntimeError(f"step {step}: a replica's share {key[:8]}... is not the emulator's")
            chunks.append(self._paced(mine, paced[key]))
        return chunks

    def _stream_chunks(self, step: int, groups: list[list[Any]], num_devices: int) -> list[list[Any]]:
        """The streaming items: `pipeline.dispatch.stream_shares` of the requests given over the
        replicas, cut at a replica's slots, the same on the unpaced and the emulated runtime.
        Emulated, each is paced as the simulator times that share on one replica from its first
        token (`Emulator.moved_share`; for a whole step's share `StageModel.chunk`), and a share
        of an emulated TP replica (`tp` TP1 devices standing in for it) is split over its
        devices, every part paced to the share's time, as `Emulator.stream_plan` splits it."""
        flat = [r for g in groups for r in g]
        tp = 1 if self.emulator is None else self.emulator.model.rollout_tp
        slots = self.max_num_seqs if self.emulator is None else int(self.emulator.stages.slots(step))
        shares = [[flat[i] for i in share] for share in
                  stream_shares([r.sample_id for r in flat], max(1, num_devices // tp), self.samples_per_prompt, slots)]
        if self.emulator is None:
            return shares
        index = self.emulator.sample_index
        return [self._paced(mine[part::tp], *self.emulator.moved_share(step, [index(r.sample_id) for r in mine]))
                for mine in shares for part in range(tp) if mine[part::tp]]

    def engine_slots(self, step: int) -> int:
        """Requests one rollout engine holds at once, the streaming router's admission limit:
        `rollout.vllm_max_num_seqs` (an engine's scheduler admits beyond its KV as blocks free),
        emulated the emulated replica's (`StageModel.slots`: max_num_seqs and KV for the step's
        lengths) over its `tp` devices."""
        if self.emulator is None or step < 0:
            return self.max_num_seqs
        return max(1, int(self.emulator.stages.slots(step)) // self.emulator.model.rollout_tp)

    def _paced(self, mine: list[Any], pace_s: float, body_s: float | None = None,
               longest: int | None = None) -> PacedRequests:
        index = self.emulator.sample_index
        top = next((r.sample_id for r in mine if index(r.sample_id) == longest), None)
        return PacedRequests(mine, pace_s, body_s if top is not None else pace_s, top)

    def moved_item(self, step: int, requests: list[Any], original: Any, *, ran_s: float | None = None) -> list[Any]:
        """Requests moved off a leaving engine, as a new item of `step`: emulated, paced to
        their time on one replica (`Emulator.moved_share`), from their first token, or with
        `ran_s` (partial rollout: wall seconds the original item had run) from the prefix
        they had made by then."""
        if self.emulator is None or not isinstance(original, PacedRequests):
            return list(requests)
        index = self.emulator.sample_index
        extra = {} if ran_s is None else {"share": [index(r.sample_id) for r in original],
                                          "elapsed_s": ran_s * self.time_scale}
        return self._paced(requests, *self.emulator.moved_share(step, [index(r.sample_id) for r in requests], **extra))

    def request_due(self, requests: Any, start: float) -> dict:
        """Emulated: sample id -> wall time its result is due for an item started at `start`
        (its longest request at the item's paced end, the others when its body ends); {}
        when the item is not paced (results are delivered as they come)."""
        if self.emulator is None or not isinstance(requests, PacedRequests):
            return {}
        body, end = start + self.wall_s(requests.body_s), start + self.wall_s(requests.pace_s)
        return {tuple(r.sample_id): end if tuple(r.sample_id) == requests.longest else body for r in requests}

    def wall_s(self, emulated_s: float | None) -> float:
        """Wall seconds a paced interval of `emulated_s` takes (0 when not emulating)."""
        return 0.0 if self.emulator is None or emulated_s is None else float(emulated_s) / self.time_scale

    def train_s(self, step: int, num_train: int) -> float | None:
        return self.emulator.train_s(step, num_train) if self.emulator is not None else None

    def train_part_s(self, step: int, samples: list[Any], num_train: int, *, last: bool) -> float | None:
        """A part of a streaming step's training: these samples' share of its compute, and on
        the last part the fixed exposed time (the parts of a step add up to `train_s`)."""
        if self.emulator is None:
            return None
        index = self.emulator.sample_index
        return self.emulator.train_part_s(step, [index(s.sample_id) for s in samples], num_train, last=last)

    def sync_s(self) -> float | None:
        return self.emulator.sync_s if self.emulator is not None else None

    # ------------------------------------------------------------------ resize ops

    def op_s(self, name: str, plan: Any) -> float | None:
        if self.emulator is None:
            return None
        return self.emulator.op_s(name, num_train_before=plan.src.num_train, num_train_after=plan.dst.num_train,
                                  num_moving=len(plan.moving))

    def after_op(self, name: str, start: float, out: Any, plan: Any, first_entry: int) -> None:
        """A critical op ran from `start` on the driver (its entries from `out.ops[first_entry:]`):
        wait until its emulated end, which becomes its entries' end and the critical path's."""
        pace_s = self.op_s(name, plan)
        if pace_s is None:
            return
        entries = out.ops[first_entry:]
        done = pace({"t1": time.time()}, start, pace_s, self.time_scale)
        for e in entries:
            e.update(t1=done["t1"], paced_s=done["paced_s"])
        out.critical_end = max(out.critical_end, done["t1"])
        self.clock.add(start, start + done["paced_s"])

    # ------------------------------------------------------------------ overruns

    def note(self, result: Any, stage: bool = True) -> None:
        """A paced call's result (any thread): its paced interval goes on the clock; a stage
        call's real and paced seconds are kept until the runtime takes them."""
        if not isinstance(result, dict) or "paced_s" not in result:
            return
        self.clock.add(result["paced_from"], result["paced_from"] + result["paced_s"])
        if stage:
            with self._lock:
                self._stage_calls.append((float(result["real_s"]), float(result["paced_s"])))

    def take_stage_calls(self) -> list[tuple[float, float]]:
        """(real_s, paced_s) of the rollout and training calls since the last take."""
        with self._lock:
            out, self._stage_calls = self._stage_calls, []
        return out
