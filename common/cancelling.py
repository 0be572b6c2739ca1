"""Cancelling asyncio tasks so that they end: Python 3.11's ``asyncio.wait_for`` returns the result
of what it awaited when that finished as the cancellation came, so a loop around it can lose a
cancellation and carry on.  A stop that waits for such a task would wait for ever."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Collection

log = logging.getLogger(__name__)


async def cancel_until_done(tasks: Collection[asyncio.Task[Any]], what: str, every_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again, every ``every_s``, any
    still running (logged, with ``what`` the owner's name).  Their outcomes are left to their owners."""
    running = {t for t in tasks if not t.done()}
    for task in running:
        task.cancel()
    while running:
        _, running = await asyncio.wait(running, timeout=every_s)
        for task in running:
            log.warning("%s: task %s still running after its cancellation; cancelling it again", what, task.get_name())
            task.cancel()
