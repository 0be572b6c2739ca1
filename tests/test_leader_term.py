"""A leader's term (coordinator/nodes/leader.py Term): its tasks stop as one when it ends, even a task
that swallowed its cancellation (Python 3.11's wait_for can, where nats-py awaits)."""

from __future__ import annotations

import asyncio

import pytest

from revenant.coordinator.nodes.leader import Term

pytestmark = pytest.mark.unit


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again_until_it_ends():
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # what a wait_for whose result just arrived does

    term = Term(1)
    task = term.add(asyncio.create_task(stubborn()))
    await asyncio.sleep(0)
    term.end()
    await asyncio.wait_for(asyncio.wait({task}), 3)
    assert task.cancelled() and swallowed and not term.tasks and term.over.is_set()


async def test_a_task_added_after_the_end_is_cancelled_at_once():
    term = Term(2)
    term.end()
    term.end()  # twice is harmless
    task = term.add(asyncio.create_task(asyncio.sleep(10)))
    await asyncio.wait({task}, timeout=1)
    assert task.cancelled() and not term.tasks
