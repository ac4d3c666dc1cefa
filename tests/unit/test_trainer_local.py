"""ShardedTrainer in one process (group=None): AdamW against torch.optim.AdamW, shard ranges,
state dicts, the LR schedule, pending-state rules and checkpoints (save, reshard on load,
missing/partial/corrupt errors)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dynaresize.errors import CheckpointError, ConfigError
from dynaresize.roles import checkpoint as ckpt
from dynaresize.roles.train_torch import OptimSettings, ShardedTrainer, adamw_update_, shard_range


class TinyNet(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(torch.tanh(self.hidden(self.emb(ids))))))


def make_model(seed: int = 0, tied: bool = False) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(tied)


def loss_fn(model: nn.Module, ids: torch.Tensor):
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return loss, ids[:, 1:].numel()


def batches(num: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (3, 7), generator=gen) for _ in range(num)]


SETTINGS = OptimSettings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_adamw_matches_torch_bitwise_with_one_micro_batch():
    ours, ref = make_model(), make_model()
    trainer = ShardedTrainer.build_from_model(ours, (0,), 0, SETTINGS)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1)
    for step, mb in enumerate(batches(5)):
        trainer.train_step([(0, mb)], loss_fn, group=None, num_micro_batches=1)
        opt.zero_grad()
        loss_fn(ref, mb)[0].backward()
        opt.step()
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), f"step {step} {name}: max diff {(a - b).abs().max()}"
    assert trainer.step == 5 and trainer.lr_step == 5


def test_adamw_matches_torch_with_accumulated_micro_batches():
    ours, ref = make_model(), make_model()
    trainer = ShardedTrainer.build_from_model(ours, (0,), 0, SETTINGS)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1)
    data = batches(12)
    for step in range(3):
        mbs = data[4 * step:4 * step + 4]
        stats = trainer.train_step(list(enumerate(mbs)), loss_fn, group=None, num_micro_batches=4)
        opt.zero_grad()
        ref_loss = 0.0
        for mb in mbs:
            loss = loss_fn(ref, mb)[0] / 4
            loss.backward()
            ref_loss += loss.item() * 4
        opt.step()
        assert stats["loss_sum"] == pytest.approx(ref_loss, rel=1e-6)
        assert stats["num_tokens"] == 4 * 3 * 6 and stats["num_micro_batches"] == 4
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    assert diff <= 1e-6


def test_frozen_params_untouched_and_not_in_layout():
    model = make_model()
    before = model.frozen.weight.clone()
    trainer = ShardedTrainer.build_from_model(model, (0,), 0, SETTINGS)
    assert not any(n.startswith("frozen.") for n in trainer.param_names)
    assert trainer.numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer.train_step([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    assert torch.equal(model.frozen.weight, before)


def test_update_does_not_depend_on_shard_boundaries():
    gen = torch.Generator().manual_seed(3)
    n = 1037
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    grad = torch.randn(n, generator=gen) * 1e-3
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    whole = [t.clone() for t in state]
    adamw_update_(*whole, grad, **kw)
    for num_ranks in (2, 3, 4, 7):
        pieces = [t.clone() for t in state]
        for i in range(num_ranks):
            lo, hi = shard_range(n, num_ranks, i)
            adamw_update_(*(t[lo:hi] for t in pieces), grad[lo:hi], **kw)
        for a, b in zip(whole, pieces):
            assert torch.equal(a, b), f"W={num_ranks}"


@pytest.mark.parametrize("numel", [0, 1, 5, 17, 1000, 1001])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 7])
def test_shard_ranges_balanced_and_tiling(numel, num_ranks):
    ranges = [shard_range(numel, num_ranks, i) for i in range(num_ranks)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(num_ranks - 1))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shards_follow_the_sorted_rank_tuple():
    model = make_model()
    trainer = ShardedTrainer.build_from_model(model, (7, 2, 5), 5, SETTINGS)
    assert trainer.ranks == (2, 5, 7) and trainer.index == 1
    lo, hi = trainer.shard_range()
    assert (lo, hi) == shard_range(trainer.numel, 3, 1)
    shards = trainer.state_shards()
    assert set(shards) == {"param", "exp_avg", "exp_avg_sq"}
    assert all(t.dim() == 1 and t.numel() == hi - lo and t.is_contiguous() for t in shards.values())
    flat = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if p.requires_grad])
    assert torch.equal(shards["param"], flat[lo:hi]) and not shards["exp_avg"].any()
    with pytest.raises(ValueError):
        ShardedTrainer(model, SETTINGS, ranks=(0, 1), rank=3)


@pytest.mark.parametrize("tied", [False, True])
def test_full_state_dict_round_trips(tied):
    model = make_model(tied=tied)
    trainer = ShardedTrainer.build_from_model(model, (0,), 0, SETTINGS)
    trainer.train_step([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    full = trainer.full_state_dict()
    assert set(full) == set(model.state_dict())
    if tied:
        assert full["head.weight"] is full["emb.weight"]
        assert "head.weight" not in trainer.full_state_dict(dedupe_tied=True)
    fresh = make_model(seed=9, tied=tied)
    fresh.load_state_dict(full)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    full["hidden.weight"].add_(1.0)  # a copy: the live model is untouched
    assert not torch.equal(full["hidden.weight"], model.hidden.weight)


def test_tied_weight_counted_once():
    untied, tied = ShardedTrainer(make_model()), ShardedTrainer(make_model(tied=True))
    assert untied.numel - tied.numel == 11 * 6


def test_lr_schedule_and_settings_validation():
    s = OptimSettings(lr=1.0, schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    assert [s.lr_at(i) for i in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    c = OptimSettings(lr=1.0, schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    assert c.lr_at(0) == 1.0 and c.lr_at(4) == pytest.approx(0.1) and c.lr_at(2) == pytest.approx(0.55)
    from dynaresize.config import TrainConfig

    taken = OptimSettings.from_config(TrainConfig(lr=0.5, betas=[0.8, 0.9]), warmup_steps=3)
    assert (taken.lr, taken.betas, taken.warmup_steps) == (0.5, (0.8, 0.9), 3)
    with pytest.raises(ConfigError, match="train.lr"):
        OptimSettings(lr=0.0)
    with pytest.raises(ConfigError, match="schedule"):
        OptimSettings(schedule="step")


def test_pending_moments_block_only_the_optimizer():
    model = make_model()
    trainer = ShardedTrainer.build_from_model(model, (0,), 0, SETTINGS)
    shards = {k: v.clone() for k, v in trainer.state_shards().items()}
    half = shard_range(trainer.numel, 2, 0)
    trainer.load_state_shards({"param": shards["param"][half[0]:half[1]]}, (0, 1), rank=0)  # layout change
    assert trainer.pending_state() == {"exp_avg", "exp_avg_sq"} and trainer.shard_range() == half
    trainer.load_state_shards({"param": shards["param"]}, (0,), rank=0)
    trainer.compute_grads([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    with pytest.raises(RuntimeError, match="exp_avg"):
        trainer.apply_optimizer()
    trainer.load_state_shards({"exp_avg": shards["exp_avg"], "exp_avg_sq": shards["exp_avg_sq"]})
    assert trainer.apply_optimizer()["step"] == 1
    with pytest.raises(ValueError, match="shape"):
        trainer.load_state_shards({"exp_avg": torch.zeros(3)})


def test_micro_batch_count_is_checked():
    trainer = ShardedTrainer.build_from_model(make_model(), (0,), 0, SETTINGS)
    with pytest.raises(RuntimeError, match="expected 2"):
        trainer.compute_grads([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=2)
    with pytest.raises(ValueError, match="outside"):
        trainer.compute_grads([(5, batches(1)[0])], loss_fn, group=None, num_micro_batches=2)


def test_grad_clipping_uses_global_norm():
    model = make_model()
    trainer = ShardedTrainer.build_from_model(model, (0,), 0, OptimSettings(lr=1e-2, max_grad_norm=1e-3))
    stats = trainer.compute_grads([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    assert stats["grad_norm"] > 1e-3 and stats["clip_coef"] == pytest.approx(1e-3 / (stats["grad_norm"] + 1e-6))


def test_checkpoint_round_trip_and_resume_equals_uninterrupted(tmp_path):
    data = batches(6)
    straight = ShardedTrainer.build_from_model(make_model(), (0,), 0, SETTINGS, seed=4)
    for i in range(6):
        straight.train_step([(0, data[i])], loss_fn, group=None, num_micro_batches=1)

    first = ShardedTrainer.build_from_model(make_model(), (0,), 0, SETTINGS, seed=4)
    for i in range(3):
        first.train_step([(0, data[i])], loss_fn, group=None, num_micro_batches=1)
    first.generator.manual_seed(123)
    first.save_checkpoint(tmp_path / "ck", extra={"run_step": 3})
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world"] == 1 and manifest["extra"] == {"run_step": 3}

    fresh = make_model()  # frozen params come from construction, not from the checkpoint
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(1.0)
    resumed = ShardedTrainer(fresh, SETTINGS)
    resumed.load_checkpoint(tmp_path / "ck", (0,), 0)
    assert resumed.scalars() == first.scalars()
    for k, v in first.state_shards().items():
        assert torch.equal(resumed.state_shards()[k], v), k
    for i in range(3, 6):
        resumed.train_step([(0, data[i])], loss_fn, group=None, num_micro_batches=1)
    for a, b in zip(straight.full_state_dict().values(), resumed.full_state_dict().values()):
        assert torch.equal(a, b)


def test_checkpoint_saved_by_three_shards_loads_at_one_and_two(tmp_path):
    model = make_model()
    ref = ShardedTrainer.build_from_model(model, (0,), 0, SETTINGS)
    ref.train_step([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    full = ref.state_shards()
    savers = [ShardedTrainer(model, SETTINGS, ranks=(0, 1, 2), rank=r) for r in range(3)]
    infos = []
    for t in savers:
        lo, hi = t.shard_range()
        t.load_state_shards({k: v[lo:hi].clone() for k, v in full.items()})
        t.load_scalars(ref.scalars())
        infos.append(t.save_shard(tmp_path))
    savers[0].write_manifest(tmp_path, infos[::-1])
    for ranks in [(0,), (0, 1)]:
        pieces = {k: [] for k in full}
        for r in ranks:
            loaded = ShardedTrainer(make_model(seed=8), SETTINGS)
            loaded.load_checkpoint(tmp_path, ranks, r)  # no group: full params read from disk
            assert loaded.scalars() == ref.scalars()
            for name, p in loaded.model.named_parameters():
                if p.requires_grad:  # frozen params come from construction, not the checkpoint
                    assert torch.equal(p, dict(model.named_parameters())[name]), name
            for k, v in loaded.state_shards().items():
                pieces[k].append(v)
        for k in full:
            assert torch.equal(torch.cat(pieces[k]), full[k]), (ranks, k)


def _saved(tmp_path):
    trainer = ShardedTrainer.build_from_model(make_model(), (0,), 0, SETTINGS)
    trainer.save_checkpoint(tmp_path)
    shard = next(tmp_path.glob("shard-*.safetensors"))
    return trainer, shard


def test_missing_manifest_is_a_checkpoint_error(tmp_path):
    trainer, _ = _saved(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json missing"):
        trainer.load_checkpoint(tmp_path, (0,), 0)
    with pytest.raises(CheckpointError, match="no such directory"):
        trainer.load_checkpoint(tmp_path / "absent", (0,), 0)


def test_corrupt_shard_is_a_checkpoint_error(tmp_path):
    trainer, shard = _saved(tmp_path)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    before = {k: v.clone() for k, v in trainer.state_shards().items()}
    with pytest.raises(CheckpointError, match="sha256 mismatch") as info:
        trainer.load_checkpoint(tmp_path, (0,), 0)
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in trainer.state_shards().items())  # left as it was


def test_partial_and_missing_shards_are_checkpoint_errors(tmp_path):
    trainer, shard = _saved(tmp_path)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or partial"):
        trainer.load_checkpoint(tmp_path, (0,), 0)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        trainer.load_checkpoint(tmp_path, (0,), 0)


def test_malformed_manifest_and_other_model_are_checkpoint_errors(tmp_path):
    trainer, _ = _saved(tmp_path)
    other = ShardedTrainer(make_model(tied=True), SETTINGS)
    with pytest.raises(CheckpointError, match="another model"):
        other.load_checkpoint(tmp_path, (0,), 0)
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        trainer.load_checkpoint(tmp_path, (0,), 0)


def test_resave_replaces_checkpoint_and_drops_stale_files(tmp_path):
    trainer, first = _saved(tmp_path)
    (tmp_path / ".crashed.safetensors.tmp").write_bytes(b"half")
    trainer.train_step([(0, batches(1)[0])], loss_fn, group=None, num_micro_batches=1)
    trainer.save_checkpoint(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert first.name not in files and len(files) == 2 and "manifest.json" in files
    assert ckpt.read_manifest(tmp_path)["step"] == 1



def test_shard_range_equals_reshard_flat_layout():
    layout = pytest.importorskip("dynaresize.reshard.layout")
    for numel in (0, 1, 7, 100, 1001):
        for ranks in [(0,), (1, 3), (0, 2, 5), (4, 1, 2, 3)]:
            flat = layout.FlatLayout(numel, ranks)
            for i, r in enumerate(sorted(ranks)):
                assert shard_range(numel, len(ranks), i) == flat.shard_range(r)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_full_state_dict_loads_with_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    trainer = ShardedTrainer.build_from_model(model, (0,), 0, SETTINGS)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    trainer.train_step([(0, ids)], lambda m, x: m(input_ids=x, labels=x).loss, group=None, num_micro_batches=1)
    full = trainer.full_state_dict(dedupe_tied=True)
    assert ("lm_head.weight" in full) != tied
    cfg.save_pretrained(tmp_path)
    save_file(full, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path)
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
