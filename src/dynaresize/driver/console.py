"""What a run shows on its console: the progress bar and one-line notes beside it.

A note goes to stderr through the bar (`tqdm.write`), so it never cuts into the bar's line; it
is for what the user must see while the run goes on (a refused resize, say), while records
carry everything for tools.
"""

from __future__ import annotations

import sys
from typing import Any


def say(line: str) -> None:
    """One line on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def progress_bar(total: int, enabled: bool, initial: int = 0) -> Any:
    """The run's progress bar over its steps (disabled: a bar that shows nothing)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="dynaresize run", unit="step", disable=not enabled,
                dynamic_ncols=True)
