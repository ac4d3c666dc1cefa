"""The launch path users take on a Ray cluster: `ray start --head`, then `ray job submit`.

A Ray head on loopback with its dashboard and job server (`ray[default]`, the `cluster`
extra), a 3-device `dynaresize run` submitted as a job, its ledger checked, and the head
stopped whatever happens: only the processes this test started are ended (their process
group), never another Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]
BIN = Path(sys.executable).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(url_port: int, timeout_s: float, head: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", url_port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{url_port} after {timeout_s} s: {log.read_text()[-2000:]}")


@pytest.mark.skipif(shutil.which("ray", path=str(BIN)) is None, reason="the `ray` CLI is not installed here")
def test_ray_job_submit_runs_the_job_with_its_ledger_whole(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the job finds its cluster itself
    env.update(RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    gcs, dashboard = _port(), _port()
    temp = tempfile.mkdtemp(prefix="dr-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         "--num-cpus=4", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = tmp_path / "run"
    try:
        _wait_for(dashboard, 180, head, tmp_path / "ray_start.log")
        for _ in range(12):  # the dashboard answers before its job agent is up: Ray says to try again later
            job = subprocess.run(
                [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--",
                 str(BIN / "dynaresize"), "run", "--devices", "3", "--steps", "3", "--no-progress", "--out", str(out)],
                env=env, capture_output=True, text=True, timeout=900)
            if "No available agent to submit job" not in job.stderr:
                break
            time.sleep(5)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout + job.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ledger_ok"] is True and summary["steps"] == 3
        assert "ledger            ok" in job.stdout
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        # The head's processes share its session (process group): none may be left.
        time.sleep(2)
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
