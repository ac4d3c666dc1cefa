"""Policies: decide from step reports whether to move devices (pure; no I/O, no clock)."""

from dynaresize.policy.base import Policy, make_policy

__all__ = ["Policy", "make_policy"]
