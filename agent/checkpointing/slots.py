"""The node's checkpoint slots, shared fairly between users.

A slot is what a dump or a restore holds while criu runs (``checkpoint_concurrency`` of them,
2 by default).  Handed out first come, first served, one user with many slow checkpoints would
keep every other user's waiting behind them.  Here each user waits in a queue of their own, and a
freed slot goes to the next user in turn (round robin over the users waiting), oldest request
first within a user.  A holder gives its slot back as soon as criu is done with the job
(:meth:`Slot.release`): what follows, copying the working directory's changed files and
committing the epoch, is the job's own background work and holds no slot.

Pure asyncio, no clock: tests/test_slots.py.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque


class Slot:
    """A slot held; given back once (:meth:`release`, or leaving the ``async with``)."""

    def __init__(self, pool: "FairSlots") -> None:
        self._pool = pool
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._pool._freed()

    async def __aenter__(self) -> "Slot":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class FairSlots:
    def __init__(self, n: int) -> None:
        self.free = max(1, n)
        # Users waiting, in turn order; each with its waiters, oldest first.
        self._waiting: OrderedDict[str, deque[asyncio.Future[Slot]]] = OrderedDict()

    def waiting(self) -> dict[str, int]:
        return {user: len(q) for user, q in self._waiting.items()}

    async def acquire(self, user: str) -> Slot:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return Slot(self)
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(user, deque()).append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                fut.result().release()  # granted as it was cancelled: handed on
            else:
                q = self._waiting.get(user)
                if q is not None and fut in q:
                    q.remove(fut)
                    if not q:
                        del self._waiting[user]
            raise

    def _freed(self) -> None:
        while self._waiting:
            user, q = next(iter(self._waiting.items()))
            fut = q.popleft()
            del self._waiting[user]
            if q:
                self._waiting[user] = q  # to the back of the turn
            if not fut.done():
                fut.set_result(Slot(self))
                return
        self.free += 1
