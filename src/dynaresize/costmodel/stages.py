"""Stage-time models: the rollout of one batch on R devices and its training on n devices.

Rollout (continuous batching per replica, docs/references.md 7.3): samples are routed round-robin in
sample order to the R / tp replicas. A replica admits up to C requests at once, where C is the
vLLM sequence cap or what its KV memory holds at the batch's mean footprint (prompt + half the
response); later requests wait for a free slot (FIFO; each wave is placed on the earliest-free
slots). A replica's time is

    decode_steps * t_weights  +  sum over its samples of (t_kv * context reads + t_flop * L + t_prefill * P)

where decode_steps is its slot makespan in tokens (the longest response when there is one
wave). So a replica with one 16k-token response runs >= 16k weight-read steps however few
other requests it has: the tail floor that more devices do not shorten. Devices of replicas
that finished early are tail idle until the last replica ends.

Training: compute device-seconds / n + a fixed exposed time (`costs.train_device_s`).

Dynamic sampling (a batch with `gen_batch` and `trained`, workload.batch_for_step): the step's
generation batches roll out one after another (each is scored before the next is sent), so its
rollout time, work and tail idle are the sums over its batches; training counts the trained
samples (the kept groups) only.

Vectorised numpy, cached per (batch, split). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dynaresize.costmodel.costs import Hardware, ModelPreset, rollout_constants, sync_s, train_device_s
from dynaresize.workload.trace import Batch  # noqa: F401  (re-exported: sim callers build batches)


@dataclass(frozen=True, kw_only=True)
class RolloutTime:
    time_s: float  # first request to last response
    work_device_s: float  # busy device-seconds of the pool
    tail_idle_device_s: float  # devices whose replica is done, waiting for the last one
    longest_s: float  # duration of the longest request (its replica's time)
    floor_s: float  # the longest response decoded alone: no device count goes below it
    num_replicas: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkTime:
    """A contiguous range of a batch's samples run together on one replica (the streaming
    pipeline's unit of dispatch)."""

    time_s: float  # first request to last response
    serial_s: float  # its decode steps x t_weights (a bigger chunk has a longer longest response)
    body_s: float  # until only its longest request is left (partial rollout frees the replica then)
    longest_tokens: int


@dataclass(frozen=True, kw_only=True)
class TrainTime:
    time_s: float
    fixed_s: float  # the part that does not shrink with more devices


class _BatchData:
    """Per-batch arrays reused for every split."""

    def __init__(self, batch: Batch, c) -> None:
        self.batch = batch
        L = batch.response_tokens.astype(np.float64)
        P = batch.prompt_tokens.astype(np.float64)
        self.work = c.t_kv * (P * L + L * (L + 1.0) / 2.0) + c.t_flop * L + c.t_prefill * P
        # Slot steps: a multi-turn trajectory holds its slot (and KV) through its tool waits, as if
        # it decoded wait_s / t_weights more tokens, with no work (workload.batch_for_step).
        self.L = L if batch.wait_s is None else L + np.asarray(batch.wait_s, dtype=np.float64) / c.t_weights
        footprint = float(P.mean() + L.mean() / 2.0) if L.size else 1.0
        self.slots = int(max(1, min(c.max_num_seqs, math.floor(c.kv_capacity_tokens / max(footprint, 1.0)))))
        i = int(np.argmax(self.L)) if L.size else 0
        self.longest_index = i
        self.floor_s = float(self.L[i] * c.t_weights + self.work[i]) if L.size else 0.0
        self.work_cum = np.concatenate([[0.0], np.cumsum(self.work)])
        seq = P + L
        if batch.trained is not None:  # dynamic sampling: the filtered groups are not trained
            seq = np.where(batch.trained, seq, 0.0)
        self.parts = None  # dynamic sampling: one _BatchData per generation batch, in order
        if batch.num_gen_batches > 1:
            g = batch.gen_batch
            self.parts = [_BatchData(Batch(batch.response_tokens[g == i], batch.prompt_tokens[g == i],
                                           None if batch.wait_s is None else batch.wait_s[g == i]), c)
                          for i in range(batch.num_gen_batches)]
            self.floor_s = sum(p.floor_s for p in self.parts)
        self.seq_sum = float(seq.sum())
        self.seq_sq_sum = float((seq * seq).sum())
        self.seq_cum = np.concatenate([[0.0], np.cumsum(seq)])
        self.seq_sq_cum = np.concatenate([[0.0], np.cumsum(seq * seq)])


