"""What a run shows on its console: the progress bar, one-line notes beside it, and the closing
summary.

A note goes to stderr through the bar (`tqdm.write`), so it never cuts into the bar's line; it
is for what the user must see while the run goes on (a refused resize, say), while records
carry everything for tools. The closing summary opens with the run's headline
(`metrics.headline_rows`, the rows `dynaresize report` puts first), then how it ran.
"""

from __future__ import annotations

import sys
from typing import Any

from dynaresize.metrics import Prediction, headline_rows


def say(line: str) -> None:
    """One line on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def progress_bar(total: int, enabled: bool, initial: int = 0) -> Any:
    """The run's progress bar over its steps (disabled: a bar that shows nothing)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="dynaresize run", unit="step", disable=not enabled,
                dynamic_ncols=True)


def closing_summary(s: dict, out: str, *, prediction: Prediction | None = None, no_prediction: str = "",
                    best_static: tuple[int, float] | None = None) -> str:
    """The lines `dynaresize run` prints at the end: the headline (with the simulator's
    `prediction` for an emulated run, `no_prediction` saying why there is none), the best fixed
    split in hindsight when given, then the run's engines, communicators, overhead and faults."""
    lines = [f"run directory     {out}",
             f"steps x devices   {s['steps']} x {s['devices']}  (final split {s['rollout_devices_final']} rollout)"]
    lines += [f"{name:<18}{value}  {unit}" for name, value, unit in
              headline_rows(s, prediction, no_prediction=no_prediction)]
    if best_static is not None:
        lines.append(f"best static       {best_static[1]:.3f}  samples per emulated s: the simulator's best fixed "
                     f"split in hindsight ({best_static[0]} rollout)")
    lines += [
        f"engines           rollout {s.get('rollout_engine', '?')}"
        + (f" (auto: {s['rollout_engine_why']})" if s.get("rollout_engine_why") else "")
        + f", training FSDP2 {s.get('train_dtype', '?')}",
        f"communicators     world inits {s['world_inits_max']}, groups created {s['groups_created']} "
        f"(on a resize's critical path: {s['groups_created_critical']})",
    ]
    if "overhead_s" in s:
        lines.append(f"time unit         {s['time_unit']}" + (f"; wall {s['wall_time_s']:.0f} s with startup"
                                                              if s.get("emulate") else ""))
        lines.append(f"overhead          {s['overhead_s']:.1f} s of {s['steps_time_s']:.1f} s "
                     f"({s['overhead_fraction']:.1%}: driver, controller, Ray)"
                     + (f"; steps that overran their paced time: {s['overrun_steps']}" if s.get("emulate") else ""))
    if s.get("faults_injected") or s.get("recoveries"):
        times = ", ".join(f"{r['recovery_s']:.1f}s" for r in s.get("recoveries", []))
        lines.append(f"faults            injected {s['faults_injected']}, recovered {s['faults_recovered']}  "
                     f"(recoveries: {times or 'none'}; devices now {s['devices_final']})")
    return "\n".join(lines)
