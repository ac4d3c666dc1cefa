"""`dynaresize report`: the HTML page of a run directory and of a simulation directory.

Runs on records written here (no Ray): a synthetic run with spans, two resizes with their ops,
eval records and a summary, and a small simulation. Checks the page is self-contained (every
figure a data URI, no external script, style or link), that headless Chromium decodes every
figure, and that a missing or malformed directory is one line and exit 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dynaresize.cli import main
from dynaresize.pipeline.concurrency import concurrency_summary
from dynaresize.records import Recorder

from _browser import assert_every_figure_renders, browser_verdict

STEPS = 6


def _write_run(out: Path, *, evals: bool = True, concurrency: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with Recorder(out / "records.jsonl") as rec:
        rec.emit("config", config={"steps": STEPS})
        split = {"rollout": [0, 1], "train": [2, 3]}
        for k in range(STEPS):
            t0 = 2.0 * k
            for d in range(4):
                name = "rollout" if d in split["rollout"] else "train"
                rec.emit("span", device=d, name=name, start_s=t0, end_s=t0 + 1.0 + 0.1 * d)
            if concurrency:  # 4 requests per replica, the last a long tail: slots empty inside it
                for d in split["rollout"]:
                    reqs = [(t0, t0 + 0.3), (t0, t0 + 0.5), (t0 + 0.3, t0 + 0.6), (t0, t0 + 1.0 + 0.1 * d)]
                    rec.emit("concurrency", step=k, device=d, **concurrency_summary(reqs, t0, t0 + 1.8))
            rec.emit("step", step=k, t_start_s=t0, t_end_s=t0 + 1.8, rollout_s=1.1, train_s=1.3, sync_s=0.2,
                     num_rollout=len(split["rollout"]), num_train=len(split["train"]), idle_device_s=1.5,
                     tail_idle_device_s=0.4, reward_mean=0.1 * k, reward_std=0.05, response_len_mean=12.0,
                     response_len_max=30)
            if k in (1, 3):
                new = ({"rollout": [0, 1, 2], "train": [3]} if k == 1 else {"rollout": [0, 1], "train": [2, 3]})
                rid = 0 if k == 1 else 1
                for i, (name, crit) in enumerate([("drop_from_train_group", True), ("load_weights", True),
                                                  ("move_optimizer_shards", False)]):
                    rec.emit("op", resize_id=rid, name=name, device=2, start_s=t0 + 1.8 + 0.01 * i,
                             end_s=t0 + 1.81 + 0.02 * i, bytes=100 * i, critical=crit)
                rec.emit("resize", resize_id=rid, step=k, **{"from": split}, to=new, moving=[2],
                         to_role="rollout" if k == 1 else "train", critical_s=0.02, total_s=0.05, t_s=t0 + 1.8,
                         reason="scripted <b>&</b>")
                split = new
            if k == 4:
                rec.emit("fault", step=k, device=3, fault_kind="kill", point="train", injected=True, detect_s=0.3)
                rec.emit("recovery", step=k, lost_devices=[3], recovery_s=0.5, num_devices=3, generation=1)
        rec.emit("summary", summary={"steps": STEPS, "ledger_ok": True, "reward_by_step": [0.1] * STEPS,
                                     "faults_unfired": ["kill:2@resize.reshard:9"]})
    if evals:  # eval records (dynaresize.driver.evaluation, docs/records.md): appended as raw lines
        with open(out / "records.jsonl", "a") as fh:
            for k in (2, 5):
                fh.write(json.dumps({"kind": "eval", "step": k, "version": k + 1, "reward_mean": 0.1 * k,
                                     "pass_at_1": 0.05 * k, "pass_at_4": 0.15 * k, "num_prompts": 4,
                                     "samples_per_prompt": 4, "eval_s": 1.0}) + "\n")
    return out


def test_run_report_is_self_contained_and_every_figure_renders_in_chromium(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    page = run / "report.html"
    assert capsys.readouterr().out.strip() == f"wrote {page}"
    text = page.read_text()
    srcs = re.findall(r'<img [^>]*src="([^"]*)"', text)
    assert len(srcs) == 7  # split, stage times, idle, reward+eval, device timeline, 2 resize Gantt charts
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"<(link|iframe)\b|<script[^>]+src=|(href|src)=\"(https?:)?//", text)
    assert "scripted &lt;b&gt;&amp;&lt;/b&gt;" in text  # record text is escaped
    for needle in ("Resizes (2)", "drop_from_train_group", "move_optimizer_shards", "Reward and eval", "pass_at_4",
                   "Faults (1) and recoveries (1)",
                   "kill:2@resize.reshard:9", "2R:2T", "3R:1T"):
        assert needle in text, needle
    assert_every_figure_renders(page, expected=7)


def test_report_without_eval_or_resizes_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    src = _write_run(tmp_path / "src", evals=False) / "records.jsonl"
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    keep = [r for r in lines if r["kind"] not in ("resize", "op")]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    assert main(["report", str(run), "--out", str(tmp_path / "page.html")]) == 0
    text = (tmp_path / "page.html").read_text()
    assert "No eval records in this run." in text and "No resize in this run." in text
    assert "Requests in flight" not in text  # no concurrency records, no such section
    assert text.count('<img class="plot"') == 5


def test_concurrency_records_give_a_requests_in_flight_figure_and_table(tmp_path):
    run = _write_run(tmp_path / "run", evals=False, concurrency=True)
    assert main(["report", str(run)]) == 0
    page = run / "report.html"
    text = page.read_text()
    assert "<h2>Requests in flight per replica</h2>" in text
    assert text.count('<img class="plot"') == 8  # the 7 of a run without them, and this one
    # the table: device 2 was a replica in the 2 steps between the resizes; device 0 in all 6,
    # each window 1.8 s with 1.0 s of tail from 0.6 s and 0.8 s with none in flight
    assert re.search(r"<td[^>]*>0</td><td[^>]*>6</td><td[^>]*>10.8</td>", text)
    assert re.search(r"<td[^>]*>2</td><td[^>]*>2</td><td[^>]*>3.6</td>", text)
    assert_every_figure_renders(page, expected=8)


def test_many_replicas_get_one_strip_each():
    from dynaresize.report import run_figures as rf
    from dynaresize.report.mpl import figure_data_uri

    records = [{"kind": "concurrency", "step": 0, "device": d, **concurrency_summary([(0.0, 1.0 + d)], 0.0, 20.0)}
               for d in range(rf.MAX_PANELS + 4)]
    fig = rf.concurrency_figure(records, [{"t_s": 10.0}])
    assert len(fig.axes) == 2  # the strips and their colour bar
    assert figure_data_uri(fig).startswith("data:image/png;base64,")


def test_simulation_directory_gets_one_section_per_policy(tmp_path):
    sim = tmp_path / "sim"
    assert main(["simulate", "--workload", "longtail-drift", "--devices", "16", "--steps", "24",
                 "--policies", "hysteresis,greedy", "--out", str(sim), "--quiet"]) == 0
    assert main(["report", str(sim)]) == 0
    text = (sim / "report.html").read_text()
    assert "Policy hysteresis" in text and "Policy greedy" in text and "allocation.png" in text
    assert "Device timeline" not in text  # the simulator records no spans
    assert_every_figure_renders(sim / "report.html")


def test_verdict_catches_a_figure_that_does_not_decode(tmp_path):
    run = _write_run(tmp_path / "run", evals=False)
    assert main(["report", str(run)]) == 0
    page = run / "report.html"
    text = page.read_text()
    assert text.count('<img class="plot"') == 7
    page.write_text(re.sub(r'(id="fig-2"[^>]*src=")[^"]*', r"\1data:image/png;base64,AAAA", text, count=1))
    assert browser_verdict(page) == "figures failed: fig-2"


@pytest.mark.parametrize("setup, needle", [
    (lambda d: None, "no such run directory"),
    (lambda d: d.mkdir(), "not a run directory (no records.jsonl)"),
    (lambda d: (d.mkdir(), (d / "records.jsonl").write_text('{"kind": "config", "config": {}}\nnot json\n{}\n')),
     "records.jsonl:2: bad JSON"),
    (lambda d: (d.mkdir(), (d / "records.jsonl").write_text('{"kind": "step", "step": 0}\n')),
     "records.jsonl:1: step record lacks t_start_s"),
    (lambda d: (d.mkdir(), (d / "records.jsonl").write_text('[1, 2]\n')), "records.jsonl:1: not a record"),
    (lambda d: (d.mkdir(), (d / "records.jsonl").write_text('{"kind": "config", "config": {}}\n')),
     "no step records"),
])
def test_missing_or_malformed_run_dir_is_one_line_exit_2(tmp_path, capsys, setup, needle):
    run = tmp_path / "run"
    setup(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynaresize: error: ") and needle in err
    assert "Traceback" not in err and not (run / "report.html").exists()


def test_a_last_line_cut_by_a_killed_run_is_skipped(tmp_path):
    run = _write_run(tmp_path / "run", evals=False)
    with open(run / "records.jsonl", "a") as fh:
        fh.write('{"kind": "span", "device": 0, "na')  # no newline: the run died mid-write
    assert main(["report", str(run)]) == 0
