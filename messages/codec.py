"""Encoding and decoding: msgspec structs <-> MessagePack maps.

Decoding never raises anything but :class:`~revenant.messages.errors.MessageError`.
"""

from __future__ import annotations

import re
from typing import TypeVar, Union

import msgspec

from revenant.messages.errors import (
    MalformedMessage,
    OversizedMessage,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
)
from revenant.messages.types import MESSAGE_TYPES, Capabilities, HealthSummary, Heartbeat, Message

# Big data never rides the bus: images stay on storage, messages carry paths.
# 256 KiB leaves room under NATS's default 1 MiB max_payload.
MAX_MESSAGE_BYTES = 256 * 1024

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[MESSAGE_TYPES])  # type: ignore[valid-type]
_raw_decoder = msgspec.msgpack.Decoder()
_TAG_RE = re.compile(r"^(?P<kind>[a-z_]+)\.v(?P<version>[0-9]+)$")
_KNOWN: dict[str, int] = {}
for _t in MESSAGE_TYPES:
    _m = _TAG_RE.match(_t.__struct_config__.tag)
    assert _m, _t
    _KNOWN[_m["kind"]] = max(_KNOWN.get(_m["kind"], 0), int(_m["version"]))


def tag_of(cls: type[Message]) -> str:
    return cls.__struct_config__.tag


def encode(msg: Message) -> bytes:
    """Encode a message, refusing one too large for the bus."""
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise OversizedMessage(len(data), MAX_MESSAGE_BYTES)
    return data


def decode(data: bytes) -> Message:
    """Decode any known message, or raise a typed :class:`MessageError`."""
    return _decoded(_decoder, data)


def _decoded(decoder: msgspec.msgpack.Decoder, data: bytes):
    """``decoder``'s result for ``data``, or the most specific :class:`MessageError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise OversizedMessage(len(data), MAX_MESSAGE_BYTES)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise _explain(data, exc) from None
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:  # pragma: no cover - defensive
        raise MalformedMessage(f"undecodable message: {exc}") from None


def decode_as(data: bytes, cls: type[M]) -> M:
    """Decode a message that must be of type ``cls``."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise UnexpectedMessage(
            f"expected {tag_of(cls)}, got {tag_of(type(msg))}", tag=tag_of(type(msg))
        )
    return msg


def _explain(data: bytes, exc: msgspec.DecodeError) -> Exception:
    """Turn msgspec's error into the most specific MessageError."""
    try:
        raw = _raw_decoder.decode(data)
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError, RecursionError):
        return MalformedMessage(f"not MessagePack: {exc}")
    if not isinstance(raw, dict):
        return MalformedMessage(f"expected a map, got {type(raw).__name__}")
    tag = raw.get("type")
    if not isinstance(tag, str):
        return MalformedMessage("message has no string 'type' field")
    m = _TAG_RE.match(tag)
    if m is None or m["kind"] not in _KNOWN:
        return UnknownMessageType(f"unknown message type {tag[:64]!r}", tag=tag[:64])
    known = _KNOWN[m["kind"]]
    if int(m["version"]) != known and f"{m['kind']}.v{m['version']}" not in _ALL_TAGS:
        newer = int(m["version"]) > known
        return UnsupportedVersion(
            f"{tag} is {'newer' if newer else 'older'} than this peer reads ({m['kind']}.v{known})"
            + ("; upgrade revenant" if newer else "; upgrade the sender"),
            tag=tag,
        )
    return MalformedMessage(f"invalid {tag}: {exc}", tag=tag)


_ALL_TAGS = frozenset(tag_of(t) for t in MESSAGE_TYPES)


NIL = b"\xc0"
# A view's capabilities when its heartbeat left them out: this very object (``is`` tells it).
LEFT_OUT = msgspec.Raw(NIL)


class HeartbeatView(msgspec.Struct, kw_only=True, tag_field="type", tag="heartbeat.v2"):
    """A heartbeat as a high-rate reader takes it: every field of :class:`Heartbeat`, but the
    capabilities left encoded (:data:`LEFT_OUT` when the heartbeat has none, nil if it says so).  They change about never, so a
    reader that holds a node's capabilities compares these bytes with the ones it decoded last
    instead of decoding them again (tests/test_messages.py keeps the fields in step)."""

    node: str
    seq: int
    sent_at: float
    incarnation: str
    pid: int = 0
    interval_s: float = 1.0
    capabilities: msgspec.Raw = LEFT_OUT
    health: HealthSummary | None = None
    leaving: bool = False


class HeartbeatViewV1(HeartbeatView, tag="heartbeat.v1"):
    """:class:`~revenant.messages.types.HeartbeatV1` likewise (its health is never nil)."""


_view_decoder = msgspec.msgpack.Decoder(Union[HeartbeatView, HeartbeatViewV1])
# The bare decode, for a reader that takes a great many: msgspec's own errors, no size check.
decode_heartbeat_view = _view_decoder.decode
_capabilities_decoder = msgspec.msgpack.Decoder(Capabilities)


def decode_heartbeat(data: bytes) -> HeartbeatView:
    """A heartbeat with its capabilities still encoded (see :class:`HeartbeatView`)."""
    try:
        return _decoded(_view_decoder, data)
    except MalformedMessage as err:  # another known message on a heartbeat subject: say so
        if err.tag in _ALL_TAGS and not err.tag.startswith("heartbeat."):
            raise UnexpectedMessage(f"expected {tag_of(Heartbeat)}, got {err.tag}", tag=err.tag) from None
        raise


def decode_capabilities(raw: bytes | msgspec.Raw) -> Capabilities | None:
    """A heartbeat's capabilities from :attr:`HeartbeatView.capabilities` (None for nil)."""
    data = bytes(raw)
    if data == NIL or not data:
        return None
    try:
        return _capabilities_decoder.decode(data)
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise MalformedMessage(f"invalid heartbeat capabilities: {exc}", tag=tag_of(Heartbeat)) from None
