"""The figure of `dynaresize advise --out DIR`: DIR/advise.png.

Left: the logged stage times per step against the fitted ones (what the calibration
reproduces). Right: the predicted throughput of every static split, with the logged split as
reproduced, hysteresis and the oracle as lines.
"""

from __future__ import annotations

from pathlib import Path

from dynaresize.report.mpl import pyplot, save_figure


def write_figure(prep, ans: dict, rollout: int, devices: int, path: Path) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    cal = prep.calibration
    roll, train = [s.step for s in prep.rollout_steps], [s.step for s in prep.train_steps]
    a.plot(roll, [s.rollout_s for s in prep.rollout_steps], "o", ms=3, color="tab:blue", label="rollout, logged")
    a.plot(roll, cal.rollout_fit_s, "-", color="tab:blue", label="rollout, fitted")
    a.plot(train, [s.train_s for s in prep.train_steps], "o", ms=3, color="tab:orange", label="training, logged")
    a.plot(train, cal.train_fit_s, "-", color="tab:orange", label="training, fitted")
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.set_title(f"stage times (rollout error {cal.rollout_error:.1%}, training {cal.train_error:.1%})")
    a.legend(fontsize=8)
    xs = [s["rollout"] for s in ans["static"]]
    b.plot(xs, [s["samples_per_s"] for s in ans["static"]], "o-", ms=3, color="tab:gray", label="static splits")
    b.axhline(ans["reproduced"], color="tab:red", ls="--",
              label="logged " + ("(colocated)" if rollout >= devices else f"split ({rollout})") + ", reproduced")
    b.axhline(ans["hysteresis"]["samples_per_s"], color="tab:green", label=f"hysteresis ({ans['hysteresis']['moves']} moves)")
    b.axhline(ans["oracle"]["samples_per_s"], color="tab:purple", ls=":", label="oracle")
    b.set_xlabel("rollout devices")
    b.set_ylabel("samples/s (predicted)")
    b.set_title("the same job on every split")
    b.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
