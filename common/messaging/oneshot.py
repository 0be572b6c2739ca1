"""One request and its reply over a plain socket, for a command that asks once and exits.

Starting the NATS client library (nats-py, with asyncio and its JetStream API) costs a one-shot
CLI command most of its own time; the answer takes milliseconds.  :func:`request` speaks the few
frames one request needs: INFO, CONNECT (the nonce signed, as the library would), SUB on the
asker's own inbox, PUB, and the MSG that answers (or the 503 status frame that says nothing
listens).  The servers of a comma-separated URL are tried in turn.  A server that requires TLS
raises :class:`NeedsLibrary`: the caller asks through the library instead.

The reply is decoded as :func:`revenant.common.messaging.bus.request` decodes it (:func:`reply_of`):
an ``error.v1`` raises :class:`RemoteError` with its code."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse
from typing import TypeVar

from revenant.common.errors import BusError, NoResponders, RemoteError, RequestTimeout
from revenant.common.messaging.handshake import refused, signed_connect
from revenant.messages import ErrorReply, Message, MessageError, decode, decode_as, encode

M = TypeVar("M", bound=Message)
MAX_LINE = 65536


class NeedsLibrary(BusError):
    """What this path does not speak (TLS): ask through the NATS client library."""

    code = "needs_library"


def reply_of(subject: str, data: bytes, reply_type: type[M]) -> M:
    """A reply's payload as ``reply_type``; an ``error.v1`` as :class:`RemoteError`."""
    try:
        reply = decode(data)
    except MessageError as exc:
        raise RemoteError(f"bad reply on {subject}: {exc}", code=exc.code) from None
    if isinstance(reply, ErrorReply):
        raise RemoteError(reply.message, code=reply.code, retriable=reply.retriable)
    return decode_as(data, reply_type)


class _Conn:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""

    def _fill(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise ConnectionError("a line longer than the protocol allows")
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data


def servers(url: str, plain_only: bool = True) -> list[tuple[str, int]]:
    """The (host, port) of each server of a comma-separated ``url``; one that is not nats:// (TLS)
    raises :class:`NeedsLibrary` unless ``plain_only`` is False."""
    out = []
    for part in (u.strip() for u in url.split(",")):
        if not part:
            continue
        u = urllib.parse.urlsplit(part if "://" in part else f"nats://{part}")
        if u.scheme != "nats" and plain_only:
            raise NeedsLibrary(f"{part}: only nats:// is spoken here")
        out.append((u.hostname or "127.0.0.1", u.port or 4222))
    if not out:
        raise BusError(f"no NATS server in {url!r}")
    return out


def request(url: str, subject: str, msg: Message, reply_type: type[M], timeout_s: float, *,
            creds: str | None = None, inbox_prefix: str | None = None, name: str = "revenant-cli") -> M:
    """Ask ``subject`` once on the first server of ``url`` that takes the connection."""
    deadline = time.monotonic() + timeout_s
    failures = []
    for host, port in servers(url):
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, min(5.0, deadline - time.monotonic())))
        except OSError as exc:
            failures.append(f"{host}:{port}: {exc.strerror or exc}")
            continue
        try:
            return _ask(_Conn(sock, deadline), url, subject, msg, reply_type, timeout_s, creds, inbox_prefix, name)
        finally:
            sock.close()
    raise BusError(f"cannot connect to NATS at {url}: {'; '.join(failures)}")


def _ask(conn: _Conn, url: str, subject: str, msg: Message, reply_type: type[M], timeout_s: float,
         creds: str | None, inbox_prefix: str | None, name: str) -> M:
    inbox = f"{inbox_prefix or '_INBOX'}.{os.urandom(11).hex()}"
    try:
        line = conn.line()
        if not line.startswith(b"INFO "):
            raise BusError(f"not a NATS server: it said {line[:80]!r}")
        info = json.loads(line[5:])
        if info.get("tls_required"):
            raise NeedsLibrary("the server requires TLS")
        connect = signed_connect(info, name, creds, headers=True)
        payload = encode(msg)
        conn.sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\n" + f"SUB {inbox} 1\r\n".encode()
                          + f"PUB {subject} {inbox} {len(payload)}\r\n".encode() + payload + b"\r\nPING\r\n")
        while True:
            line = conn.line()
            if line.startswith(b"MSG "):
                return reply_of(subject, conn.exactly(int(line.split()[-1])), reply_type)
            if line.startswith(b"HMSG "):
                head_len, total = (int(x) for x in line.split()[-2:])
                frame = conn.exactly(total)
                if b" 503" in frame[:head_len].split(b"\r\n", 1)[0]:
                    raise NoResponders(f"nothing is listening on {subject}")
                return reply_of(subject, frame[head_len:], reply_type)
            if line.startswith(b"-ERR"):
                why = line[4:].strip(b" '").decode(errors="replace")
                if "authorization violation" in why.lower():
                    raise refused(url, creds, why)
                # The server's word on this request (a permission, a size): asking again changes nothing.
                raise BusError(f"request on {subject} refused: {why}", code="nats_refused", retriable=False)
            if line == b"PING":
                conn.sock.sendall(b"PONG\r\n")
    except TimeoutError:
        raise RequestTimeout(f"no reply on {subject} within {timeout_s:g} s") from None
    except (OSError, ValueError) as exc:
        raise BusError(f"request on {subject} failed: {exc}") from None
