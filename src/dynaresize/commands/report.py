"""`dynaresize report RUN_DIR`: one self-contained HTML page about a run.

Writes RUN_DIR/report.html (or --out FILE): first the headline table (the figures `dynaresize
run` ends with: throughput, gain over the static split and the simulator's prediction, resizes,
idle, reward, ledger), then the split over time, stage times, idle breakdown, reward (and eval),
the device timeline, every resize with its ops, and last the whole summary, collapsed; figures are
inlined, so the page opens anywhere without a network. RUN_DIR is a `dynaresize run` directory
or a `dynaresize simulate` output directory (one section per policy). A missing or malformed
directory is one line on stderr and exit 2. See `dynaresize.report.html`.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html: one self-contained page about a run",
                       description="Write one self-contained HTML page (figures inlined, no network needed) "
                       "about a run directory or a simulation output directory.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `dynaresize run` or `dynaresize simulate` directory")
    p.add_argument("--out", metavar="FILE", help="where to write the page (default: RUN_DIR/report.html)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from dynaresize.report.html import write_report

    path = write_report(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0
