"""What a dump's criu images say, read without criu (agent/pipeline/criuproto.py).

Only what revenant needs is read: the inet sockets of ``files.img``, which say
what the epoch's job listened on and the connections it held, exactly as criu recorded them,
after the dump, with the job no longer frozen (agent/network/netstate.py reads the same of a running job).
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from revenant.agent.network.netstate import address
from revenant.agent.pipeline.criuproto import entries, fields

FILES = "files.img"
_INETSK = 4  # fd_types.INETSK (images/fdinfo.proto); file_entry.isk is field 4
_LISTEN, _ESTABLISHED = 10, 1  # the kernel's TCP states
_WORDS = {socket.AF_INET: 1, socket.AF_INET6: 4}


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
