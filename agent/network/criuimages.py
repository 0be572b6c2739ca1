"""What a dump's criu images say, read without criu: a protobuf reader small enough to trust.

A criu image is two 32-bit magics, then its entries, each a 32-bit size (host order) and a
protobuf message (criu's images/*.proto; some images follow an entry with raw data, which the
caller skips).  Only what revenant needs is read: the inet sockets of ``files.img``, which say
what the epoch's job listened on and the connections it held, exactly as criu recorded them,
after the dump, with the job no longer frozen (agent/network/netstate.py reads the same of a running job).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

from revenant.agent.network.netstate import address

HEADER = 8  # the two magics
FILES = "files.img"
_INETSK = 4  # fd_types.INETSK (images/fdinfo.proto); file_entry.isk is field 4
_LISTEN, _ESTABLISHED = 10, 1  # the kernel's TCP states
_WORDS = {socket.AF_INET: 1, socket.AF_INET6: 4}


def varint(buf: bytes, i: int) -> tuple[int, int]:
    """The base-128 varint at ``buf[i]`` and the index after it; raises IndexError if cut."""
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(msg: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a protobuf message: an int for a varint or fixed
    field, the bytes of a length-delimited one; raises IndexError or ValueError if malformed."""
    i = 0
    while i < len(msg):
        key, i = varint(msg, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(msg, i)
            yield number, value
        elif wire == 2:
            size, i = varint(msg, i)
            if i + size > len(msg):
                raise IndexError("field runs past its message")
            yield number, msg[i:i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(msg):
                raise IndexError("field runs past its message")
            yield number, int.from_bytes(msg[i:i + width], "little")
            i += width
        else:
            raise ValueError(f"protobuf wire type {wire}")


def entries(data: bytes) -> Iterator[bytes]:
    """Each entry of an image that holds entries only (no raw data after them)."""
    i = HEADER
    while i + 4 <= len(data):
        (size,) = struct.unpack_from("=I", data, i)  # criu writes its sizes in host order
        if i + 4 + size > len(data):
            raise IndexError("the image's last entry is cut short")
        yield data[i + 4:i + 4 + size]
        i += 4 + size


def _address(family: int, words: list[int], port: int) -> str:
    # Each word holds the address's bytes as criu read them from the kernel: packed back in host order.
    return address(family, socket.inet_ntop(family, b"".join(struct.pack("=I", w) for w in words)), port)


def _socket(isk: bytes) -> tuple[str, str]:
    """("tcp 0.0.0.0:6379" if it listens or is bound to receive, else ""; "local -> peer" if it is
    an established TCP connection, else "") of one inet_sk_entry (images/sk-inet.proto)."""
    v: dict[int, int] = {}
    src: list[int] = []
    dst: list[int] = []
    for number, value in fields(isk):
        if number == 11 and isinstance(value, int):
            src.append(value)
        elif number == 12 and isinstance(value, int):
            dst.append(value)
        elif isinstance(value, int):
            v[number] = value
    family, kind, state, sport, dport = v.get(3), v.get(4), v.get(6), v.get(7, 0), v.get(8, 0)
    if family not in _WORDS or len(src) != _WORDS[family]:
        return "", ""
    local = _address(family, src, sport)
    if kind == socket.SOCK_STREAM and state == _LISTEN:
        return f"tcp {local}", ""
    if kind == socket.SOCK_DGRAM and sport and not dport:
        return f"udp {local}", ""
    if kind == socket.SOCK_STREAM and state == _ESTABLISHED and len(dst) == _WORDS[family]:
        return "", f"{local} -> {_address(family, dst, dport)}"
    return "", ""


def inet_sockets(images: Path, limit: int) -> tuple[list[str], list[str]]:
    """(listening, connections) of the dump in ``images``, as agent/network/netstate.py names them, each
    sorted and at most ``limit`` long; raises OSError if the image cannot be read, ValueError if
    it is malformed."""
    listening, connections = set(), set()
    try:
        for entry in entries((images / FILES).read_bytes()):
            found = dict(fields(entry))
            isk = found.get(4)
            if found.get(1) == _INETSK and isinstance(isk, bytes):
                listens, connection = _socket(isk)
                listening.update([listens] if listens else [])
                connections.update([connection] if connection else [])
    except IndexError as exc:
        raise ValueError(f"{FILES} is malformed: {exc}") from None
    return sorted(listening)[:limit], sorted(connections)[:limit]
