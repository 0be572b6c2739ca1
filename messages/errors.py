"""The one exception root for wire-protocol problems."""

from __future__ import annotations


class MessageError(Exception):
    """A message could not be encoded or decoded.

    ``retriable`` is always False: sending the same bytes again cannot help.
    """

    retriable = False
    code = "bad_message"

    def __init__(self, message: str, *, tag: str | None = None) -> None:
        super().__init__(message)
        self.tag = tag


class MalformedMessage(MessageError):
    """Not MessagePack, not a map with a ``type`` field, or fields of the wrong shape."""

    code = "malformed"


class OversizedMessage(MessageError):
    """Larger than :data:`revenant.messages.codec.MAX_MESSAGE_BYTES`."""

    code = "oversized"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message is {size} bytes, over the {limit}-byte limit")
        self.size = size
        self.limit = limit


class UnknownMessageType(MessageError):
    """A ``type`` tag that this version of revenant has never heard of."""

    code = "unknown_type"


class UnsupportedVersion(MessageError):
    """A known kind of message at a version this peer cannot read."""

    code = "unsupported_version"


class UnexpectedMessage(MessageError):
    """A valid message of a different type than the one this subject carries."""

    code = "unexpected_type"
