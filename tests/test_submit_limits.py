"""Limits are checked before anything happens: a submit whose record could not be stored or
replied to is refused with one line naming the limit, and no job starts; numbers out of range
are one line too, at the CLI and again at the coordinator (never a traceback)."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import VENV_BIN, revenant_cli
from helpers import agent_config, cli_env, connect_as, coordinator_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import RemoteError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.messages import MAX_MESSAGE_BYTES, JobReply, SubmitRequest, encode, subjects

pytestmark = [pytest.mark.nats, pytest.mark.criu]


def one_line_error(out) -> str:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr


def just_fitting_request() -> SubmitRequest:
    """A submit 16 bytes under the message limit (arguments under the kernel's 128 KiB each)."""
    request = SubmitRequest(argv=["sh", "-c", "sleep 30", "x" * 125_000, "y" * 125_000], workdir="/")
    request.argv[-1] += "y" * (MAX_MESSAGE_BYTES - 16 - len(encode(request)))
    assert len(encode(request)) == MAX_MESSAGE_BYTES - 16
    return request


async def _cli(*args: str, url: str):
    # In a thread: the coordinator answers from this process's event loop.
    return await asyncio.to_thread(revenant_cli, *args, env=cli_env(url))  # root's CLI: admin


async def _ready(coord: Coordinator) -> bool:
    return any(n.state == "alive" and n.capabilities.criu.ok for n in coord.detector.snapshot(time.monotonic()))


@pytest.fixture
async def cluster(nats_url, tmp_path):
    """A coordinator and one agent with criu, in this process: a submit that passed would run."""
    agent = Agent(agent_config(nats_url, tmp_path, criu_path=str(VENV_BIN / "criu")))
    async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord, running(agent):
        await wait_for(lambda: _ready(coord), timeout=30)
        nc = await connect_as(nats_url, security.ADMIN)  # another client of admin's
        try:
            yield coord, agent, nc
        finally:
            await nc.close()


async def test_an_oversized_argv_is_refused_at_submit_and_nothing_starts(cluster, nats_url):
    coord, agent, nc = cluster
    # The CLI refuses before sending: 3 arguments of 90 KB (each under the kernel's 128 KiB per argument).
    big = ["x" * 90_000] * 3
    err = one_line_error(await _cli("submit", "--", "echo", *big, url=nats_url))
    assert "the limit is 131,072 bytes (128 KiB" in err, err
    # And the coordinator refuses what another client sends: a request that just fits one message,
    # whose record's reply would not.  Before, the job ran while the client got an error.
    request = just_fitting_request()
    with pytest.raises(RemoteError, match=r"the limit is 131,072 bytes \(128 KiB") as refused:
        await bus.request(nc, subjects.coordinator("submit"), request, JobReply, 10)
    assert refused.value.code == "too_large"
    await asyncio.sleep(0.5)  # a job that had been started would show by now
    assert coord.jobs.jobs == {} and agent.supervisor.jobs == {}
    assert (await _cli("jobs", url=nats_url)).stdout.strip() == "no jobs"
    # Just under the limit is fine, and its reply fits.
    ok = SubmitRequest(argv=["true", "x" * 120_000], workdir="/")
    reply = await bus.request(nc, subjects.coordinator("submit"), ok, JobReply, 10)
    assert reply.job.spec.id == "1"
    await wait_for(lambda: _state(coord, "1", "completed"), timeout=10)


async def _state(coord: Coordinator, job: str, state: str) -> bool:
    return coord.jobs.jobs[job].state == state


async def test_numbers_out_of_range_are_one_line_at_the_cli_and_at_the_coordinator(cluster, nats_url):
    coord, agent, nc = cluster
    # The encoder's OverflowError used to escape as a 32-line traceback.
    err = one_line_error(await _cli("submit", "--max-epochs", "99999999999999999999", "--", "true", url=nats_url))
    assert "--max-epochs must be at most 100, got 99999999999999999999" in err
    err = one_line_error(await _cli("submit", "--checkpoint", "999999999-0", "--", "true", url=nats_url))
    assert "checkpoint interval must be from 1 s to 365 days" in err
    err = one_line_error(await _cli("jobs", "--timeout", "1e999", url=nats_url))
    assert "--timeout must be a finite number" in err
    err = one_line_error(await _cli("submit", "--incremental", "--full-every", "0", "--", "true", url=nats_url))
    assert "--full-every must be a whole number from 1 to 1000, got 0" in err
    for request, message in (
        (SubmitRequest(argv=["true"], max_epochs=2**63 - 1), "--max-epochs must be at most 100"),
        (SubmitRequest(argv=["true"], max_epochs=0), "--max-epochs must be at least 1"),
        (SubmitRequest(argv=["true"], checkpoint_interval_s=float("nan")), "checkpoint interval must be"),
        (SubmitRequest(argv=["true"], checkpoint_interval_s=1e300), "checkpoint interval must be"),
        (SubmitRequest(argv=[]), "nothing to run"),
        (SubmitRequest(argv=["true"], full_every=0), "--full-every must be a whole number from 1 to 1000, got 0"),
        (SubmitRequest(argv=["true"], pre_dump_delay_s=-1.0), "--pre-dump-delay must be a number from 0 to 3600"),
    ):
        with pytest.raises(RemoteError, match=message) as refused:
            await bus.request(nc, subjects.coordinator("submit"), request, JobReply, 10)
        assert refused.value.code == "bad_request" and "\n" not in str(refused.value)
    assert coord.jobs.jobs == {}
