"""`dynaresize bench` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="(not yet implemented)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    print("dynaresize bench: not implemented yet")
    return 1
