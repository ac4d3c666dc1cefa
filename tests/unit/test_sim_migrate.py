"""Migration on a rollout -> train move (issue 22 item 4): the streaming simulator hands the
moving replicas' unfinished samples to the remaining replicas instead of draining them; the
one-step-off simulator's boundary has none in flight; `StageModel.chunk_at` times an arbitrary
set of batch positions (with a prefix under partial rollout)."""

from dataclasses import replace

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.control.planner import MIGRATE_REQUESTS
from dynaresize.costmodel.costs import MIGRATE_S
from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.policy.baselines import Scripted
from dynaresize.records import Recorder
from dynaresize.sim.engine import run_policy
from dynaresize.sim.stream import StreamEngine

N, K = 16, 30
MODES = [(False, False, False), (False, True, True), (True, True, True)]  # (partial, accumulate, admit)


@pytest.fixture(scope="module")
def world():
    """The scenario of test_sim_stream.py (longtail-drift, 16 devices, 30 steps, seed 1), its
    stage model and bounds."""
    scenario = workload_scenario("longtail-drift", num_devices=N, num_steps=K, seed=1)
    return scenario, scenario.stages(batch_cache=K), scenario.bounds(PolicyConfig())


@pytest.fixture(scope="module")
def sc(world):
    return world[0]


@pytest.fixture(scope="module")
def stages(world):
    return world[1]


@pytest.fixture(scope="module")
def bounds(world):
    return world[2]


def _run(sc, stages, bounds, schedule, partial, accumulate, admit, migrate=True, engine=StreamEngine):
    rec = Recorder(None)
    eng = engine(sc, stages, Scripted(schedule), bounds, start_rollout=schedule[0][1], staleness=2,
                 partial=partial, accumulate=accumulate, admit=admit, reversal_window=4, recorder=rec,
                 migrate=migrate)
    return eng, eng.run(), rec


# ---------------------------------------------------------------------------- StageModel.chunk_at


@pytest.mark.parametrize("b,lo,hi", [(3, 0, 40), (3, 40, 80), (3, 500, 512), (7, 0, 1), (9, 128, 256), (5, 0, 511)])
def test_chunk_at_equals_chunk_for_a_consecutive_range(stages, b, lo, hi):
    a, c = stages.chunk_at(b, np.arange(lo, hi)), stages.chunk(b, lo, hi)
    assert a.time_s == pytest.approx(c.time_s, rel=1e-12) and a.body_s == pytest.approx(c.body_s, rel=1e-12)
    assert a.serial_s == pytest.approx(c.serial_s, rel=1e-12) and a.longest_tokens == c.longest_tokens
    # a zero prefix is no prefix; the last sample ends with the chunk, none after it
    z = stages.chunk_at(b, np.arange(lo, hi), np.zeros(hi - lo, dtype=np.int64))
    assert z.time_s == pytest.approx(c.time_s, rel=1e-12)
    off = stages.finish_offsets(b, np.arange(lo, hi))
    assert off.max() == pytest.approx(c.time_s, rel=1e-9) and (off > 0).all()


def test_finish_offsets_and_tokens_follow_the_lock_step_decode(stages):
    pos = np.array([7, 3, 100, 41, 250])  # any positions, any order
    L = stages.batch(4).response_tokens[pos]
    off = stages.finish_offsets(4, pos)
    assert list(np.argsort(off, kind="stable")) == list(np.argsort(L, kind="stable"))  # one wave: by length
    ch = stages.chunk_at(4, pos)
    assert ch.longest_tokens == L.max() and off.max() == pytest.approx(ch.time_s)
    # t0 + (L_i / l_max) x the decode time is a lower bound: the short ones share the full early steps
    assert (off >= L / L.max() * (ch.time_s - 1e-9) - 1e-9).all()
    assert (stages.tokens_after(4, pos, 0.0) == 0).all()
    assert (stages.tokens_after(4, pos, ch.time_s) == L).all()
    mid = stages.tokens_after(4, pos, ch.time_s / 2)
    assert (mid <= L).all() and (mid > 0).all()
    for i in range(pos.size):  # a sample holds all its tokens exactly when it has finished
        assert (stages.tokens_after(4, pos, off[i])[i] == L[i])
        assert (stages.tokens_after(4, pos, off[i] * (1 - 1e-6))[i] < L[i])
    # resumed with its prefix: fewer decode steps, the rest re-prefilled
    resumed = stages.chunk_at(4, pos, mid)
    assert resumed.time_s < ch.time_s and resumed.longest_tokens == int((L - mid).max())
    assert stages.tokens_after(4, pos, 0.0, mid).tolist() == mid.tolist()


