"""`dynaresize report`: the HTML page of a run directory and of a simulation directory.

Runs on records written here (no Ray): a synthetic run with spans, two resizes with their ops,
eval records and a summary, and a small simulation. Checks the page is self-contained (every
figure a data URI, no external script, style or link), that headless Chromium decodes every
figure, that the headline table is the page's first thing (in Chromium's first screen too) with
the simulator's prediction for an emulated run, the whole summary last and collapsed, and that a
missing or malformed directory is one line and exit 2.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from dynaresize.cli import main
from dynaresize.config_load import build_config, config_to_dict
from dynaresize.metrics import NO_PREDICTION_UNPACED, headline_rows
from dynaresize.pipeline.concurrency import concurrency_summary
from dynaresize.records import Recorder

from _browser import assert_every_figure_renders, browser_divs, browser_verdict

STEPS = 6


SUMMARY = {"steps": STEPS, "ledger_ok": True, "ledger_problems": [], "reward_by_step": [0.1] * STEPS,
           "faults_unfired": ["kill:2@resize.reshard:9"], "samples_per_s": 3.5, "total_time_s": 10.8,
           "idle_fraction": 0.125, "tail_idle_fraction": 0.03, "resizes": 2, "resizes_to_rollout": 1,
           "resizes_to_train": 1, "reward_first": 0.05, "reward_last": 0.45, "emulate": None,
           "time_unit": "wall seconds"}
# An emulated job the simulator can predict (6 A100s, a 7B model, starting at 2 rollout devices).
EMULATED = {"steps": STEPS, "cluster": {"devices": 6, "rollout_devices": 2, "emulate": "a100:7b"}}


def _write_run(out: Path, *, evals: bool = True, concurrency: bool = False, config: dict | None = None,
               summary: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with Recorder(out / "records.jsonl") as rec:
        rec.emit("config", config=config or {"steps": STEPS})
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
        rec.emit("summary", summary=summary or SUMMARY)
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


def _headline(text: str) -> list[tuple[str, str, str]]:
    """The (figure, value, unit) rows of the page's first headline table."""
    table = re.search(r'<table id="headline" class="headline">(.*?)</table>', text).group(1)
    rows = re.findall(r'<tr><th scope="row">([^<]*)</th><td class="num">([^<]*)</td><td>([^<]*)</td></tr>', table)
    return [tuple(html.unescape(c) for c in row) for row in rows]


def test_the_headline_comes_first_in_chromium_and_the_whole_summary_last_collapsed(tmp_path):
    run = _write_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    page = run / "report.html"
    text = page.read_text()
    first_table, first_img = text.index("<table"), text.index("<img")
    assert text.index('<table id="headline"') == first_table < first_img
    assert _headline(text) == headline_rows(SUMMARY, no_prediction=NO_PREDICTION_UNPACED)
    assert dict((f, v) for f, v, _ in _headline(text)) == {
        "throughput": "3.500", "run time": "10.8", "gain over static": "n/a", "resizes": "2", "idle": "12.5%",
        "tail idle": "3.0%", "reward": "0.050 -> 0.450", "ledger": "ok"}
    assert "Times are wall seconds." in text
    summary_at = text.index('<details class="summary">')
    assert summary_at > text.rindex("<img") and summary_at > text.index("Faults (1)")
    details = text[summary_at:text.index("</details>", summary_at)]
    assert f"Every field of the summary ({len(SUMMARY)})" in details
    assert all(f"<td>{key}</td>" in details for key in SUMMARY)
    assert text.count("<td>reward_by_step</td>") == 1  # the raw fields only there
    shown = browser_divs(page, "verdict", "first-shown")
    assert shown == {"verdict": "figures ok: 7/7", "first-shown": "headline in the first screen"}


def test_an_emulated_runs_headline_has_the_simulators_prediction_of_its_config(tmp_path):
    from dynaresize.driver.console import closing_summary
    from dynaresize.emulate.predict import headline_prediction

    cfg = build_config(EMULATED)
    summary = {**SUMMARY, "emulate": "a100:7b", "time_unit": "emulated seconds (a100:7b: ...)", "samples_per_s": 0.2}
    run = _write_run(tmp_path / "run", evals=False, config=config_to_dict(cfg), summary=summary)
    assert main(["report", str(run)]) == 0
    text = (run / "report.html").read_text()
    pred = headline_prediction(cfg)
    rows = {f: (v, u) for f, v, u in _headline(text)}
    assert rows["gain over static"][0] == f"{0.2 / pred.static_samples_per_s:.2f}x"
    assert f"{pred.static_samples_per_s:.3f} samples per emulated s" in rows["gain over static"][1]
    assert f"({pred.start_rollout} rollout)" in rows["gain over static"][1]
    assert rows["vs prediction"][0] == f"{0.2 / pred.policy_samples_per_s:.3f}"
    assert rows["throughput"] == ("0.200", "samples per emulated s")
    # `dynaresize run` ends with the same rows, from the same function
    console = closing_summary({**summary, "devices": 6, "rollout_devices_final": 2, "world_inits_max": 1,
                               "groups_created": 0, "groups_created_critical": 0}, "RUN", prediction=pred)
    for figure, value, unit in _headline(text):
        assert f"{figure:<18}{value}  {unit}" in console.splitlines()


def test_a_config_the_simulator_cannot_rebuild_gives_no_prediction_and_says_why(tmp_path):
    config = config_to_dict(build_config(EMULATED))
    config["cluster"]["rollout_devices"] = 99
    run = _write_run(tmp_path / "run", evals=False, config=config, summary={**SUMMARY, "emulate": "a100:7b"})
    assert main(["report", str(run)]) == 0
    rows = {f: (v, u) for f, v, u in _headline((run / "report.html").read_text())}
    assert rows["gain over static"][0] == "n/a" and "cannot rebuild this run's job today" in rows["gain over static"][1]
    assert "cluster.rollout_devices=99" in rows["gain over static"][1] and "vs prediction" not in rows


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
    # each policy's headline: simulated seconds, resizes each way counted from its resize records
    for i, policy in enumerate(("hysteresis", "greedy")):
        resizes = [json.loads(x) for x in (sim / policy / "records.jsonl").read_text().splitlines()
                   if json.loads(x)["kind"] == "resize"]
        table = re.search(rf'<table id="headline{"" if i == 0 else "-2"}"(.*?)</table>', text).group(1)
        to_rollout = sum(r["to_role"] == "rollout" for r in resizes)
        assert (f'<td class="num">{len(resizes)}</td><td>{to_rollout} to rollout, {len(resizes) - to_rollout} to '
                f'train</td>') in table
        assert "samples per simulated s" in table and "gain over static" not in table and "ledger" not in table
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
