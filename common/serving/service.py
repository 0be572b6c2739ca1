"""One lifecycle for every long-lived part of revenant (the agent, the coordinator, their parts).

A :class:`Service` has a status, runs until asked to stop, and owns its background
tasks in an :class:`asyncio.TaskGroup`:

* ``run()`` starts it (``_start``), serves until ``stop()`` is called or a background
  task fails, then shuts it down (``_shutdown``) and re-raises that task's error;
* ``stop()`` asks it to stop: safe to call twice, and before ``run()`` (which then
  returns at once), so a signal handler can call it at any time (during ``_start``
  it takes effect once the start is done);
* ``async with service:`` runs it in a task of its own and waits until it is ready;
  leaving the block stops it and waits for the shutdown to finish.

``_shutdown`` runs however ``run()`` ends (a stop, a failed start, a failed background
task, a cancellation), after the background tasks have ended, and must cope with a
start that got only part of the way.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Coroutine, TypeVar

from revenant.common.cancelling import cancel_until_done

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServiceStatus(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Service:
    # Whether ``ready`` is set once ``_start`` returns; a service that is ready only later
    # (a coordinator, once it leads) sets it itself.
    ready_after_start = True

    def __init__(self) -> None:
        self.status = ServiceStatus.NEW
        # Set once started and serving; tests and embedders wait on it.
        self.ready = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._runner: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ for subclasses

    async def _start(self) -> None:
        """Connect, subscribe, spawn background tasks with :meth:`spawn`."""

    async def _shutdown(self) -> None:
        """Release what ``_start`` acquired (drain, close); runs however ``run()`` ends."""

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start a background task owned by this service: its failure stops the service, and a
        shutdown cancels it.  Only while the service is starting or running."""
        if self._group is None:
            coro.close()
            raise RuntimeError(f"{type(self).__name__} is not running; cannot start {name}")
        task = self._group.create_task(coro, name=name)
        if self.status is ServiceStatus.STOPPING:
            task.cancel()  # too late: the group is winding down and would wait for it
            return task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------ the lifecycle

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def stop(self) -> None:
        """Ask the service to stop; idempotent, and safe before :meth:`run`."""
        self._stop_requested.set()

    async def run(self) -> None:
        if self.status is not ServiceStatus.NEW:
            raise RuntimeError(f"{type(self).__name__} runs once")
        if self._stop_requested.is_set():
            self.status = ServiceStatus.STOPPED
            return
        self.status = ServiceStatus.STARTING
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                await self._start()
                self.status = ServiceStatus.RUNNING
                if self.ready_after_start:
                    self.ready.set()
                await self._stop_requested.wait()
                self.status = ServiceStatus.STOPPING
                await cancel_until_done(list(self._background), type(self).__name__)
        except BaseExceptionGroup as group_error:
            # A background task failed: raise its own error, not the group.
            raise _first(group_error, type(self).__name__) from None
        finally:
            self._group = None
            self.status = ServiceStatus.STOPPING
            self.ready.clear()
            try:
                await self._shutdown()
            finally:
                self.status = ServiceStatus.STOPPED

    async def __aenter__(self: T) -> T:
        assert isinstance(self, Service)
        self._runner = asyncio.create_task(self.run(), name=f"{type(self).__name__}.run")
        ready = asyncio.create_task(self.ready.wait())
        try:
            await asyncio.wait({self._runner, ready}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled while starting: nobody would own the service, so it stops here.
            self.stop()
            await asyncio.shield(asyncio.wait({self._runner}))
            raise
        finally:
            ready.cancel()
        if self._runner.done():
            self._runner.result()  # a failed start raises here
            raise RuntimeError(f"{type(self).__name__} stopped while starting")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
        if self._runner is not None:
            await self._runner


def _first(group_error: BaseExceptionGroup, service: str) -> BaseException:
    """The first error of the group; the others are logged, not lost."""
    errors: list[BaseException] = []
    pending: list[BaseException] = [group_error]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = list(exc.exceptions)
        else:
            errors.append(exc)
    for other in errors[1:]:
        log.error("%s: another background task failed too: %r", service, other)
    return errors[0]


async def supervised(loop_fn) -> None:
    """Run a background loop forever: a bug or a bus error restarts it, never the whole service."""
    while True:
        try:
            await loop_fn()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting it in 1 s", getattr(loop_fn, "__qualname__", loop_fn))
            await asyncio.sleep(1.0)
