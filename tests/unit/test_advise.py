"""`dynaresize advise` on logs generated from known stage models (tests/advise_logs.py): the fit
recovers the truth, the gain is called right for a drifting and a stationary job, in the console,
W&B CSV and TensorBoard forms; bad input is one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advise_logs import TRUTH, generate, write_console, write_csv, write_tensorboard  # noqa: E402

from dynaresize.advise.answer import verdict, with_switch_cost  # noqa: E402
from dynaresize.advise.lengths import rebuild_lengths  # noqa: E402
from dynaresize.advise.logs import parse_console, printed_batch, steps_from_rows  # noqa: E402
from dynaresize.cli import main as cli  # noqa: E402
from dynaresize.costmodel.costs import get_hardware, get_model  # noqa: E402
from dynaresize.costmodel.stages import StageModel  # noqa: E402
from dynaresize.sim.resize import canonical_timing  # noqa: E402


def test_console_lines_with_ray_prefix_and_printed_config():
    lines = ["{'data': {'train_batch_size': 128}, 'actor_rollout_ref': {'rollout': {'name': 'vllm', 'n': 8}}}",
             "(TaskRunner pid=77) step:3 - timing_s/gen:74.020 - response_length/mean:324.958 - actor/lr:1e-06",
             "(TaskRunner pid=77) Training Progress: 3/100",
             "(TaskRunner pid=77) step:4 - timing_s/gen:70.5 - timing_s/update_actor:14.3 - timing_s/ref:3.4"]
    rows = parse_console(lines)
    assert rows == [{"step": 3, "timing_s/gen": 74.02, "response_length/mean": 324.958, "actor/lr": 1e-06},
                    {"step": 4, "timing_s/gen": 70.5, "timing_s/update_actor": 14.3, "timing_s/ref": 3.4}]
    assert printed_batch("\n".join(lines)) == 128 * 8
    assert printed_batch("data.train_batch_size=64 actor_rollout_ref.rollout.n=4") == 256
    assert printed_batch("no config here") is None
    steps, found = steps_from_rows(rows, "x")
    assert steps[1].train_s == pytest.approx(14.3 + 3.4) and steps[0].train_s is None
    assert found["rollout_s"] == "timing_s/gen" and found["train_s"] == "timing_s/ref+timing_s/update_actor"


@pytest.mark.parametrize("mean,longest,clip", [(1267.0, 3072.0, 0.0), (325.0, 1024.0, 0.004), (900.0, 8192.0, 0.05)])
def test_rebuilt_lengths_keep_the_logged_mean_max_and_clip_ratio(mean, longest, clip):
    L = rebuild_lengths(mean=mean, longest=longest, clip_ratio=clip, num_samples=2048, seed=3)
    assert L.shape == (2048,) and L.min() >= 1
    assert L.mean() == pytest.approx(mean, rel=0.01) and L.max() == longest
    assert np.mean(L >= longest) == pytest.approx(clip, abs=1.5 / 2048)
    assert np.array_equal(L, rebuild_lengths(mean=mean, longest=longest, clip_ratio=clip, num_samples=2048, seed=3))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = {}
    for workload in ("longtail-drift", "longtail-stationary"):
        g = generate(workload)
        d = tmp_path_factory.mktemp(workload)
        out[workload] = (g, {"verl-log": write_console(g, d / "train.log"), "wandb-csv": write_csv(g, d / "h.csv"),
                             "tensorboard": write_tensorboard(g, d / "tb")})
    return out


def _advise(path, g, *extra) -> dict:
    args = ["advise", "--from", str(path), "--devices", str(g.devices), "--rollout-devices", str(g.rollout_devices),
            "--json", *extra]
    if not str(path).endswith(".log"):  # only the console log prints its config (the batch)
        args += ["--prompts-per-step", str(g.prompts), "--samples-per-prompt", str(g.samples_per_prompt)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(args) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def answers(jobs):
    """advise's JSON answer for every (workload, form), computed once."""
    return {(w, f): _advise(path, g) for w, (g, paths) in jobs.items() for f, path in paths.items()}


