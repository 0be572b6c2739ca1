"""revenant's version: pyproject.toml's, as pip recorded it (editable install or wheel)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("revenant")
    except metadata.PackageNotFoundError:
        return "0+unknown"