class StageModel:
    """Stage times for (batch index, device count), computed lazily and cached."""

    def __init__(self, model: ModelPreset, batch_of: Callable[[int], Batch], hw: Hardware = Hardware(),
                 batch_cache: int = 4) -> None:
        self.model = model
        self.hw = hw
        self.c = rollout_constants(model, hw)
        self.tp = model.rollout_tp
        self.sync_s = sync_s(model)
        self._batch_of = batch_of
        self._data: OrderedDict[int, _BatchData] = OrderedDict()
        self._batch_cache = batch_cache
        self._rollout: dict[tuple[int, int], RolloutTime] = {}
        self._chunk_tables: dict[tuple[int, int], tuple | None] = {}
        self._train: dict[tuple[int, int], TrainTime] = {}
        self._train_dev_s: dict[int, float] = {}

    def data(self, b: int) -> _BatchData:
        d = self._data.get(b)
        if d is None:
            d = _BatchData(self._batch_of(b), self.c)
            self._data[b] = d
            while len(self._data) > self._batch_cache:
                self._data.popitem(last=False)
        else:
            self._data.move_to_end(b)
        return d

    def batch(self, b: int) -> Batch:
        return self.data(b).batch

    def replica_times(self, b: int, num_rollout: int) -> tuple[np.ndarray, int]:
        """Per-replica finish times (s) and the index of the replica with the longest request."""
        times, _, longest = self.replica_detail(b, num_rollout)
        return times, longest

    def replica_detail(self, b: int, num_rollout: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Per-replica finish times, per-replica decode steps (s of weight reads: the part no
        other replica can take over), and the index of the replica with the longest request."""
        d = self.data(b)
        if d.parts is not None:  # generation batches one after another: each starts when the last ends
            out, start = None, 0.0
            for part in d.parts:
                times, serial, longest = self._replica_detail(part, num_rollout)
                out = (times + start, serial, longest)
                start += float(times.max())
            return out
        return self._replica_detail(d, num_rollout)

    def _replica_detail(self, d: "_BatchData", num_rollout: int) -> tuple[np.ndarray, np.ndarray, int]:
        n_rep = max(1, num_rollout // self.tp)
        n = d.L.size
        n_per = -(-n // n_rep)
        pad = n_per * n_rep - n
        Lm = np.concatenate([d.L, np.zeros(pad)]).reshape(n_per, n_rep)
        Wm = np.concatenate([d.work, np.zeros(pad)]).reshape(n_per, n_rep)
        if n_per <= d.slots:
            steps = Lm.max(axis=0)
        else:
            ends = np.zeros((n_rep, d.slots))
            for w in range(0, n_per, d.slots):
                chunk = Lm[w:w + d.slots].T
                ends.sort(axis=1)
                ends[:, :chunk.shape[1]] += chunk
            steps = ends.max(axis=1)
        serial = steps * self.c.t_weights
        return serial + Wm.sum(axis=0), serial, d.longest_index % n_rep

    def slots(self, b: int) -> int:
        """Requests one replica admits at once for batch `b` (sequence cap or KV memory)."""
        return self.data(b).slots

    def chunk(self, b: int, lo: int, hi: int) -> ChunkTime:
        """Samples lo..hi-1 of batch `b` on one replica, admitted together (continuous batching:
        later waves fill the earliest-free slots when there are more than `slots`)."""
        m = hi - lo
        if m > 0 and lo % m == 0:
            tab = self._chunk_table(b, m)
            if tab is not None and lo // m < tab[0].size and (hi == tab[4] or (lo // m) < tab[0].size - 1):
                i = lo // m
                return ChunkTime(time_s=float(tab[0][i]), serial_s=float(tab[1][i]), body_s=float(tab[2][i]),
                                 longest_tokens=int(tab[3][i]))
        return self._chunk(b, lo, hi)

    def _chunk_table(self, b: int, m: int):
        """Every chunk [i*m, (i+1)*m) of batch `b` at once (vectorised; the last may be shorter),
        when m fits the slots; cached. (time, serial, body, longest, num_samples) arrays."""
        key = (b, m)
        hit = self._chunk_tables.get(key)
        if hit is not None or key in self._chunk_tables:
            return hit
        d = self.data(b)
        n = d.L.size
        if m > d.slots or n == 0:
            self._chunk_tables[key] = None
            return None
        rows = -(-n // m)
        pad = rows * m - n
        Lm = np.concatenate([d.L, np.zeros(pad)]).reshape(rows, m)
        Wm = np.concatenate([d.work, np.zeros(pad)]).reshape(rows, m)
        top = np.argmax(Lm, axis=1)
        idx = np.arange(rows)
        l_max = Lm[idx, top]
        w_max = Wm[idx, top]
        l_2 = np.partition(Lm, m - 2, axis=1)[:, m - 2] if m >= 2 else np.zeros(rows)
        serial = l_max * self.c.t_weights
        time_s = serial + Wm.sum(axis=1)
        tail_steps = l_max - l_2
        frac = np.where(l_max > 0, tail_steps / np.maximum(l_max, 1.0), 0.0)
        body = np.maximum(time_s - tail_steps * self.c.t_weights - w_max * frac, 0.0)
        tab = (time_s, serial, body, l_max.astype(np.int64), n)
        if len(self._chunk_tables) > 4 * self._batch_cache + 64:
            self._chunk_tables.clear()
        self._chunk_tables[key] = tab
        return tab

    def _chunk(self, b: int, lo: int, hi: int) -> ChunkTime:
        d = self.data(b)
        return self._chunk_of(d.L[lo:hi], d.work[lo:hi], float(d.work_cum[hi] - d.work_cum[lo]), d.slots)

    def _chunk_of(self, L: np.ndarray, work: np.ndarray, work_sum: float, slots: int) -> ChunkTime:
        """The chunk time of requests with `L` tokens left to decode and `work` per-request work."""
        m = int(L.size)
        if m == 0:
            return ChunkTime(time_s=0.0, serial_s=0.0, body_s=0.0, longest_tokens=0)
        top = int(np.argmax(L))
        l_max = float(L[top])
        if m <= slots:
            steps = l_max
        else:
            ends = np.zeros(slots)
            for w in range(0, m, slots):
                chunk = L[w:w + slots]
                ends.sort()
                ends[:chunk.size] += chunk
            steps = float(ends.max())
        serial = steps * self.c.t_weights
        l_2 = float(np.partition(L, m - 2)[m - 2]) if m >= 2 else 0.0
        tail_steps = min(l_max - l_2, steps)
        tail = tail_steps * self.c.t_weights + float(work[top]) * (tail_steps / l_max if l_max > 0 else 0.0)
        return ChunkTime(time_s=serial + work_sum, serial_s=serial, body_s=max(serial + work_sum - tail, 0.0),
                         longest_tokens=int(l_max))

    # ---------------------------------------------------------------- arbitrary positions (migration)

    def chunk_at(self, b: int, positions, done_tokens=None) -> ChunkTime:
        """Samples `positions` (batch indices, any order, not necessarily consecutive) of batch `b`
        run together on one replica, admitted in the order given. `done_tokens[i]` (default 0) is
        how many tokens of `positions[i]` were already generated elsewhere (a migrated request
        resumed with its prefix): the replica re-prefills prompt + prefix and decodes only the
        rest, so that sample costs `t_prefill * (P + D) + t_kv * ((P + D) R + R (R + 1) / 2) +
        t_flop * R` plus R decode steps, R = L - D. Without a prefix a moved sample is decoded
        from scratch (its seed belongs to the sample, so it gives the same tokens). For
        consecutive positions lo..hi-1 and no prefix this is `chunk(b, lo, hi)`.
        `longest_tokens` is the longest remaining decode."""
        d = self.data(b)
        R, work = self._left(d, positions, done_tokens)
        return self._chunk_of(R, work, float(work.sum()), d.slots)

    def finish_offsets(self, b: int, positions, done_tokens=None) -> np.ndarray:
        """Seconds from the start of the chunk `chunk_at(b, positions, done_tokens)` to the last
        token of each of its samples. Decode steps go in lock-step: each costs `t_weights` plus
        what every request running in it costs (its prefill on its first step, then its KV reads
        and compute), and a request admitted in a later wave (more requests than slots) starts at
        the step its slot frees. The largest offset is the chunk's `time_s`."""
        R, C, start = self._steps_of(b, positions, done_tokens)
        return self._time_at_steps(start + R, R, C, start)

    def tokens_after(self, b: int, positions, elapsed_s: float, done_tokens=None) -> np.ndarray:
        """Tokens each sample of that chunk holds after `elapsed_s` seconds of its decoding
        (prefix included): the decode steps completed by then, under the same lock-step model
        as `finish_offsets`. What a migrated request keeps under partial rollout."""
        R, C, start = self._steps_of(b, positions, done_tokens)
        D = np.zeros(R.size) if done_tokens is None else np.asarray(done_tokens, dtype=np.float64)
        lo, hi = 0, int((start + R).max()) if R.size else 0
        while lo < hi:  # the largest step count whose time fits in elapsed_s (time grows with steps)
            mid = (lo + hi + 1) // 2
            if self._time_at_steps(np.array([float(mid)]), R, C, start)[0] <= elapsed_s:
                lo = mid
            else:
                hi = mid - 1
        return (D + np.clip(lo - start, 0.0, R)).astype(np.int64)

    def _left(self, d: _BatchData, positions, done_tokens) -> tuple[np.ndarray, np.ndarray]:
        """Tokens left to decode and the work of each position (`chunk_at`)."""
        pos = np.asarray(positions, dtype=np.int64)
        if done_tokens is None:
            return d.L[pos], d.work[pos]
        D = np.asarray(done_tokens, dtype=np.float64)
        R, C = d.L[pos] - D, d.batch.prompt_tokens[pos].astype(np.float64) + D
        c = self.c
        return R, c.t_kv * (C * R + R * (R + 1.0) / 2.0) + c.t_flop * R + c.t_prefill * C

    def _steps_of(self, b: int, positions, done_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens left R, context at admission C = P + D, first decode step) of each position:
        the first `slots` start at step 0, each later wave fills the earliest-free slots (`_chunk`)."""
        d = self.data(b)
        pos = np.asarray(positions, dtype=np.int64)
        D = np.zeros(pos.size) if done_tokens is None else np.asarray(done_tokens, dtype=np.float64)
        R = d.L[pos] - D
        C = d.batch.prompt_tokens[pos].astype(np.float64) + D
        start = np.zeros(pos.size)
        if pos.size > d.slots:
            ends = np.zeros(d.slots)
            for w in range(0, pos.size, d.slots):
                ends.sort()
                k = min(d.slots, pos.size - w)
                start[w:w + k] = ends[:k]
                ends[:k] += R[w:w + k]
        return R, C, start

    def _time_at_steps(self, s: np.ndarray, R: np.ndarray, C: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Seconds until each decode-step count in `s` is reached (`finish_offsets`)."""
        c = self.c
        x = np.clip(s[:, None] - start[None, :], 0.0, R[None, :])  # tokens each request has decoded
        w = c.t_kv * (C * x + x * (x + 1.0) / 2.0) + c.t_flop * x + c.t_prefill * C * (x > 0)
        return s * c.t_weights + w.sum(axis=1)

    def rollout(self, b: int, num_rollout: int) -> RolloutTime:
        key = (b, num_rollout)
        hit = self._rollout.get(key)
        if hit is not None:
            return hit
        d = self.data(b)
        if d.parts is not None:
            res = self._rollout_parts(d, num_rollout)
            self._rollout[key] = res
            return res
        times, longest_rep = self.replica_times(b, num_rollout)
        t = float(times.max())
        res = RolloutTime(
            time_s=t,
            work_device_s=float(times.sum()) * self.tp,
            tail_idle_device_s=float((t - times).sum()) * self.tp + (num_rollout % self.tp) * t,
            longest_s=float(times[longest_rep]),
            floor_s=self.data(b).floor_s,
            num_replicas=int(times.size),
        )
        self._rollout[key] = res
        return res

    def _rollout_parts(self, d: "_BatchData", num_rollout: int) -> RolloutTime:
        """The generation batches of a dynamic-sampling step, one after another: sums."""
        time_s = work = tail = longest = 0.0
        reps = 0
        for part in d.parts:
            times, _, longest_rep = self._replica_detail(part, num_rollout)
            t = float(times.max())
            time_s += t
            work += float(times.sum()) * self.tp
            tail += float((t - times).sum()) * self.tp + (num_rollout % self.tp) * t
            longest += float(times[longest_rep])
            reps = int(times.size)
        return RolloutTime(time_s=time_s, work_device_s=work, tail_idle_device_s=tail, longest_s=longest,
                           floor_s=d.floor_s, num_replicas=reps)

    def train_device_s(self, b: int) -> float:
        v = self._train_dev_s.get(b)
        if v is None:
            d = self.data(b)
            v = train_device_s(self.model, d.seq_sum, d.seq_sq_sum, self.hw)
            self._train_dev_s[b] = v
        return v

    def seq_tokens(self, b: int) -> int:
        """Sequence tokens (prompt + response) of batch `b`: what its training processes."""
        return int(self.data(b).seq_sum)

    def train_chunk_device_s(self, b: int, lo: int, hi: int) -> float:
        """Device-seconds of training compute for samples lo..hi-1 of batch `b` (the compute is
        a sum over sequences, so a step's chunks add up to `train_device_s(b)`)."""
        d = self.data(b)
        return train_device_s(self.model, float(d.seq_cum[hi] - d.seq_cum[lo]),
                              float(d.seq_sq_cum[hi] - d.seq_sq_cum[lo]), self.hw)

    def train_at_device_s(self, b: int, positions) -> float:
        """`train_chunk_device_s` for arbitrary sample positions of batch `b` (a migrated chunk)."""
        d = self.data(b)
        pos = np.asarray(positions, dtype=np.int64)
        seq = (d.batch.prompt_tokens[pos] + d.batch.response_tokens[pos]).astype(np.float64)  # tokens, not slot steps
        return train_device_s(self.model, float(seq.sum()), float((seq * seq).sum()), self.hw)

    def train(self, b: int, num_train: int) -> TrainTime:
        key = (b, num_train)
        hit = self._train.get(key)
        if hit is None:
            fixed = self.model.train_comm_s
            hit = TrainTime(time_s=self.train_device_s(b) / max(num_train, 1) + fixed, fixed_s=fixed)
            self._train[key] = hit
        return hit
