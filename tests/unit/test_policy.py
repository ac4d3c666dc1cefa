"""Policies: the factory, the baselines, the online stage model and the hysteresis policy."""

from dataclasses import replace

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.errors import ConfigError
from dynaresize.policy.base import Policy, make_policy
from dynaresize.policy.baselines import Greedy, Planned
from dynaresize.policy.hysteresis import Hysteresis
from dynaresize.policy.model import OnlineStageModel, expected_max
from dynaresize.types import ROLLOUT, TRAIN, Bounds, Keep, Move, StepReport

B = Bounds(num_devices=16, min_rollout=1, min_train=1, move_unit=1)


def world(r, n, *, floor=60.0, k=800.0, c=1.0, d=1200.0, step=0, noise=0.0, sync=1.0, cost=None, beta=1.0):
    """A report from a synthetic cluster: T_roll = floor + k / r**beta, T_train = c + d / n."""
    roll = floor + k / r ** beta + noise
    train = c + d / n
    return StepReport(step=step, now_s=0.0, num_rollout=r, num_train=n, rollout_s=roll, train_s=train, sync_s=sync,
                      train_fixed_s=c, rollout_floor_s=floor, rollout_longest_s=roll, resize_critical_s=cost)


@pytest.mark.parametrize("name", ["hysteresis", "static", "static:3", "static-profiled", "greedy", "scripted"])
def test_factory_builds_every_runtime_policy(name):
    cfg = replace(PolicyConfig(), name=name, schedule="2:4")
    p = make_policy(cfg, B, num_steps=10)
    assert isinstance(p, Policy) and p.name == name
    assert isinstance(p.decide(world(8, 8)), (Keep, Move))


def test_factory_errors():
    with pytest.raises(ConfigError, match="simulator only"):
        make_policy(replace(PolicyConfig(), name="lend"), B)
    assert make_policy(replace(PolicyConfig(), name="lend"), B, simulator=True).lends
    with pytest.raises(ConfigError, match="static:R"):
        make_policy(replace(PolicyConfig(), name="static:x"), B)
    with pytest.raises(ConfigError, match="simulator only"):
        make_policy(replace(PolicyConfig(), name="oracle"), B)


def test_static_moves_once_then_keeps():
    p = make_policy(replace(PolicyConfig(), name="static:5"), B)
    assert p.start_rollout == 5
    d = p.decide(world(8, 8))
    assert isinstance(d, Move) and d.target_rollout(8) == 5
    assert isinstance(p.decide(world(8, 8)), Keep)  # refused once: not asked again


def test_scripted_moves_before_the_named_step():
    p = make_policy(replace(PolicyConfig(), name="scripted", schedule="0:6,3:2"), B)
    assert p.start_rollout == 6
    assert isinstance(p.decide(world(6, 10, step=1)), Keep)
    d = p.decide(world(6, 10, step=2))
    assert d.target_rollout(6) == 2


def test_static_profiled_moves_once_to_the_balanced_split():
    p = make_policy(replace(PolicyConfig(), name="static-profiled", profile_steps=3), B)
    assert isinstance(p.decide(world(4, 12, step=0)), Keep)
    assert isinstance(p.decide(world(4, 12, step=1)), Keep)
    d = p.decide(world(4, 12, step=2))
    target = d.target_rollout(4)
    gaps = {r: abs(60 + 800 / r - 1 - 1200 / (16 - r)) for r in range(1, 16)}
    assert target == min(gaps, key=gaps.get)
    assert isinstance(p.decide(world(target, 16 - target, step=3)), Keep)


def test_online_model_recovers_a_synthetic_cluster():
    m = OnlineStageModel(window=4)
    for s in range(4):
        m.update(world(8, 8, step=s))
    assert m.rollout_s(4) == pytest.approx(60 + 800 / 4)
    assert m.train_s(12) == pytest.approx(1 + 1200 / 12)
    # beta is refitted from a move: a world whose scalable rollout part goes as r**-0.5
    m2 = OnlineStageModel(window=4)
    for s, r in enumerate([8, 8, 4, 4]):
        m2.update(world(r, 16 - r, beta=0.5, step=s))
    assert m2.beta == pytest.approx(0.5, abs=1e-6)
    assert m2.rollout_s(2) == pytest.approx(60 + 800 / 2 ** 0.5)