def test_train_at_device_s_adds_up_to_the_step(stages):
    n = stages.batch(2).num_samples
    perm = np.random.default_rng(0).permutation(n)
    parts = sum(stages.train_at_device_s(2, perm[i:i + 37]) for i in range(0, n, 37))
    assert parts == pytest.approx(stages.train_device_s(2), rel=1e-12)
    assert stages.train_at_device_s(2, np.arange(5, 50)) == pytest.approx(stages.train_chunk_device_s(2, 5, 50))


# ---------------------------------------------------------------------------- the streaming engine

MOVE = ((0, 12), (16, 8))  # rollout -> train after step 15, chunks in flight


@pytest.mark.parametrize("partial,accumulate,admit", MODES)
def test_a_move_migrates_in_flight_samples_and_every_sample_is_generated_once(sc, stages, bounds, partial,
                                                                             accumulate, admit):
    eng, res, rec = _run(sc, stages, bounds, MOVE, partial, accumulate, admit)
    (resize,) = rec.of_kind("resize")
    assert resize["to_role"] == "train" and resize["drain_s"] == 0.0
    assert res.migrated_samples > 0 and resize["requests_moved"] == res.migrated_samples
    ops = [o for o in rec.of_kind("op") if o["name"] == MIGRATE_REQUESTS]
    assert len(ops) == 4 and sum(o["requests_moved"] for o in ops) == res.migrated_samples
    assert res.summary()["migrated_samples"] == res.migrated_samples and "drain_s" not in res.summary()
    # the ledger: every sample of every step finished exactly once (the engine also checks each step)
    assert sorted(eng.steps) == list(range(K))
    for k, st in eng.steps.items():
        assert st.generated.size == stages.batch(k).num_samples and (st.generated == 1).all()
        assert not st.returned and st.num_returned == 0 and st.left == 0
    assert res.num_samples == sum(int(st.generated.sum()) for st in eng.steps.values())
    assert [s["step"] for s in rec.of_kind("step")] == list(range(K))
    assert all(s["version"] == max(0, s["step"] - 2) for s in rec.of_kind("step"))  # versions do not move
    assert res.max_staleness <= 2


@pytest.mark.parametrize("migrate", [True, False])
@pytest.mark.parametrize("partial,accumulate,admit", MODES)
def test_idle_accounting_adds_up_across_moves(sc, stages, bounds, partial, accumulate, admit, migrate):
    _, res, rec = _run(sc, stages, bounds, ((0, 10), (6, 12), (16, 8), (22, 10)), partial, accumulate, admit,
                       migrate=migrate)
    assert res.resizes == 3
    assert res.busy_device_s + res.idle_device_s == pytest.approx(N * res.total_time_s, rel=1e-9)
    assert res.idle_device_s == pytest.approx(res.bubble_idle_device_s + res.resize_idle_device_s)
    assert sum(s["idle_device_s"] for s in rec.of_kind("step")) == pytest.approx(res.idle_device_s, rel=1e-9)
    assert res.resize_idle_device_s > 0
    assert (res.migrated_samples > 0) == migrate


