"""Chrome trace (Perfetto) from a run's records: one track per device.

Read only: takes `span` and `op` records (seconds from the run start) and writes the Chrome
trace-event JSON format (`ph: "X"` complete events, microseconds) that ui.perfetto.dev and
chrome://tracing open. Ops of a resize go on the device's track with `cat` "resize" and their
critical flag in `args`, so overlap of background ops with the next step's compute is visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def trace_events(records: Iterable[dict]) -> list[dict]:
    events: list[dict] = []
    devices: set[int] = set()
    for rec in records:
        kind = rec.get("kind")
        if kind == "span":
            dev = int(rec["device"])
            devices.add(dev)
            events.append({
                "name": rec["name"], "cat": rec.get("cat", "stage"), "ph": "X", "pid": 0, "tid": dev,
                "ts": rec["start_s"] * 1e6, "dur": max(0.0, rec["end_s"] - rec["start_s"]) * 1e6,
                "args": {k: v for k, v in rec.items() if k not in ("kind", "device", "name", "start_s", "end_s")},
            })
        elif kind == "op":
            dev = int(rec["device"])
            devices.add(dev)
            events.append({
                "name": rec["name"], "cat": "resize.critical" if rec["critical"] else "resize.background",
                "ph": "X", "pid": 0, "tid": dev, "ts": rec["start_s"] * 1e6,
                "dur": max(0.0, rec["end_s"] - rec["start_s"]) * 1e6,
                "args": {"resize_id": rec["resize_id"], "bytes": rec["bytes"], "critical": rec["critical"]},
            })
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
            for d in sorted(devices)]
    meta.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "dynaresize"}})
    return meta + sorted(events, key=lambda e: (e["tid"], e["ts"]))


def write_trace(records: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace_events(records), "displayTimeUnit": "ms"}))
    return path