def test_an_over_stated_floor_is_conservative_about_rollout_devices():
    """The unpaced runtime reports the longest engine call as `rollout_floor_s` (an upper bound of
    the floor: batch-mates slow the longest response's decode steps); the simulator and emulated
    runs the modelled floor. Fed the same stage times with the true floor and with an over-stated
    one, the model agrees at the measured split, predicts no more gain from extra rollout devices,
    and no more loss from fewer (docs/policies.md)."""
    true, over = OnlineStageModel(window=4), OnlineStageModel(window=4)
    for s in range(4):
        rep = world(8, 8, step=s)
        true.update(rep)
        over.update(replace(rep, rollout_floor_s=rep.rollout_s * 0.9))  # most of the call, not 60 s
    assert over.rollout_s(8) == pytest.approx(true.rollout_s(8))
    for r in (9, 12, 15):
        assert over.rollout_s(r) >= true.rollout_s(r) - 1e-9
    for r in (1, 4, 7):
        assert over.rollout_s(r) <= true.rollout_s(r) + 1e-9
    assert over.rollout_s(12) > true.rollout_s(12)  # strictly: the over-stated floor does not shrink


def test_online_model_predicts_the_next_steps_training_from_its_known_tokens():
    """Device-seconds per token are learned from the trained batches; the next step's demand is
    that rate x the tokens of the batch it trains, with no training noise in its step time."""
    m = OnlineStageModel(window=4)
    rng = np.random.default_rng(0)
    for s in range(4):
        tokens = int(rng.integers(50_000, 150_000))  # D = 0.01 s per token: noisy from step to step
        rep = replace(world(8, 8, step=s, d=0.01 * tokens), train_tokens=tokens, next_train_tokens=0)
        m.update(rep)
    assert m.next_train_d() is None and m.step_curve_next([4, 8], 16) is None  # next batch unknown
    assert m.train_s_next(8) == pytest.approx(m.train_s(8))
    m.update(replace(world(8, 8, step=4, d=1000.0), train_tokens=100_000, next_train_tokens=300_000))
    assert m.next_train_d() == pytest.approx(3000.0)
    assert m.train_s_next(10) == pytest.approx(1 + 3000 / 10)
    assert m.train_s(10) < 1 + 1500 / 10  # the window mean knows nothing of the big batch
    # the next step's curve: rollout from the window, training exact
    curve = m.step_curve_next([2, 12], 16)
    assert curve[1] == pytest.approx(max(m.rollout_s(12), 1 + 3000 / 4) + 1.0, rel=1e-3)


def test_hysteresis_uses_the_known_demand_of_the_next_step():
    """One-step-off with a one-step horizon: the window says the split is balanced, but the next
    batch is known to be three times as large, so hysteresis moves devices to training; without
    the tokens it keeps the split."""
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02, dwell_steps=1,
                  cooldown_steps=0, horizon_steps=1, profile_steps=3, move_cost_prior_s=0.0)
    best = min(range(1, 16), key=lambda x: max(60 + 800 / x, 1 + 1200 / (16 - x)))

    def run(next_factor):
        hys = make_policy(cfg, B, num_steps=100)
        out = []
        for s in range(6):
            rep = replace(world(best, 16 - best, step=s), train_tokens=100_000,
                          next_train_tokens=int(100_000 * (next_factor if s == 5 else 1)))
            out.append(hys.decide(rep))
        return out

    assert all(isinstance(d, Keep) for d in run(1.0))
    last = run(3.0)
    assert all(isinstance(d, Keep) for d in last[:5])
    assert isinstance(last[5], Move) and last[5].target_rollout(best) < best


def test_hysteresis_last_step_saving_uses_the_last_batchs_known_demand():
    """The last step trains a batch already rolled out: a nearly empty one saves nothing on more
    trainers, so the last-step move is not made; a normal one makes it."""
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02, move_cost_prior_s=10.0)
    best = min(range(1, 16), key=lambda x: max(60 + 800 / x, 1 + 1200 / (16 - x)))
    K = 30

    def last_decision(next_tokens):
        hys = make_policy(cfg, B, num_steps=K)
        d = None
        for s in range(K - 1):
            rep = replace(world(best, 16 - best, step=s), train_tokens=100_000,
                          next_train_tokens=next_tokens if s == K - 2 else 100_000)
            d = hys.decide(rep)
        return d

    assert isinstance(last_decision(100_000), Move)
    assert isinstance(last_decision(10), Keep)