@pytest.mark.parametrize("form", ["verl-log", "wandb-csv", "tensorboard"])
@pytest.mark.parametrize("workload", ["longtail-drift", "longtail-stationary"])
def test_advise_recovers_the_stage_models_and_calls_the_gain(jobs, answers, workload, form):
    g, _ = jobs[workload]
    doc = answers[(workload, form)]
    assert doc["steps_read"] == len(g.rows) and doc["job"]["samples_per_step"] == g.prompts * g.samples_per_prompt
    cal = doc["calibration"]
    assert cal["rollout_error"] < 0.10 and cal["train_error"] < 0.10
    # the fitted numbers are the truth's (the fit starts from the plain 7b preset: 1.7, 0.5, 0.4)
    assert cal["decode_eff"] == pytest.approx(TRUTH["decode_eff"], rel=0.10)
    assert cal["mfu_train"] == pytest.approx(TRUTH["mfu_train"], rel=0.10)
    # the fitted stage models on the job's true batches, at the logged split, are the truth's within 10%
    fitted = get_model("7b").__class__(**{**get_model("7b").__dict__, "decode_eff": cal["decode_eff"],
                                          "mfu_decode": cal["mfu_decode"], "mfu_prefill": cal["mfu_decode"],
                                          "mfu_train": cal["mfu_train"], "train_comm_s": cal["train_fixed_s"]})
    sm = StageModel(fitted, lambda b: g.batches[b], get_hardware("h100"))
    roll = np.array([sm.rollout(k, g.rollout_devices).time_s for k in range(len(g.batches))])
    train = np.array([sm.train(k, g.devices - g.rollout_devices).time_s for k in range(len(g.batches))])
    assert np.mean(np.abs(roll - g.true_rollout_s) / g.true_rollout_s) < 0.10
    assert np.mean(np.abs(train - g.true_train_s) / g.true_train_s) < 0.10
    split = doc["logged_split"]
    assert split["samples_per_s_reproduced"] == pytest.approx(split["samples_per_s_logged"], rel=0.10)
    for key in ("static", "best_static", "hysteresis", "oracle", "gain_vs_logged", "gain_vs_best_static", "verdict"):
        assert key in doc
    assert {s["rollout"] for s in doc["static"]} >= {g.rollout_devices, doc["best_static"]["rollout"]}
    assert doc["oracle"]["samples_per_s"] >= doc["best_static"]["samples_per_s"] * 0.999
    if workload == "longtail-drift":
        assert doc["gain_vs_logged"] > 1.05
        assert not doc["verdict"].startswith("no split change pays")
    else:
        assert doc["gain_vs_logged"] <= 1.02
        assert doc["verdict"].startswith("no split change pays on this job")


def test_the_three_forms_give_the_same_answer(answers):
    docs = [answers[("longtail-drift", f)] for f in ("verl-log", "wandb-csv", "tensorboard")]
    gains = [d["gain_vs_logged"] for d in docs]
    assert max(gains) - min(gains) < 1e-3  # TensorBoard keeps float32: not bit-equal
    assert len({d["verdict"] for d in docs}) == 1


def test_out_writes_the_answer_and_the_figure(jobs, capsys, tmp_path):
    g, paths = jobs["longtail-stationary"]
    assert cli(["advise", "--from", str(paths["verl-log"]), "--devices", str(g.devices), "--rollout-devices",
                str(g.rollout_devices), "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("verdict: no split change pays")
    assert json.loads((tmp_path / "a" / "advise.json").read_text())["steps_read"] == len(g.rows)
    assert (tmp_path / "a" / "advise.png").read_bytes()[:4] == b"\x89PNG"


def test_switch_cost_sets_the_critical_path_of_a_move(jobs, answers):
    g, paths = jobs["longtail-drift"]
    model, hw = get_model("7b"), get_hardware("h100")
    slow = with_switch_cost(model, hw, 32, 16, 1, 150.0)
    assert canonical_timing(slow, 32, 16, 17, hw).critical_s == pytest.approx(150.0)
    assert canonical_timing(slow, 32, 16, 15, hw).critical_s == pytest.approx(150.0)
    cheap = answers[("longtail-drift", "verl-log")]
    cold = _advise(paths["verl-log"], g, "--switch-s", "150")
    assert cold["switch_cost_s"]["train_to_rollout"] == pytest.approx(150.0)
    assert cold["hysteresis"]["moves"] <= cheap["hysteresis"]["moves"]
    assert cold["oracle"]["samples_per_s"] <= cheap["oracle"]["samples_per_s"]


def test_colocated_log_is_reproduced_from_its_summed_stages(jobs, capsys):
    g, paths = jobs["longtail-stationary"]
    rows = [r | {"timing_s/step": r["timing_s/gen"] + r["timing_s/old_log_prob"] + r["timing_s/update_actor"] + 3.0}
            for r in g.rows]
    path = paths["wandb-csv"].with_name("colocated.csv")
    g2 = type(g)(**{**g.__dict__, "rows": rows})
    write_csv(g2, path)
    assert cli(["advise", "--from", str(path), "--devices", "32", "--rollout-devices", "32", "--prompts-per-step",
                str(g.prompts), "--samples-per-prompt", str(g.samples_per_prompt), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"]["colocated"] and doc["calibration"]["other_s"] == pytest.approx(3.0, rel=1e-6)
    split = doc["logged_split"]
    assert split["samples_per_s_reproduced"] == pytest.approx(split["samples_per_s_logged"], rel=0.10)


def test_verdict_names_the_case():
    base = {"hysteresis": {"moves": 3, "move_list": [{"after_step": 40}], "start_rollout": 8, "end_rollout": 12,
                           "payback_steps": 2}, "best_static": {"rollout": 10, "samples_per_s": 1.0}}
    assert verdict(base | {"gain_vs_logged": 1.01, "best_static_gain_vs_logged": 1.0, "oracle_gain_vs_logged": 1.03,
                           "gain_vs_best_static": 1.01}, 8, False).startswith("no split change pays on this job")
    assert verdict(base | {"gain_vs_logged": 1.10, "best_static_gain_vs_logged": 1.09, "oracle_gain_vs_logged": 1.12,
                           "gain_vs_best_static": 1.01}, 8, False).startswith("a fixed split of 10 rollout devices")
    line = verdict(base | {"gain_vs_logged": 1.20, "best_static_gain_vs_logged": 1.05, "oracle_gain_vs_logged": 1.25,
                           "gain_vs_best_static": 1.14}, 8, False)
    assert line.startswith("moving 4 devices to rollout after step ~40 pays +20.0%")


def _one_line_exit_2(capsys, argv, *needles):
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for n in needles:
        assert n in err
    return err


def test_malformed_or_unrelated_logs_are_one_line_and_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.log"
    junk.write_text("hello\nnot a metrics line\n")
    _one_line_exit_2(capsys, ["advise", "--from", str(junk), "--devices", "4", "--rollout-devices", "2"],
                     str(junk), "no per-step metrics")
    other = tmp_path / "other.log"
    other.write_text("step:1 - loss:0.5 - reward:1.0\nstep:2 - loss:0.4 - reward:1.0\n")
    _one_line_exit_2(capsys, ["advise", "--from", str(other), "--devices", "4", "--rollout-devices", "2"],
                     str(other), "timing_s/gen", "response_length/mean")
    csv_ = tmp_path / "h.csv"
    csv_.write_text("a,b\n1,2\n")
    _one_line_exit_2(capsys, ["advise", "--from", str(csv_), "--devices", "4", "--rollout-devices", "2"],
                     str(csv_), "_step")
    tb = tmp_path / "events.out.tfevents.1.host"
    tb.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00abcd" + b"\xff" * 16 + b"0000")
    _one_line_exit_2(capsys, ["advise", "--from", str(tb), "--devices", "4", "--rollout-devices", "2"],
                     str(tb), "not a TensorBoard event file")
    _one_line_exit_2(capsys, ["advise", "--from", str(tmp_path / "nope"), "--devices", "4"], "no such file")


def test_missing_job_facts_and_refused_pipelines(jobs, capsys):
    g, paths = jobs["longtail-stationary"]
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["verl-log"]), "--rollout-devices", "2"], "--devices")
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["wandb-csv"]), "--devices", "32", "--rollout-devices",
                              "22"], "--prompts-per-step")
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["verl-log"]), "--devices", "32", "--rollout-devices",
                              str(g.rollout_devices), "--staleness", "2"], "staleness=2")
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["verl-log"]), "--devices", "32", "--rollout-devices",
                              "40"], "rollout-devices=40")
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["verl-log"]), "--devices", "32", "--rollout-devices",
                              str(g.rollout_devices), "--switch-s", "-1"], "switch-s=-1")


