"""revenant's wire protocol: typed, versioned messages, subjects and the codec.

This package is pure: no I/O and no NATS import.  Everything on the bus is a
msgspec Struct tagged with ``"<kind>.v<version>"`` and encoded as a MessagePack
map, so any MessagePack library can read it.
"""

from revenant.messages.codec import (
    MAX_MESSAGE_BYTES,
    HeartbeatView,
    decode,
    decode_as,
    decode_capabilities,
    decode_heartbeat,
    encode,
)
from revenant.messages.errors import (
    MalformedMessage,
    MessageError,
    OversizedMessage,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
)
from revenant.messages import types as _types
from revenant.messages.types import *  # noqa: F401,F403
from revenant.messages.types import MESSAGE_TYPES

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MESSAGE_TYPES",
    "HeartbeatView",
    "MalformedMessage",
    "MessageError",
    "OversizedMessage",
    "UnexpectedMessage",
    "UnknownMessageType",
    "UnsupportedVersion",
    "decode",
    "decode_as",
    "decode_capabilities",
    "decode_heartbeat",
    "encode",
    *_types.__all__,
]