def test_gain_samples_are_the_gain_once_per_report():
    """Consistent reports give the model's own gain every time; reports that disagree spread."""
    m = OnlineStageModel(window=5)
    for s in range(5):
        m.update(world(10, 6, step=s, floor=200.0))
    g = m.gain_samples(10, 11, 16)
    assert g.shape == (5,)
    assert np.allclose(g, m.step_s(10, 16) - m.step_s(11, 16))
    m2 = OnlineStageModel(window=5)
    for s in range(5):
        m2.update(world(10, 6, step=s, floor=200.0, k=(200.0, 1400.0)[s % 2]))
    g2 = m2.gain_samples(10, 11, 16)
    assert g2.max() > 0 > g2.min()


def test_hysteresis_takes_a_gain_between_the_bands_only_when_the_reports_agree():
    """One-step-off: a 2.6% gain (between exit 2% and enter 5%) that every report predicts arms
    and moves; the same mean gain from reports that disagree is not significant; a gain below the
    exit band never arms."""
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02)
    hys = make_policy(cfg, B, num_steps=100)
    r, moves = _run_world(hys, 10, 12, floor=200.0)
    assert moves and moves[0][1] == 11 and 0.02 < 280 / (200 + 800 / 11) - 1 < 0.05
    assert hys._significant(10, 11, 16, 0.0)
    noisy = make_policy(cfg, B, num_steps=100)
    for s in range(12):
        noisy.decide(world(10, 6, step=s, floor=200.0, k=(200.0, 1400.0)[s % 2]))
    assert noisy.model.gain_samples(10, 11, 16, 10.0).mean() > 0
    assert not noisy._significant(10, 11, 16, 10.0)
    _, moves = _run_world(make_policy(replace(cfg, exit_band=0.03), B, num_steps=100), 10, 12, floor=200.0)
    assert moves == []


def test_expected_max_is_clark():
    assert expected_max(3.0, 1.0, 0.0) == 3.0
    rng = np.random.default_rng(0)
    x, y = rng.normal(10, 2, 200000), rng.normal(11, 1.5, 200000)
    assert float(expected_max(10.0, 11.0, np.hypot(2, 1.5))) == pytest.approx(np.maximum(x, y).mean(), rel=0.01)


def _run_world(policy, r, steps, **kw):
    """Feed a policy reports from the synthetic world, applying its moves at once."""
    moves = []
    for s in range(steps):
        d = policy.decide(world(r, 16 - r, step=s, cost=1.0 if moves and moves[-1][0] == s - 1 else None, **kw))
        if isinstance(d, Move):
            r = d.target_rollout(r)
            moves.append((s, r))
    return r, moves


def test_hysteresis_does_not_feed_a_tail_bound_rollout():
    """Rollout is slower but tail-bound (floor 100 s, little scalable work): sending it devices
    cannot help, so hysteresis keeps them (or moves toward training); greedy moves to rollout."""
    kw = dict(floor=100.0, k=80.0, d=600.0)
    hys = make_policy(replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02), B, num_steps=50)
    r_h, _ = _run_world(hys, 8, 30, **kw)
    r_g, moves_g = _run_world(Greedy(PolicyConfig(), B), 8, 30, **kw)
    assert r_h <= 8
    assert moves_g and moves_g[0][1] > 8


def test_hysteresis_moves_to_the_better_split_after_dwell_and_stays():
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02, dwell_steps=2, profile_steps=3)
    hys = make_policy(cfg, B, num_steps=100)
    r, moves = _run_world(hys, 3, 40)
    assert len(moves) >= 1
    # no move before profile_steps reports, nor before the gain persisted dwell_steps reports
    assert moves[0][0] >= max(cfg.profile_steps - 1, cfg.dwell_steps - 1)
    best = min(range(1, 16), key=lambda x: max(60 + 800 / x, 1 + 1200 / (16 - x)))
    assert abs(r - best) <= 1
    assert len(moves) <= 2


def test_hysteresis_keeps_when_the_gain_does_not_pay_the_cost():
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.0001, exit_band=0.0, horizon_steps=1,
                  cost_margin=10.0)
    hys = make_policy(cfg, B, num_steps=1000)
    r, moves = _run_world(hys, 7, 20)  # 7 is close to the best split: a tiny gain, a 10 s prior cost
    assert moves == []


def test_hysteresis_stops_moving_near_the_end():
    hys = make_policy(replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02), B, num_steps=5)
    r, moves = _run_world(hys, 2, 5)
    assert all(s < 4 for s, _ in moves)


