"""Small windows over steps: a rolling window of values, a persistence counter, and the move
history that defines a reversal.

A *reversal* is a move whose direction (+1: toward rollout, -1: toward training) undoes the
previous move's direction within `window` steps of it (A -> B -> A flapping). The controller
forbids them for policies that declare a reversal window, and the simulator counts them for
every policy with the same definition.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class RollingWindow:
    """The last `size` values; mean, median and least-squares slope per step."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.values: deque[float] = deque(maxlen=size)

    def push(self, value: float) -> None:
        self.values.append(float(value))

    def clear(self) -> None:
        self.values.clear()

    def __len__(self) -> int:
        return len(self.values)

    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0

    def median(self) -> float:
        if not self.values:
            return 0.0
        s = sorted(self.values)
        m = len(s) // 2
        return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])

    def noise_sd(self) -> float:
        """Step-to-step noise: sqrt(mean squared first difference / 2), blind to a linear trend."""
        v = list(self.values)
        if len(v) < 3:
            return 0.0
        return (sum((b - a) ** 2 for a, b in zip(v, v[1:])) / (2.0 * (len(v) - 1))) ** 0.5

    def slope(self) -> float:
        """Least-squares change per step over the window (0 with fewer than 3 values)."""
        n = len(self.values)
        if n < 3:
            return 0.0
        xm = (n - 1) / 2.0
        ym = self.mean()
        num = sum((i - xm) * (v - ym) for i, v in enumerate(self.values))
        den = sum((i - xm) ** 2 for i in range(n))
        return num / den


@dataclass
class Persistence:
    """Counts consecutive steps a signal held in one direction (hysteresis arming)."""

    count: int = 0
    direction: int = 0

    def update(self, direction: int, armed_above_enter: bool, above_exit: bool) -> int:
        """`direction` of the wanted move; arm on enter, hold while above exit, else disarm."""
        if direction == 0 or not (armed_above_enter or (self.count > 0 and above_exit)):
            self.count, self.direction = 0, 0
        elif direction != self.direction:
            self.count, self.direction = (1, direction) if armed_above_enter else (0, 0)
        else:
            self.count += 1
        return self.count

    def reset(self) -> None:
        self.count, self.direction = 0, 0


@dataclass
class MoveHistory:
    """Steps and directions of the moves made so far."""

    moves: list[tuple[int, int]] = field(default_factory=list)  # (step, direction)

    def last(self) -> tuple[int, int] | None:
        return self.moves[-1] if self.moves else None

    def would_reverse(self, step: int, direction: int, window: int) -> bool:
        last = self.last()
        return last is not None and direction == -last[1] and step - last[0] < window

    def record(self, step: int, direction: int) -> None:
        self.moves.append((step, direction))

    def count_reversals(self, window: int) -> int:
        return sum(1 for (s0, d0), (s1, d1) in zip(self.moves, self.moves[1:]) if d1 == -d0 and s1 - s0 < window)
