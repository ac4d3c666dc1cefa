"""docs/config.md documents every config field (so the docs stay true as fields are added)."""

import dataclasses
import typing
from pathlib import Path

from dynaresize.config import RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _paths(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_field_is_documented():
    text = DOC.read_text()
    missing = [p for p in _paths(RunConfig) if f"`{p}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}"
