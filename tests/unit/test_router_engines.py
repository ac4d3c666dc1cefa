"""The streaming router's engine bookkeeping (cluster/router_engines.py): the requests an engine
holds, its free slots, the tail, and the order an admission round offers engines items."""

from dynaresize.cluster.router_engines import StreamEngine, StreamItem, admission_order


def _item(step, n):
    return StreamItem(step=step, requests=[], t0=0.0, pending={(step, 0, i): None for i in range(n)})


def test_free_slots_count_every_request_not_yet_delivered():
    e = StreamEngine(ranks=(0,), items=[_item(0, 32), _item(1, 20)])
    assert e.holding == 52 and e.free(64) == 12 and e.free(40) == 0
    assert not e.in_tail
    e.items = [_item(0, 1), _item(1, 1)]
    assert e.in_tail and StreamEngine().in_tail  # down to last requests, or nothing: in the tail


def test_a_round_offers_the_emptiest_engine_first():
    engines = {0: StreamEngine(ranks=(0,), items=[_item(0, 8)]), 2: StreamEngine(ranks=(2, 3)),
               4: StreamEngine(ranks=(4,), items=[_item(0, 3)])}
    assert admission_order(engines) == [2, 4, 0]
    engines[2].items.append(_item(1, 3))
    assert admission_order(engines) == [2, 4, 0]  # a tie goes to the lower rank
