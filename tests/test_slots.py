"""agent/checkpointing/slots.py: the node's checkpoint slots shared fairly between users (issue 44:
one user's slow checkpoints kept another's waiting 20 s, past its reply's grant)."""

from __future__ import annotations

import asyncio

import pytest

from revenant.agent.checkpointing.slots import FairSlots

pytestmark = pytest.mark.unit


async def test_a_freed_slot_goes_to_the_next_user_in_turn_not_to_the_busiest():
    pool = FairSlots(2)
    granted: list[str] = []
    a1, a2 = await pool.acquire("alice"), await pool.acquire("alice")  # alice holds both

    async def want(user: str, tag: str) -> None:
        slot = await pool.acquire(user)
        granted.append(tag)
        await asyncio.sleep(0)
        slot.release()

    waiters = [asyncio.create_task(want("alice", f"alice{i}")) for i in range(3, 7)]
    await asyncio.sleep(0)
    waiters.append(asyncio.create_task(want("bob", "bob1")))
    await asyncio.sleep(0)
    assert pool.waiting() == {"alice": 4, "bob": 1}
    a1.release()  # alice's oldest waiter is first in turn ...
    a2.release()  # ... and bob's is next, ahead of alice's three others
    await asyncio.gather(*waiters)
    assert granted[:2] == ["alice3", "bob1"], granted
    assert granted == ["alice3", "bob1", "alice4", "alice5", "alice6"]
    assert pool.free == 2 and pool.waiting() == {}


async def test_a_slot_given_back_early_is_not_given_back_twice_and_a_cancelled_wait_leaves_no_trace():
    pool = FairSlots(1)
    held = await pool.acquire("alice")
    cancelled = asyncio.create_task(pool.acquire("bob"))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert pool.waiting() == {}
    held.release()  # criu done: the copies and the commit go on without it
    held.release()
    assert pool.free == 1
    async with await pool.acquire("carol") as slot:
        assert pool.free == 0
        slot.release()
        assert pool.free == 1
    assert pool.free == 1
