"""Helpers shared by the in-process agent and coordinator tests (a real nats-server, no cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from revenant.common.settings.config import AgentConfig


@contextlib.asynccontextmanager
async def running(service):
    task = asyncio.create_task(service.run())
    ready = asyncio.create_task(service.ready.wait())
    await asyncio.wait([task, ready], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await task  # raises what made it stop
    assert service.ready.is_set(), "service did not become ready"
    try:
        yield service
    finally:
        service.stop()
        await _stopped(service, task)


async def _stopped(service, task: asyncio.Task, bound_s: float = 45.0) -> None:
    """Wait for ``task`` (the service's run) to end; past the generous ``bound_s`` (a loaded
    2-core machine drains slowly) fail naming where it was stuck."""
    done, _ = await asyncio.wait([task], timeout=bound_s)
    if not done:
        where = "".join(f"\n  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                        for frame in _awaiting(task.get_coro()))
        task.cancel()
        raise AssertionError(f"{type(service).__name__} did not stop within {bound_s:g} s; stuck at:{where}")
    await task


def _awaiting(coro):
    """The frames of a suspended coroutine and of what it awaits, outermost first."""
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        yield coro.cr_frame
        coro = coro.cr_await


class HeldLease:
    """A leader lease that is always fresh and held (a JobService driven in-process)."""

    def fresh(self) -> bool:
        return True

    async def holds(self) -> bool:
        return True

    def step_down(self, why: str) -> None:
        raise AssertionError(why)


def image_keys(tmp_path):
    """The image keys of a test's cluster (agent/storage/imagekeys.py), made once per test."""
    from revenant.agent.storage import imagekeys

    path = tmp_path / "image.keys"
    path.parent.mkdir(parents=True, exist_ok=True)
    imagekeys.write(path)
    return path


def agent_config(nats_url, tmp_path, node="node-1", **kw):
    kw.setdefault("image_keys", str(image_keys(tmp_path)))  # one test's agents: one cluster, one key
    kw.setdefault("allow_root_jobs", True)  # the suite's jobs run as root (tests/test_job_user.py: as a user)
    return AgentConfig(node=node, nats_url=nats_url, storage=str(tmp_path / "storage"),
                       heartbeat_interval_s=0.2, http_port=0, **kw)


async def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


async def until(predicate, timeout: float = 60.0) -> None:
    """Wait for a plain (not awaitable) ``predicate``; fails the test past ``timeout`` (generous:
    a bound on a protocol, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _states(nodes, want):
    table = await nodes()
    if table and {n.name: n.state for n in table} == want:
        return table
    return None


# The property tests' example counts, scaled: `make test` runs each at full strength; `make
# test-fast` (REVENANT_TEST_EXAMPLES=0.2) a fifth of them, at least 20, so that the unit tier
# stays quick enough to run before every commit.
EXAMPLES_SCALE = float(os.environ.get("REVENANT_TEST_EXAMPLES", "1"))


def examples(n: int) -> int:
    """``max_examples`` for a property test that runs ``n`` at full strength."""
    return n if EXAMPLES_SCALE >= 1 else max(20, min(n, round(n * EXAMPLES_SCALE)))
