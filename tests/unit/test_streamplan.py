"""The streaming pipeline's pure schedule (pipeline/streamplan.py): release rule, dispatch rule, bounds.

A toy driver plays the runtime's windows against `StreamQueue` with engines whose calls end in
a seeded random order, and checks at every point the bounds the module states."""

import random

import pytest

from dynaresize.pipeline.stepstate import rollout_version
from dynaresize.pipeline.streamplan import StreamQueue, released_through


def test_release_rule_is_the_versions_that_exist():
    # version v exists after training step v-1: with k steps trained, steps up to k+eta
    assert [released_through(k, 2, 100) for k in range(4)] == [2, 3, 4, 5]
    assert released_through(9, 3, 10) == 9
    for eta in (2, 3, 4):
        for k in range(10):
            last = released_through(k, eta, 100)
            assert rollout_version(last, eta) == k and rollout_version(last + 1, eta) == k + 1


def test_engine_pulls_only_when_its_next_item_needs_another_version():
    q = StreamQueue(eta=2)
    q.add_engine(0, 0)
    for s in range(4):
        q.release(s, [f"g{s}a", f"g{s}b"])
    got = []
    while q.queue:
        d = q.next_for(0)
        got.append((d.step, d.version, d.pull))
        assert q.next_for(0) is None  # one item in flight per engine
        q.done(0, d.step)
    assert got == [(0, 0, False), (0, 0, False), (1, 0, False), (1, 0, False), (2, 0, False), (2, 0, False),
                   (3, 1, True), (3, 1, False)]
    assert all(q.complete(s) for s in range(4))


def test_release_order_and_drain_and_removal():
    q = StreamQueue(eta=2)
    q.release(0, ["a"])
    with pytest.raises(ValueError):
        q.release(0, ["a"])
    q.add_engine(0, 0)
    q.add_engine(1, 0)
    d = q.next_for(0)
    q.close([0, 1])
    assert q.next_for(1) is None and not q.idle([0])
    with pytest.raises(ValueError):
        q.remove_engine(0)  # a request in flight: drain first
    q.done(0, d.step)
    assert q.idle([0, 1])
    q.remove_engine(0)
    assert 0 not in q.engine_version


@pytest.mark.parametrize("eta", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windows_keep_the_stated_bounds(eta, seed):
    """Windows of a toy run: release, run engines until step k is complete (random order of
    completions; an engine admits more items at random moments, as when its items are down to
    their tails), 'train' k while engines go on, resize now and then (a leaving engine's items
    are drained or moved to the others); bounds hold throughout and each step's items run with
    version max(0, k - eta)."""
    rng = random.Random(seed)
    steps, items = 12, 5
    q = StreamQueue(eta=eta)
    engines = [0, 1, 2]
    for d in engines:
        q.add_engine(d, 0)
    running: dict[int, list[tuple[int, object]]] = {}
    versions_used: dict[int, set] = {}

    def tick(trained):
        for d in list(q.engine_version):
            while (nxt := q.next_for(d, admitting=rng.random() < 0.5)) is not None:
                running.setdefault(d, []).append((nxt.step, nxt.item))
                versions_used.setdefault(nxt.step, set()).add(nxt.version)
        assert not q.check_bounds(trained), q.check_bounds(trained)
        busy = sorted(d for d, items in running.items() if items)
        if busy:
            d = rng.choice(busy)
            s, _ = running[d].pop(rng.randrange(len(running[d])))
            q.done(d, s)

    for k in range(steps):
        for s in range(k, released_through(k, eta, steps) + 1):
            if not q.released(s):
                q.release(s, [f"{s}-{i}" for i in range(items)])
        q.forget_before(k)
        assert len(q.in_flight_steps()) <= eta + 1
        while not q.complete(k):
            tick(k)
        for _ in range(rng.randrange(0, 6)):  # training k overlaps more rollout
            tick(k)
        assert all(k < s <= k + eta for s in q.in_flight_steps())
        if k % 4 == 1:  # a device leaves the rollout pool: drained first
            leaver = rng.choice(sorted(q.engine_version))
            if len(q.engine_version) > 1:
                q.close([leaver])
                if rng.random() < 0.5:
                    while not q.idle([leaver]):
                        tick(k)
                for s, item in sorted(running.pop(leaver, []), reverse=True):  # moved: first in line
                    q.put_back(leaver, s, f"{item}'")
                q.remove_engine(leaver)
        elif k % 4 == 3:  # a device joins holding the version just trained
            q.add_engine(max(engines) + 1, k + 1)
            engines.append(max(engines) + 1)
    assert versions_used == {s: {rollout_version(s, eta)} for s in range(steps)}


def test_admission_takes_the_next_item_of_the_same_version_under_tails_only():
    q = StreamQueue(eta=2)
    q.add_engine(0, 0)
    for s in range(4):
        q.release(s, [f"g{s}a", f"g{s}b"])
    first = q.next_for(0)
    assert q.next_for(0) is None  # its item is still in its body
    second = q.next_for(0, admitting=True)  # down to its last request: it admits the next one
    assert (first.step, second.step, second.pull) == (0, 0, False) and q.busy[0] == [0, 0]
    for _ in range(4):  # steps 1 and 2 also use version 0: admitted under the tails
        assert q.next_for(0, admitting=True).version == 0
    assert q.queue[0][0] == 3 and q.next_for(0, admitting=True) is None  # version 1 waits for the tails
    partial = q.next_for(0, admitting=True, partial=True)  # partial rollout: pull at once, tails go on
    assert (partial.step, partial.version, partial.pull) == (3, 1, True)
    for step in [0, 0, 1, 1, 2, 2, 3]:
        q.done(0, step)
    assert q.idle([0]) and all(q.complete(s) for s in range(3)) and not q.complete(3)


def test_admission_takes_items_that_fit_in_the_free_slots_of_the_same_version():
    """Request-level admission: while an engine runs items in their body it takes the next one
    only if it fits in its free slots; a version change still waits for the tails."""
    q = StreamQueue(eta=2)
    q.add_engine(0, 0)
    for s in range(4):
        q.release(s, [[f"r{s}{i}" for i in range(32)]])  # one share of 32 requests a step
    assert q.next_for(0, free=64).step == 0  # an empty engine takes one whatever its slots
    assert q.next_for(0, free=31) is None  # 32 requests do not fit in 31 free slots
    assert q.next_for(0, free=32).step == 1 and q.busy[0] == [0, 1]  # it fits: held at once
    assert q.next_for(0, free=0) is None
    assert q.next_for(0, admitting=True).step == 2  # in the tail: admitted whatever the slots
    assert q.head_step() == 3 and q.next_for(0, free=10**6) is None  # version 1 waits for every item
    for step in (0, 1, 2):
        q.done(0, step)
    last = q.next_for(0, free=0)
    assert (last.step, last.version, last.pull) == (3, 1, True) and q.head_step() == -1


def test_moved_requests_go_back_first_as_a_new_item_of_their_step():
    q = StreamQueue(eta=2)
    q.add_engine(0, 0)
    q.add_engine(1, 0)
    q.release(0, ["a", "b"])
    q.release(1, ["c"])
    d = q.next_for(0)
    q.close([0])
    q.put_back(0, d.step, "a-rest")  # what the leaving engine had not finished is queued again, first
    assert not q.complete(0) and q.queue[0] == (0, "a-rest")
    assert q.next_for(0) is None and q.next_for(1).item == "a-rest"
    with pytest.raises(ValueError):
        q.put_back(1, 7, "x")  # no item of step 7 on that engine
