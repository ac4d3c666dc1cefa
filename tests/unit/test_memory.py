"""The training memory floor: one function (`costmodel.memory`) for the simulator, the emulator
and docs/gpu.md, counting what the trainer holds (16 B/param: fp32 master, gradients, two moments)."""

import re
from pathlib import Path

import pytest

from dynaresize.costmodel import costs, memory

from _shapes import H, HD, HEADS, I, KV, L, QWEN2_7B, V  # Qwen2-7B written out by hand

GPU_DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
GB = 1e9


def test_the_floor_counts_gradients():
    assert memory.train_state_bytes(1e9) == 16e9  # 4 master + 4 gradient + 8 moments
    assert memory.train_state_bytes(1e9, reference=True) == 20e9
    # 7.62e9 parameters: 121.9 GB; 56 GB of an 80 GB device -> 3 devices (2 would hold 61 GB each)
    assert memory.min_train_devices_for(7.62e9, 80 * GB) == 3
    assert memory.min_train_devices_for(7.62e9, 141 * GB) == 2
    assert memory.min_train_devices_for(1e6, 80 * GB) == 1


@pytest.mark.parametrize("model", sorted(costs.MODEL_PRESETS))
def test_the_simulator_and_the_emulator_use_it(model):
    m = costs.get_model(model)
    assert m.train_state_bytes == memory.train_state_bytes(m.num_params)
    for name in ("h100", "h200", "a100", "h20"):
        hw = costs.get_hardware(name)
        assert costs.min_train_devices(m, hw) == memory.min_train_devices_for(m.num_params, hw.hbm_bytes)


def _training_rows() -> list[list[str]]:
    text = GPU_DOC.read_text()
    table = text.split("Training (FSDP2", 1)[1].split("\n\n", 2)[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_docs_gpu_training_table_is_the_functions_output():
    rows = _training_rows()
    assert len(rows) == 2
    for cells in rows:
        params = float(re.search(r"\(([\d.e]+) parameters\)", cells[0]).group(1))
        assert cells[1] == f"{memory.train_state_bytes(params) / GB:.1f} GB"
        for cell, hbm in ((cells[2], 80 * GB), (cells[3], 141 * GB)):
            w = memory.min_train_devices_for(params, hbm)
            assert cell == f"{w} ({memory.train_state_bytes(params) / w / GB:.1f} GB each)", cell


# ------------------------------------------------------------------ the plan before start
def _inputs(**kw) -> memory.MemoryInputs:
    base = dict(micro_batch_size=4, seq_tokens=640)
    return memory.MemoryInputs(**{**base, **kw})


def test_the_7b_shape_counts_qwen2_7b():
    assert QWEN2_7B.num_params == 7_615_616_512  # Qwen2-7B's published count (7.62e9, docs/references.md 5)
    assert QWEN2_7B.kv_bytes_per_token(2) == 57_344  # docs/gpu.md's rollout table


def test_layer_activations_follow_the_counted_tensors():
    # 8h + 4eh + 5eq + 4eI + 4 heads, e = 2 (bf16), q = h: the docstring's 244,848 B
    assert memory.layer_activation_bytes_per_token(QWEN2_7B, "bf16") == 244_848
    assert memory.layer_activation_bytes_per_token(QWEN2_7B, "fp32") == 8 * H + 16 * H + 20 * H + 16 * I + 4 * HEADS


def test_checkpointing_keeps_one_input_per_block_and_one_block():
    inp = _inputs(train_dtype="bf16")
    t = inp.tokens
    per_layer = memory.layer_activation_bytes_per_token(QWEN2_7B, "bf16") * t
    extra = (4 * H + 4 * H) * t + 4 * 640 ** 2  # final norm + lm_head input, the SDPA mask
    assert memory.activation_bytes(QWEN2_7B, inp, checkpointing=False) == L * per_layer + extra
    assert memory.activation_bytes(QWEN2_7B, inp, checkpointing=True) == L * 2 * H * t + per_layer + extra
    assert memory.logits_bytes(QWEN2_7B, inp) == t * V * 10  # bf16 logits + fp32 log-softmax + its gradient


def test_a_trainers_state_falls_as_one_over_w_and_the_rest_does_not():
    inp = _inputs()
    n = QWEN2_7B.num_params
    peaks = [memory.trainer_peak(QWEN2_7B, inp, w) for w in range(1, 9)]
    for w, p in enumerate(peaks, start=1):
        d = p.as_dict()
        assert d["parameters"] + d["gradients"] + d["moments"] == pytest.approx(16 * n / w)
        assert d["activations"] == memory.activation_bytes(QWEN2_7B, inp, checkpointing=False)
        assert "reference" not in d
    assert all(a.total > b.total for a, b in zip(peaks, peaks[1:]))
    kl = memory.trainer_peak(QWEN2_7B, _inputs(reference=True), 4).as_dict()
    assert kl["reference"] == pytest.approx(4 * n / 4)
    torn = memory.trainer_peak(QWEN2_7B, _inputs(engine_release="teardown"), 4).as_dict()
    assert "parked_engine" not in torn


def test_the_engine_takes_its_budget_and_the_kv_cache_is_what_it_leaves():
    inp = _inputs()
    hbm = 80 * GB
    e = memory.engine_peak(QWEN2_7B, inp, hbm).as_dict()
    assert e["weights"] == 2 * QWEN2_7B.num_params
    assert e["weights"] + e["reserve"] + e["kv"] == pytest.approx(0.85 * hbm)
    assert e["sync_staging"] == 2 * (V * H + H * I + 3 * H)
    tp2 = memory.engine_peak(QWEN2_7B, _inputs(tensor_parallel=2), hbm).as_dict()
    assert tp2["weights"] == e["weights"] / 2
    assert memory.engine_problem(QWEN2_7B, inp, hbm) is None
    # a fixed cache smaller than one request is refused, naming what to raise
    small = _inputs(kv_cache_bytes=1 << 20, max_model_len=4096)
    assert "less than one request of 4096 tokens" in memory.engine_problem(QWEN2_7B, small, hbm)
    # weights alone over the budget: a 40 GB device at 0.3 leaves no KV
    assert memory.engine_problem(QWEN2_7B, _inputs(gpu_memory_utilization=0.3), 40 * GB) is not None


def test_a_split_fits_only_when_every_role_and_op_does():
    inp = _inputs()
    fits = memory.plan_splits(QWEN2_7B, inp, 80 * GB, num_devices=8, rollout_sizes=range(1, 8))
    by_train = {s.train: s for s in fits}
    assert not by_train[1].fits and "train needs" in by_train[1].limit
    for s in fits:
        assert s.fits == (s.train_peak.total <= 80 * GB and s.rollout_peak.total <= 80 * GB
                          and all(p.total <= 80 * GB for p in s.ops.values()))
    # more memory: more splits fit, never fewer
    more = memory.plan_splits(QWEN2_7B, inp, 141 * GB, num_devices=8, rollout_sizes=range(1, 8))
    assert {s.train for s in fits if s.fits} <= {s.train for s in more if s.fits}
    assert len([s for s in more if s.fits]) > len([s for s in fits if s.fits])
