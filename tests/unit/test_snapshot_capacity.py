"""The start-of-run check of what the snapshots keep against Ray's object store (driver/snapshots.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynaresize.config_load import build_config


def _snap(full: int, params: int):
    metas = [{"bytes": full // 2, "param_bytes": params // 2}, {"bytes": full // 2, "param_bytes": params // 2}]
    return SimpleNamespace(metas=metas)


@pytest.mark.parametrize("capacity, says", [(10 * 2**30, False), (2**30, True)])
def test_capacity_line_only_when_it_would_not_fit(monkeypatch, capsys, capacity, says):
    import ray

    from dynaresize.driver.snapshots import Snapshots

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"object_store_memory": float(capacity)})
    run = SimpleNamespace(cfg=build_config({}), cluster=SimpleNamespace(nodes=None))
    snaps = Snapshots(run)
    snaps._check_capacity(_snap(full=600 * 2**20, params=200 * 2**20))
    # one node, staleness 1: 2 full (600 MiB) + 3 parameter versions (200 MiB) = 1.76 GiB
    assert snaps.kept_bytes == 2 * 600 * 2**20 + 3 * 200 * 2**20
    err = capsys.readouterr().err
    assert ("would not fit in Ray's object store" in err) == says
    if says:
        assert len(err.strip().splitlines()) == 1
