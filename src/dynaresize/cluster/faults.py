"""Fault injection for tests and demos: `KIND:DEVICE@POINT:STEP` (config `faults`, CLI `--inject`).

KIND `kill`: the worker process dies (`os._exit`), as on a crashed device. KIND `stop`: the
whole worker process freezes (SIGSTOP: every thread, Ray's too), as on a hung host; it answers
nothing, so only timeouts can find it. KIND `node`: the whole Ray node hosting the device dies: its
raylet is killed (SIGKILL), which takes every worker of the node and its object store with it,
as on a lost machine (docs/cluster.md). Every device of that node is lost at once; the fault
explains all of them and counts as one fault. It is refused for a device on the driver's node
(that would end the run, not test its recovery). DEVICE is the device id of the run's first
generation (the id records use; it never changes after a recovery renumbers the ranks).

POINTS and STEPS: `rollout` S = generating the samples of step S (overlapped with training of
step S-1); `train` S, `weight_sync` S = the training step S and the sync of its result;
`resize.reshard` S, `resize.switch` S = the resize decided after step S (it applies before
step S+1): moving trainer state, switching the role of the moving devices.

How a fault fires "whatever the device is doing at that moment":
- every worker is armed at start with its faults (`arm_fault`); a worker that takes part in
  the point fires inside the method that carries it out (`_maybe_fault`), mid-work;
- when the driver reaches the point (`reach`), a faulted device that takes no part in it is
  told to fire now (`fault_now`, on its `ctl` thread, which runs beside any work).

`fire` is the one place a fault happens in a worker process.

A fault fires at most once, when the driver reaches its point with its device alive. One
whose point the run never reaches (a step past the end, a resize that is never decided, a
device already lost) stays unfired: `FaultInjector.unfired` lists it, the run's summary says
so in `faults_unfired`, and `dynaresize run` warns about it on stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dynaresize.config import FaultSpec, parse_fault
from dynaresize.errors import ConfigError, UserError


def fire(kind: str) -> None:
    """Make this process fail as `kind` says (called inside a worker)."""
    if kind == "node":
        _kill_raylet()
        os._exit(17)
    if kind == "kill":
        os._exit(17)  # no cleanup, no goodbye: what a crashed device looks like to its peers
    if hasattr(signal, "SIGSTOP"):
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops where it is
    while True:  # no SIGSTOP on this platform: hang the calling thread instead
        time.sleep(3600)


def _kill_raylet() -> None:
    """SIGKILL this worker's raylet (its parent process: the raylet starts the node's workers),
    after checking that the parent is one; the node's other workers and its object store go with it."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # no /proc: ask psutil (a Ray dependency) instead
        try:
            import psutil

            cmd = " ".join(psutil.Process(ppid).cmdline())
        except Exception:  # noqa: BLE001
            cmd = ""
    if "raylet" not in cmd:
        print(f"dynaresize: node fault: parent process {ppid} is not a raylet ({cmd[:80]!r}); "
              "only this worker dies", file=sys.stderr, flush=True)
        return
    os.kill(ppid, signal.SIGKILL)


def spec_text(spec: FaultSpec) -> str:
    """The `KIND:DEVICE@POINT:STEP` text of a fault."""
    return f"{spec.kind}:{spec.device}@{spec.point}:{spec.step}"


def parse_faults(specs: Iterable[str], num_devices: int) -> list[FaultSpec]:
    """Parse and check fault specs against the device count; ConfigError lists every bad one."""
    out, errors = [], []
    for text in specs:
        try:
            spec = parse_fault(text)
        except ValueError as exc:
            errors.append(f"faults={text!r}: {exc}")
            continue
        if spec.device >= num_devices:
            errors.append(f"faults={text!r}: device {spec.device} outside 0..{num_devices - 1}")
        out.append(spec)
    if errors:
        raise ConfigError(errors)
    return out


@dataclass
class Armed:
    spec: FaultSpec
    fired_t: float | None = None  # when the driver reached the point (the fault fired then)
    node: str | None = None  # node faults: the Ray node of the device (set at start)
    attributed: bool = False  # matched to a detected loss
    recovered: bool = False  # the run went on without it


@dataclass
class FaultInjector:
    """Driver side of fault injection for one run (see the module docstring)."""

    specs: list[FaultSpec]
    faults: list[Armed] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # Ray node id by device id (set_nodes)

    def __post_init__(self) -> None:
        self.faults = [Armed(s) for s in self.specs]

    def set_nodes(self, nodes: list[str], *, driver_node: str | None = None) -> None:
        """Where each device id runs (`nodes[device]`, Ray node ids), for node faults; UserError
        for a node fault on the driver's node."""
        for a in self.faults:
            if a.spec.kind == "node":
                a.node = nodes[a.spec.device]
                if a.node == driver_node:
                    raise UserError(f"faults={spec_text(a.spec)!r}: device {a.spec.device} runs on the driver's node; "
                                    "killing that node ends the run (use a multi-node cluster whose other nodes hold "
                                    "the device, e.g. cluster.placement_strategy=SPREAD; docs/cluster.md)")
        self.nodes = list(nodes)

    def arm(self, worker_of: Callable[[int], Any]) -> list[Any]:
        """Arm every fault on its device's worker; returns the refs to wait on."""
        return [worker_of(a.spec.device).arm_fault.remote(a.spec.kind, a.spec.point, a.spec.step)
                for a in self.faults]

    def reach(self, point: str, step: int, participants: Iterable[int], worker_of: Callable[[int], Any],
              alive: Callable[[int], bool]) -> None:
        """The run reached `point` of `step`; `participants` (device ids) carry it out.

        A faulted participant fires inside its own call; any other faulted device fires now.
        """
        members = set(participants)
        for a in self.faults:
            s = a.spec
            if a.fired_t is not None or s.point != point or s.step != step or not alive(s.device):
                continue
            a.fired_t = time.time()
            if s.device not in members:
                worker_of(s.device).fault_now.remote(s.kind)

    def attribute(self, device: int) -> Armed | None:
        """The injected fault that explains the loss of `device`, if any: a kill or stop explains
        the loss of its own device once; a node fault, that of every device of its node."""
        for a in self.faults:
            if a.spec.device == device and a.fired_t is not None and not a.attributed:
                a.attributed = True
                return a
        for a in self.faults:
            if a.node is not None and a.fired_t is not None and self.nodes[device] == a.node:
                a.attributed = True
                return a
        return None

    @property
    def num_fired(self) -> int:
        return sum(1 for a in self.faults if a.fired_t is not None)

    def unfired(self) -> list[str]:
        """The faults that have not fired (yet), as `KIND:DEVICE@POINT:STEP`."""
        return [spec_text(a.spec) for a in self.faults if a.fired_t is None]