def test_tensorboard_without_a_reader_names_the_extra(jobs, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    g, paths = jobs["longtail-stationary"]
    _one_line_exit_2(capsys, ["advise", "--from", str(paths["tensorboard"]), "--devices", "32", "--rollout-devices",
                              "22", "--prompts-per-step", "4", "--samples-per-prompt", "4"],
                     "pip install 'dynaresize[tensorboard]'")


def test_trl_and_openrlhf_length_names():
    steps, found = steps_from_rows([{"step": 1, "completions/mean_length": 212.7, "completions/max_length": 441.5,
                                     "completions/clipped_ratio": 0.1, "timing_s/gen": 9.0},
                                    {"step": 2, "train/response_length": 300.0}], "x")
    assert (steps[0].len_mean, steps[0].len_max, steps[0].clip_ratio) == (212.7, 441.5, 0.1)
    assert steps[1].len_mean == 300.0
    assert found["len_mean"] == "completions/mean_length" and found["clip_ratio"] == "completions/clipped_ratio"


def test_length_trace_replaces_the_rebuilt_lengths(jobs, answers, tmp_path):
    from dynaresize.workload.trace import write_trace

    g, paths = jobs["longtail-drift"]
    trace = tmp_path / "lengths.jsonl"
    write_trace(trace, g.batches)
    doc = _advise(paths["verl-log"], g, "--length-trace", str(trace))
    assert doc["lengths"]["source"] == f"the length trace {trace}"
    assert doc["calibration"]["rollout_error"] < 0.10 and doc["gain_vs_logged"] > 1.05
    rebuilt = answers[("longtail-drift", "verl-log")]["calibration"]
    assert doc["calibration"]["rollout_error"] != rebuilt["rollout_error"]  # fitted on other batches
    short = tmp_path / "short.jsonl"
    write_trace(short, g.batches[:5])
    assert cli(["advise", "--from", str(paths["verl-log"]), "--devices", "32", "--rollout-devices",
                str(g.rollout_devices), "--length-trace", str(short)]) == 2


def test_tensorboard_read_with_tensorboardx_alone(jobs, answers, monkeypatch):
    """The `tensorboard` extra installs tensorboardX only: its protobufs read the event files."""
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    g, paths = jobs["longtail-stationary"]
    doc = _advise(paths["tensorboard"], g)
    assert doc["steps_read"] == len(g.rows)
    assert doc["gain_vs_logged"] == pytest.approx(answers[("longtail-stationary", "tensorboard")]["gain_vs_logged"])
