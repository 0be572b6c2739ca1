"""A criu action script waiting on the agent, over two FIFOs: the script says a word (and what
criu tells it), the agent answers "ok" or anything else, and the script goes on or fails.

The agent holds both FIFOs open read-write from the start, so neither side ever blocks in
open(); the script's wait for the answer is bounded (``timeout_s``), so an agent that never
answers fails criu's step instead of hanging it.  The restore's check uses it (agent/checkpointing/engine.py):
criu runs the post-restore script when every process is restored but still root's, before it
gives them the job's credentials, and aborts (killing them) if the script fails.  So nothing,
not even the job's user sending SIGCONT, runs the job before the agent has looked at what criu
made.  (Not pre-resume: criu ignores that script's failure, and a kill while criu still traces
the processes leaves it waiting on them for ever.)
"""

from __future__ import annotations

import asyncio
import os
import shlex
from pathlib import Path


class Handshake:
    def __init__(self, scratch: Path, name: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.fifo_in = scratch / f"{name}.said.fifo"
        self.fifo_out = scratch / f"{name}.answer.fifo"
        os.mkfifo(self.fifo_in, 0o600)
        os.mkfifo(self.fifo_out, 0o600)
        self._in = os.open(self.fifo_in, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._out = os.open(self.fifo_out, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._buf = b""

    def script_lines(self, said: str) -> list[str]:
        """Shell that writes ``said`` (expanded by the shell: "$CRTOOLS_INIT_PID" works), waits at
        most ``timeout_s`` for the answer, and exits 1 unless it is "ok"."""
        q_in, q_out = shlex.quote(str(self.fifo_in)), shlex.quote(str(self.fifo_out))
        return [f'echo "{said}" > {q_in}',
                f"r=$(timeout {max(1, int(self.timeout_s))} sh -c 'head -n 1 < \"$0\"' {q_out})",
                '[ "$r" = ok ] || exit 1']

    async def heard(self) -> str:
        """The script's first line (waits as long as it takes: cancel it when criu exits)."""
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            ready = loop.create_future()
            loop.add_reader(self._in, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(self._in)
            try:
                self._buf += os.read(self._in, 4096)
            except BlockingIOError:
                continue
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def answer(self, word: str) -> None:
        os.write(self._out, word.encode() + b"\n")

    def close(self) -> None:
        for fd in (self._in, self._out):
            try:
                os.close(fd)
            except OSError:
                pass
