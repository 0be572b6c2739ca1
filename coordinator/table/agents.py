"""Commands from the coordinator to node agents, over the bus.

One request per command, tracked by node: when a node is declared dead (or
leaves), every request in flight to it fails at once with :class:`NodeLost`
instead of waiting out its timeout.  A leader whose lease is not fresh sends
nothing (:class:`NotLeader`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

from nats.aio.client import Client

from revenant.common.errors import RevenantError
from revenant.common.messaging import bus
from revenant.coordinator.table import lifecycle as lc
from revenant.messages import AgentJobReply, KillJob, Message, RestoreJob, StartJob, CheckpointJob, subjects

log = logging.getLogger(__name__)


class NodeLost(RevenantError):
    code = "node_lost"
    retriable = True


class NotLeader(RevenantError):
    code = "not_leader"
    retriable = True


class LeaderGuard(Protocol):
    def fresh(self) -> bool:
        """May this coordinator act now (it leads, and its lease is fresh)?"""

    def holds(self) -> Awaitable[bool | None]:
        """Does the store say this coordinator leads (None: it could not be asked)?"""

    def step_down(self, why: str) -> None: ...


def check_may_act(may_act: Callable[[], bool]) -> None:
    if not may_act():
        raise NotLeader("this coordinator's leader lease is not fresh (its loop stalled, or the store "
                        "is slow to answer): it does not act")


class AgentClient:
    def __init__(self, nc: Client, may_act: Callable[[], bool],
                 incarnation_of: Callable[[str], str] = lambda node: "", term: Callable[[], int] = lambda: 0) -> None:
        self.nc = nc
        self.may_act = may_act
        self.term = term  # this leader's term, in every command's TERM_HEADER (0: none sent)
        self.incarnation_of = incarnation_of  # the node's agent as its heartbeats last named it
        # Requests in flight by node, each with the incarnation of the agent it was sent to.
        self._inflight: dict[str, dict[asyncio.Task[AgentJobReply], str]] = {}
        self._lost: dict[asyncio.Task[AgentJobReply], str] = {}

    async def send(self, node: str, verb: str, msg: Message, timeout_s: float) -> AgentJobReply:
        check_may_act(self.may_act)
        task = asyncio.ensure_future(
            bus.request(self.nc, subjects.node_command(node, verb), msg, AgentJobReply, timeout_s,
                        {subjects.TERM_HEADER: str(self.term())} if self.term() else None))
        self._inflight.setdefault(node, {})[task] = self.incarnation_of(node)
        try:
            return await task
        except asyncio.CancelledError:
            reason = self._lost.pop(task, None)
            if reason is None:
                raise
            raise NodeLost(f"node {node} {reason} during {verb}") from None
        finally:
            self._inflight.get(node, {}).pop(task, None)

    async def carry_out(self, cmd: lc.Command, timeout_s: float) -> AgentJobReply:
        """Send one of the lifecycle's commands to its node."""
        if isinstance(cmd, lc.Start):
            return await self.send(cmd.node, "start", StartJob(spec=cmd.spec, generation=cmd.generation,
                                                               fresh=cmd.fresh, gpus=list(cmd.gpus)), timeout_s)
        if isinstance(cmd, lc.Restore):
            return await self.send(cmd.node, "restore", RestoreJob(spec=cmd.spec, generation=cmd.generation,
                                                                   leave_workdir=cmd.leave_workdir, epoch=cmd.epoch,
                                                                   gpus=list(cmd.gpus)),
                                   timeout_s)
        if isinstance(cmd, lc.Checkpoint):
            return await self.send(cmd.node, "checkpoint", CheckpointJob(job=cmd.job, generation=cmd.generation,
                                                                         stop=cmd.stop, scheduled=cmd.scheduled,
                                                                         force=cmd.force, evict=cmd.evict,
                                                                         cause=cmd.cause, reasons=list(cmd.reasons)),
                                   timeout_s)
        return await self.send(cmd.node, "kill", KillJob(job=cmd.job, generation=cmd.generation, reason=cmd.reason,
                                                         signal=cmd.signal, grace_s=cmd.grace_s), timeout_s)

    async def abandon(self, node: str, job: str, generation: int, why: str) -> None:
        """Make sure an attempt whose reply never came (a timeout, a lost node) does not live on:
        the agent kills that generation, even if its start or restore is still in flight."""
        try:
            await self.send(node, "kill", KillJob(job=job, generation=generation, reason=why), 5.0)
        except RevenantError as exc:
            log.info("job %s: no kill of generation %d on %s (%s)", job, generation, node, exc)

    def node_lost(self, node: str, reason: str, spare: str = "") -> None:
        """Fail every request in flight to ``node`` (it was declared dead or left), but those sent
        to its agent of incarnation ``spare``: an agent that has just started asks the leader (its
        first reconcile, sent again until answered) after it may have been given work, which it
        answers; only what was asked of an earlier agent is lost with it."""
        for task, sent_to in list(self._inflight.get(node, {}).items()):
            if spare and sent_to == spare:
                continue
            self._lost[task] = reason
            task.cancel()

    def connection_lost(self) -> None:
        """Fail every request in flight: this coordinator's connection to NATS broke and came
        back, and a reply sent meanwhile is lost for good (nothing sends it again), so waiting for
        one would wait out its timeout (an hour for a restore).  Each caller lets that attempt go
        (the node kills it) and, for a failover, makes another."""
        for node in list(self._inflight):
            self.node_lost(node, "may have answered unheard (this coordinator's connection to NATS broke)")