def test_hysteresis_counts_profiling_reports_toward_the_dwell():
    """The reports while profiling arm the move: with a persistent gain from the first report,
    the first move comes at the last profiling report, not dwell_steps - 1 reports later."""
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02, dwell_steps=2, profile_steps=3)
    _, moves = _run_world(make_policy(cfg, B, num_steps=100), 3, 10)
    assert moves and moves[0][0] == cfg.profile_steps - 1


def test_hysteresis_gives_the_last_step_to_training():
    """One-step-off: the last step only trains, so before it hysteresis moves to the smallest
    rollout pool when the predicted training saving beats the move cost; a move that would still
    be cooling down then is not made near the end, and the streaming pipeline keeps its split."""
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.05, exit_band=0.02)
    best = min(range(1, 16), key=lambda x: max(60 + 800 / x, 1 + 1200 / (16 - x)))
    K = 30
    r, moves = _run_world(make_policy(cfg, B, num_steps=K), best, K - 1)
    assert moves == [(K - 2, B.splits()[0])] and r == 1
    # far from the end it is not done
    _, moves = _run_world(make_policy(cfg, B, num_steps=10 * K), best, K - 1)
    assert moves == []
    # a cheap gain does not pay a costly move: training barely shrinks with devices
    hys = make_policy(replace(cfg, move_cost_prior_s=10.0), B, num_steps=K)
    _, moves = _run_world(hys, best, K - 1, d=1.0, floor=1.0, k=10.0)
    assert all(t != B.splits()[0] for _, t in moves)


def test_greedy_rebalances_by_device_seconds():
    g = Greedy(replace(PolicyConfig(), greedy_threshold=1.2), B)
    d = g.decide(StepReport(step=0, now_s=0, num_rollout=4, num_train=12, rollout_s=30.0, train_s=10.0))
    # device-seconds 120 vs 120: equal shares -> 8 rollout devices
    assert isinstance(d, Move) and d.dst == ROLLOUT and d.target_rollout(4) == 8
    assert isinstance(g.decide(StepReport(step=1, now_s=0, num_rollout=8, num_train=8, rollout_s=11.0,
                                          train_s=10.0)), Keep)
    d2 = g.decide(StepReport(step=2, now_s=0, num_rollout=8, num_train=8, rollout_s=10.0, train_s=30.0))
    assert d2.dst == TRAIN


def test_planned_follows_its_targets():
    p = Planned("oracle", [4, 5, 5, 3])
    assert p.start_rollout == 4
    assert p.decide(world(4, 12, step=0)).target_rollout(4) == 5
    assert isinstance(p.decide(world(5, 11, step=1)), Keep)
    assert p.decide(world(5, 11, step=2)).target_rollout(5) == 3
    assert isinstance(p.decide(world(3, 13, step=3)), Keep)


def test_hysteresis_is_deterministic():
    a = _run_world(Hysteresis(replace(PolicyConfig(), enter_band=0.05, exit_band=0.02), B, num_steps=60), 3, 40)
    b = _run_world(Hysteresis(replace(PolicyConfig(), enter_band=0.05, exit_band=0.02), B, num_steps=60), 3, 40)
    assert a == b


# ------------------------------------------------------------ streaming pipeline (staleness >= 2)

from dynaresize.policy.stream_model import StreamStageModel, expected_max_of  # noqa: E402


def test_expected_max_of_matches_sampling():
    rng = np.random.default_rng(1)
    lengths = np.sort(rng.lognormal(7.0, 1.0, 500))
    got = expected_max_of(lengths, [1, 8, 40, 500])
    assert got[0] == pytest.approx(lengths.mean())
    assert got[3] == pytest.approx(lengths[-1])
    draws = np.array([rng.choice(lengths, 40, replace=False).max() for _ in range(20000)])
    assert got[2] == pytest.approx(draws.mean(), rel=0.02)
    assert got[1] < got[2] < got[3]