def test_the_move_costs_its_critical_path_not_the_moved_samples(sc, stages, bounds):
    _, res, rec = _run(sc, stages, bounds, MOVE, False, True, True)
    (resize,) = rec.of_kind("resize")
    decided = rec.of_kind("step")[15]["t_end_s"]
    critical = [o for o in rec.of_kind("op") if o["critical"]]
    assert min(o["start_s"] for o in critical) == pytest.approx(decided)
    assert max(o["end_s"] for o in critical) == pytest.approx(decided + resize["critical_s"])
    # all trainers (the 4 and the 4 joining) stall for the critical path; the re-run is rollout work
    assert resize["stall_device_s"] == pytest.approx(8 * resize["critical_s"])
    assert rec.of_kind("step")[16]["num_train"] == 8  # the next step trains with them
    mig = next(o for o in critical if o["name"] == MIGRATE_REQUESTS)
    assert mig["end_s"] - mig["start_s"] == pytest.approx(MIGRATE_S)


@pytest.mark.parametrize("partial", [False, True])
def test_migration_is_no_slower_than_the_drain_on_a_long_tail_workload(sc, stages, bounds, partial):
    """The same scripted move (too many rollout devices, so the move pays): migrating gives the
    trainers the devices at the decision; draining keeps them until their longest response ends
    and then the next training boundary."""
    move = ((0, 14), (6, 10))
    # The split 14:2 is below a 7B's memory floor on H100s (3 trainers, costmodel.memory); the
    # floor is not what this test is about, so it is lowered to keep the move it measures. (With
    # the floor, from 13:3, migration was 0.3-1.3% slower than the drain on this workload: the
    # gain is not universal, docs/pipeline.md.)
    bounds = replace(bounds, min_train=2)
    _, mig, _ = _run(sc, stages, bounds, move, partial, True, True, migrate=True)
    _, drain, rec = _run(sc, stages, bounds, move, partial, True, True, migrate=False)
    assert mig.migrated_samples > 0 and drain.migrated_samples == 0
    assert rec.of_kind("resize")[0]["drain_s"] > 0
    assert mig.total_time_s <= drain.total_time_s
    assert mig.num_samples == drain.num_samples


class _Capture(StreamEngine):
    def requeue(self, st, work):
        self.handed_back = getattr(self, "handed_back", []) + [(st.k, work.positions.copy(), work.done)]
        super().requeue(st, work)


@pytest.mark.parametrize("partial", [False, True])
def test_moved_samples_resume_with_their_prefix_only_under_partial_rollout(sc, stages, bounds, partial):
    eng, res, _ = _run(sc, stages, bounds, MOVE, partial, True, True, engine=_Capture)
    assert sum(p.size for _, p, _ in eng.handed_back) == res.migrated_samples > 0
    if not partial:  # from scratch: the seed belongs to the sample, so the same tokens
        assert all(d is None for _, _, d in eng.handed_back)
        return
    for k, pos, done in eng.handed_back:
        L = stages.batch(k).response_tokens[pos]
        assert done.shape == pos.shape and (done >= 0).all() and (done < L).all()
    assert any(done.any() for _, _, done in eng.handed_back)  # some kept tokens


def test_a_doubled_sample_breaks_the_ledger(sc, stages, bounds):
    class Doubling(StreamEngine):
        def requeue(self, st, work):  # hands the moved samples back twice
            super().requeue(st, work)
            super().requeue(st, type(work)(positions=work.positions.copy(), done=work.done,
                                           version_max=work.version_max, carry_dev_s=0.0))

    with pytest.raises(RuntimeError, match="generated"):
        _run(sc, stages, bounds, MOVE, False, True, True, engine=Doubling)


# ---------------------------------------------------------------------------- the one-step-off engine


def test_one_step_off_moves_nothing_at_its_boundary(sc, stages, bounds):
    rec = Recorder(None)
    res = run_policy(sc, stages, Scripted(MOVE), bounds, start_rollout=12, reversal_window=4, recorder=rec)
    (resize,) = rec.of_kind("resize")
    assert resize["to_role"] == "train" and resize["requests_moved"] == 0 and res.resizes == 1
    ops = [o for o in rec.of_kind("op") if o["name"] == MIGRATE_REQUESTS]
    assert ops and all(o["requests_moved"] == 0 and o["end_s"] - o["start_s"] == pytest.approx(MIGRATE_S)
                       for o in ops)
