"""A tiny HTTP/1.1 server for ``/metrics`` and the health endpoints, on the agent's own loop.

GET (and HEAD) only, one request per connection (``Connection: close``), a
bounded request head, and timeouts on every read, write and handler, so a slow
or hostile client costs a socket and nothing more.  Handlers are coroutines
returning ``(status, content_type, body)``; they run on the event loop and must
not block it.  Port 0 picks a free port; :attr:`HttpServer.url` says which.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Awaitable, Callable, Mapping

from revenant.common.errors import RevenantError

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]
Handler = Callable[[], Awaitable[Response]]

TEXT = "text/plain; charset=utf-8"


class HttpServerError(RevenantError):
    code = "http_server"


class HttpServer:
    def __init__(self, routes: Mapping[str, Handler], host: str = "127.0.0.1", port: int = 0, *,
                 max_request_bytes: int = 8192, timeout_s: float = 5.0, max_connections: int = 64) -> None:
        for path in routes:
            if not path.startswith("/"):
                raise ValueError(f"route {path!r} must start with '/'")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is not in 0..65535")
        self.routes = dict(routes)
        self.host, self._port = host, port
        self.max_request_bytes = max_request_bytes
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._stopped = False

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and listen; a no-op when already started or after stop()."""
        if self._server is not None or self._stopped:
            return
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self._port,
                                                      limit=self.max_request_bytes)
        except OSError as exc:
            raise HttpServerError(f"cannot listen on {self.host}:{self._port}: {exc.strerror or exc}") from None
        log.info("HTTP endpoints on %s", self.url)

    async def stop(self) -> None:
        """Stop listening and drop open connections; idempotent and safe before start()."""
        self._stopped = True
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> HttpServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            if len(self._clients) > self.max_connections:
                method, response = "GET", (503, TEXT, b"too many connections\n")
            else:
                method, response = await self._respond(reader)
            if response is not None:
                await self._send(writer, method, response)
                if response[0] >= 400:
                    await self._linger(reader, writer)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or dawdled: nothing to answer
        except asyncio.CancelledError:
            # stop() cancelled us.  Ending quietly matters: asyncio 3.11 calls
            # task.exception() on this task and would log the cancellation as a crash.
            if not self._stopped:
                raise
        finally:
            self._clients.discard(task)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), self.timeout_s)
            except (ConnectionError, asyncio.TimeoutError):
                pass

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, Response | None]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
        except asyncio.LimitOverrunError:
            return "GET", (431, TEXT, b"request head too large\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return "GET", None  # connected and closed without a word (a port check)
            return "GET", (400, TEXT, b"incomplete request\n")
        parsed = parse_request_line(head)
        if parsed is None:
            return "GET", (400, TEXT, b"malformed request line\n")
        method, path = parsed
        if method not in ("GET", "HEAD"):
            return method, (405, TEXT, b"only GET and HEAD\n")
        handler = self.routes.get(path)
        if handler is None:
            return method, (404, TEXT, f"no such endpoint; try {', '.join(sorted(self.routes))}\n".encode())
        try:
            return method, await asyncio.wait_for(handler(), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("handler for %s took longer than %g s", path, self.timeout_s)
            return method, (503, TEXT, b"handler timed out\n")
        except Exception:
            log.exception("handler for %s failed", path)
            return method, (500, TEXT, b"internal error\n")

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read what the client still sends until it closes (bounded).

        Closing a socket with unread input makes the kernel send a reset,
        which can destroy the error response before the client reads it.
        """
        if writer.can_write_eof():
            writer.write_eof()
        try:
            async with asyncio.timeout(min(self.timeout_s, 1.0)):
                discarded = 0
                while discarded < 16 * self.max_request_bytes:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    discarded += len(chunk)
        except (asyncio.TimeoutError, ConnectionError):
            pass

    async def _send(self, writer: asyncio.StreamWriter, method: str, response: Response) -> None:
        status, content_type, body = response
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n")
        if status == 405:
            head += "Allow: GET, HEAD\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + (b"" if method == "HEAD" else body))
        await asyncio.wait_for(writer.drain(), self.timeout_s)


def parse_request_line(head: bytes) -> tuple[str, str] | None:
    """(method, path without query) from a request head, or None if it is not HTTP/1.x."""
    line = head.split(b"\r\n", 1)[0]
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return None
    if not version.startswith("HTTP/1.") or not method.isalpha() or not target.startswith("/"):
        return None
    return method.upper(), target.split("?", 1)[0]
