"""docs/config.md documents every config field (so the docs stay true as fields are added)."""

from pathlib import Path

from dynaresize.config import RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _paths(cls, prefix=""):
    from dynaresize.config_load import field_paths

    return field_paths(cls, prefix)


def test_every_field_is_documented():
    text = DOC.read_text()
    missing = [p for p in _paths(RunConfig) if f"`{p}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}"
