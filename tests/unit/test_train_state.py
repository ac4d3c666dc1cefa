"""Pure trainer-state pieces: the elementwise AdamW against torch.optim.AdamW, the LR schedule,
the flat shard rule; and trainer checkpoints (format v2: a rank's pieces of any layout, reshard
on load, missing/partial/corrupt errors)."""

from __future__ import annotations

import pytest
import torch

from dynaresize.errors import CheckpointError, ConfigError
from dynaresize.reshard.layout import FlatLayout, RowChunkLayout
from dynaresize.reshard.sources import ShardSource, array_fetch, fill_pieces
from dynaresize.roles import checkpoint as ckpt
from dynaresize.roles.train_state import OptimSettings, adamw_update_, shard_range


def test_adamw_update_matches_torch_bitwise():
    gen = torch.Generator().manual_seed(0)
    ours = torch.randn(37, generator=gen)
    ref = torch.nn.Parameter(ours.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    m, v = torch.zeros(37), torch.zeros(37)
    for step in range(1, 6):
        grad = torch.randn(37, generator=gen)
        adamw_update_(ours, m, v, grad, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        ref.grad = grad.clone()
        opt.step()
        assert torch.equal(ours, ref.detach()), f"step {step}"


def test_update_does_not_depend_on_shard_boundaries():
    gen = torch.Generator().manual_seed(3)
    n = 1037
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    grad = torch.randn(n, generator=gen) * 1e-3
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    whole = [t.clone() for t in state]
    adamw_update_(*whole, grad, **kw)
    for num_ranks in (2, 3, 7):
        pieces = [t.clone() for t in state]
        for i in range(num_ranks):
            lo, hi = shard_range(n, num_ranks, i)
            adamw_update_(*(t[lo:hi] for t in pieces), grad[lo:hi], **kw)
        for a, b in zip(whole, pieces):
            assert torch.equal(a, b), f"W={num_ranks}"


def test_lr_schedule_and_settings_validation():
    s = OptimSettings(lr=1.0, schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    assert [s.lr_at(i) for i in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    c = OptimSettings(lr=1.0, schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    assert c.lr_at(0) == 1.0 and c.lr_at(4) == pytest.approx(0.1) and c.lr_at(2) == pytest.approx(0.55)
    assert OptimSettings(lr=0.5).lr_at(100) == 0.5
    with pytest.raises(ConfigError, match="schedule"):
        OptimSettings(schedule="step")


def test_shard_range_equals_flat_layout():
    for numel in (0, 1, 7, 1001):
        for ranks in [(0,), (1, 3), (4, 1, 2, 3)]:
            flat = FlatLayout(numel, ranks)
            for i, r in enumerate(sorted(ranks)):
                assert shard_range(numel, len(ranks), i) == flat.shard_range(r)


SHAPES = [(5, 3), (7,), (), (2, 2, 2)]


def _state(layout: RowChunkLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(layout.numel, generator=gen, dtype=torch.float64) for k in ckpt.STATE_KEYS}


def _save(directory, layout: RowChunkLayout, full: dict[str, torch.Tensor]) -> None:
    infos = []
    for i, r in enumerate(layout.ranks):
        pieces = layout.rank_pieces(r)
        tensors = {k: torch.cat([v[lo:hi] for lo, hi in pieces]) for k, v in full.items()}
        infos.append(ckpt.save_shard(directory, shard_index=i, num_shards=layout.num_ranks, pieces=pieces,
                                     tensors=tensors, step=3))
    ckpt.write_manifest(directory, infos=infos, numel=layout.numel, params=[], ranks=list(layout.ranks),
                        scalars={"step": 3, "rng_state": b"\x01\x02"}, settings={}, layout=layout.describe())


@pytest.mark.parametrize("old_w,new_w", [(3, 2), (1, 4), (4, 3)])
def test_checkpoint_loads_at_another_world_size(tmp_path, old_w, new_w):
    old = RowChunkLayout.of_shapes(SHAPES, range(old_w))
    full = _state(old)
    _save(tmp_path, old, full)
    reader = ckpt.CheckpointReader(tmp_path)
    assert ckpt.decode_scalars(reader.manifest["scalars"])["rng_state"] == b"\x01\x02"
    new = RowChunkLayout.of_shapes(SHAPES, range(new_w))
    for r in new.ranks:
        pieces = new.rank_pieces(r)
        targets = {k: [torch.empty(hi - lo, dtype=torch.float64) for lo, hi in pieces] for k in full}
        fill_pieces(targets, pieces, reader.source)
        for k, ts in targets.items():
            for (lo, hi), t in zip(pieces, ts):
                assert torch.equal(t, full[k][lo:hi]), (r, k)


def test_partial_source_reads_only_what_it_was_given():
    layout = RowChunkLayout.of_shapes(SHAPES, range(3))
    full = _state(layout)
    r = layout.ranks[1]
    pieces = layout.rank_pieces(r)
    arrays = {k: torch.cat([v[lo:hi] for lo, hi in pieces]) for k, v in full.items()}
    src = ShardSource([(pieces, array_fetch(arrays))], layout.numel, partial=True)
    lo, hi = pieces[0]
    assert torch.equal(src.read("param", lo, hi), full["param"][lo:hi])
    other = layout.rank_pieces(layout.ranks[0])[0]
    with pytest.raises(ValueError, match="in no shard"):
        src.read("param", *other)
    with pytest.raises(ValueError, match="do not tile"):
        ShardSource([(pieces, array_fetch(arrays))], layout.numel)


def _saved(tmp_path):
    layout = RowChunkLayout.of_shapes(SHAPES, (0,))
    _save(tmp_path, layout, _state(layout))
    return next(tmp_path.glob("shard-*.safetensors"))


def _read_all(directory):
    reader = ckpt.CheckpointReader(directory)
    return reader.read("param", 0, reader.manifest["numel"])


def test_missing_manifest_and_directory_are_checkpoint_errors(tmp_path):
    _saved(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json missing"):
        _read_all(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        _read_all(tmp_path / "absent")


def test_corrupt_partial_missing_shards_are_one_line_errors(tmp_path):
    shard = _saved(tmp_path)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as info:
        _read_all(tmp_path)
    assert "\n" not in str(info.value)
    shard.write_bytes(bytes(raw[:100]))
    with pytest.raises(CheckpointError, match="truncated or partial"):
        _read_all(tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        _read_all(tmp_path)


def test_malformed_manifest_and_resave(tmp_path):
    first = _saved(tmp_path)
    (tmp_path / ".crashed.safetensors.tmp").write_bytes(b"half")
    second = _saved(tmp_path)  # a new save replaces the old one and drops stale files
    files = sorted(p.name for p in tmp_path.iterdir())
    assert first.name not in files and second.name in files and len(files) == 2
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        _read_all(tmp_path)
