"""The base of every tagged top-level message (messages/types.py, messages/agentcmds.py)."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, kw_only=True, tag_field="type"):
    """Base of every tagged top-level message."""