def stream_report(r, n, *, step=0, lengths=None, t_w=0.01, w=0.2, pull=1.0, c=1.0, d=1200.0, unit=1):
    """A streaming report from a synthetic cluster: shares of ceil(B / replicas) samples, each
    costing t_w x its longest length (serial) + w per sample (work) + one pull."""
    lengths = np.arange(1, 513, dtype=np.int64) * 10 if lengths is None else lengths
    B = lengths.size
    reps = r // unit
    share = -(-B // reps)
    chunks = [lengths[i:i + share] for i in range(0, B, share)]
    serial = sum(float(ch.max()) * t_w for ch in chunks) * unit
    work = serial + w * B * unit
    return StepReport(step=step, now_s=0.0, num_rollout=r, num_train=n, rollout_s=100.0, train_s=c + d / n,
                      sync_s=0.5, train_fixed_s=c, num_samples=B, rollout_work_s=work, rollout_serial_s=serial,
                      rollout_sync_s=pull * len(chunks) * unit, rollout_chunks=len(chunks), rollout_slots=256,
                      response_lengths=tuple(int(x) for x in lengths))


def test_stream_model_fits_the_measured_split_and_shrinks_shares_with_more_devices():
    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.arange(1, 513, dtype=np.int64) * 10)
    splits = np.arange(1, 16)
    m = StreamStageModel()
    m.update(stream_report(8, 8, lengths=lengths), splits)
    parts = m.parts(splits, 16)
    rep = stream_report(8, 8, lengths=lengths)
    measured = (rep.rollout_work_s + rep.rollout_sync_s) / 8
    assert parts["rollout"][7] == pytest.approx(measured)  # at the split it was measured on
    assert parts["train"][7] == pytest.approx(1.0 + 1200.0 / 8 + 0.5)
    # more devices: smaller shares, each with a shorter expected longest response -> faster per step,
    # but not as 1/R: every share pays its own longest response (no floor, a cost per share)
    assert np.all(np.diff(parts["rollout"]) < 0)
    assert parts["rollout"][14] > measured * 8 / 15
    curve = m.step_curve(splits, 16)
    assert np.allclose(curve, np.maximum(parts["rollout"], parts["train"]))


def test_hysteresis_under_streaming_moves_toward_the_throughput_balance_and_stays():
    """Rollout throughput-bound at R=3 of 16: hysteresis (staleness 2) moves devices to rollout,
    lands where the model's two throughputs cross, and does not move back."""
    cfg = replace(PolicyConfig(), name="hysteresis")
    hys = make_policy(cfg, B, num_steps=200, staleness=2)
    assert hys.stream
    lengths = np.random.default_rng(3).permutation(np.arange(1, 513, dtype=np.int64) * 10)

    def world_s(r, s):
        return stream_report(r, 16 - r, step=s, d=600.0, t_w=0.02, w=0.5, lengths=lengths)

    def period(r):
        rep = world_s(r, 0)
        return max((rep.rollout_work_s + rep.rollout_sync_s) / r, rep.train_s + rep.sync_s)

    r, moves = 3, []
    for s in range(60):
        d = hys.decide(replace(world_s(r, s), resize_critical_s=1.0 if moves and moves[-1][0] == s - 1 else None))
        if isinstance(d, Move):
            r = d.target_rollout(r)
            moves.append((s, r))
    best = min(range(1, 16), key=period)
    assert moves and moves[0][1] > 3
    # the streaming pipeline's first reports are its warm-up: they do not count toward the dwell
    assert moves[0][0] >= cfg.profile_steps - 1 + cfg.dwell_steps - 1
    assert abs(r - best) <= 1 and period(r) <= 1.05 * period(best)
    directions = [np.sign(b - a) for (_, a), (_, b) in zip([(0, 3)] + moves, moves)]
    assert all(x == directions[0] for x in directions)  # never back


def test_stream_model_gain_samples_warm_up_and_training_tail():
    """Steps 0..eta (released together at the start) feed the fit but do not count as learned;
    consistent reports give the level's gain every time, disagreeing ones spread; a short
    training tail (trainers accumulating as groups arrive) lowers the window term."""
    lengths = np.random.default_rng(5).permutation(np.arange(1, 513, dtype=np.int64) * 10)
    splits = np.arange(1, 16)
    m = StreamStageModel(staleness=2)
    for s in range(8):
        m.update(stream_report(8, 8, step=s, lengths=lengths), splits)
    assert m.num_reports == 5  # steps 3..7
    g = m.gain_samples(8, 9, 16)
    assert g.shape == (5,) and np.allclose(g, m.step_s(8, 16) - m.step_s(9, 16))
    m2 = StreamStageModel(staleness=2)
    for s in range(8):
        m2.update(stream_report(8, 8, step=s, lengths=lengths, d=(300.0, 3000.0)[s % 2]), splits)
    g2 = m2.gain_samples(8, 9, 16)
    assert g2.max() > 0 > g2.min()
    short = StreamStageModel(staleness=2)
    for s in range(8):
        rep = stream_report(8, 8, step=s, lengths=lengths)
        short.update(replace(rep, train_tail_s=rep.train_fixed_s + 5.0), splits)
    assert np.all(short.parts(splits, 16)["window"] < m.parts(splits, 16)["window"])
