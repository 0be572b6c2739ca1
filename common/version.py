"""revenant's version: pyproject.toml's, as pip recorded it (editable install or wheel)."""

from __future__ import annotations



def version() -> str:
    from importlib import metadata  # only when asked: it costs a one-shot command a tenth of its start

    try:
        return metadata.version("revenant")
    except metadata.PackageNotFoundError:
        return "0+unknown"
