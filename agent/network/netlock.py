"""A vacated job's TCP connections, held on its node for a restore there.

A dump records a job's connections as sockets to be closed (agent/pipeline/criu.py network_dump_args):
wherever an epoch is restored, its connections come back closed, and the running job never
notices a dump.  One move can do better: a vacate followed by a restart on the same node.  For
a job whose ``connections`` policy is ``keep`` (the default), a vacate on a node where criu can
lock connections with nftables and this agent can remove such a lock (``nft``):

* criu dumps the connections whole (``--tcp-established``: each in repair mode, its queues
  read) under its nftables lock, taken once the job is frozen (the job sends nothing more), and
  leaves the lock in place, since it leaves the job stopped: a table ``inet CRIU-<run id>``
  dropping every packet of those connections, both ways;
* the agent holds that table for ``hold_s`` after the vacate has committed and killed the job:
  its peers hear nothing, as from a job frozen, and a restore of that very epoch on this node
  meanwhile brings each connection back intact (criu's ``--tcp-established`` without
  ``--tcp-close``; criu removes its table itself once they are back, the lock method being the
  dump's), and the peers' retransmissions reach the job again.  A restore that claims the hold
  stops its clock; one that fails lets it go;
* a table criu leaves when the vacate fails after it (a later step, the commit, criu killed)
  goes at once: the job runs on, and so must its connections;
* a hold that ends unused (the job went elsewhere, or nowhere) removes the table: the peers'
  next packets are answered with a reset, and they learn the connection is gone.  An agent that
  stops lets its holds go; one that starts removes the tables an earlier one noted
  (``netlock-held-<node>``), and those that appeared during a vacate the earlier one died in
  (``netlock-dump-<node>-<job>`` names the tables there were before it), so no lock outlives
  the agent that held it.

With ``close``, or where this is not possible, a vacate records its connections to be closed and
its peers see them close when the job is killed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from revenant.agent.pipeline.steps import BaseStep, DumpContext, RestoreContext
from revenant.agent.processes import procs

log = logging.getLogger(__name__)

NFT_TIMEOUT_S = 30.0
CRIU_PREFIX = "CRIU-"
# A hold whose vacate never says it committed (an agent path that does not) still ends.
ARM_GRACE_S = 600.0
_RUN_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def criu_table(images: Path) -> str | None:
    """The table criu's nftables lock made for the dump into ``images``: ``CRIU-<its run id>``,
    cut where criu cuts it (a 32-byte buffer holding "inet CRIU-..."), from its inventory."""
    try:
        found = _RUN_ID.search((images / "inventory.img").read_bytes())
    except OSError:
        return None
    return f"CRIU-{found.group().decode()[:21]}" if found else None


def locate(path: str = "nft") -> str | None:
    """The nft binary: ``path`` if it names one, else found on PATH or in /usr/sbin."""
    return shutil.which(path) or shutil.which(path, path="/usr/sbin:/sbin")


async def run(nft: str, *args: str) -> str:
    """Run nft; "" if it did what it was asked, else its first line of complaint."""
    try:
        done = await procs.run([nft, *args], NFT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"cannot run {nft}: {exc}"
    if done.returncode == 0:
        return ""
    lines = [ln.strip() for ln in done.output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "Error" in ln), lines[0] if lines else f"nft exited {done.returncode}")


async def tables(nft: str, prefix: str) -> list[str]:
    """The inet tables here whose names start with ``prefix``."""
    try:
        done = await procs.run([nft, "list", "tables", "inet"], NFT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return []
    names = [ln.split()[-1] for ln in done.output.splitlines() if ln.startswith("table inet ")]
    return [n for n in names if n.startswith(prefix)] if done.returncode == 0 else []


async def usable(nft: str | None, node: str) -> str:
    """"" if ``nft`` can remove a table here (one made for the purpose), else why not."""
    if nft is None:
        return "no nft binary (Debian package nftables)"
    table = f"revenant-probe-{node}"
    return await run(nft, "add", "table", "inet", table) or await run(nft, "delete", "table", "inet", table)


@dataclass
class Hold:
    """A vacate's lock, held for a restore of its epoch on this node."""

    table: str
    generation: int
    created_at: float
    connections: list[str]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)  # None: claimed by a restore


class NetLockStep(BaseStep):
    name = "netlock"

    def __init__(self, nft: str, node: str, scratch: Path, *, hold_s: float = 60.0) -> None:
        self.nft, self.node, self.hold_s = nft, node, hold_s
        self.scratch = scratch
        self.held_file = scratch / f"netlock-held-{node}"
        self.holds: dict[str, Hold] = {}
        # Restored intact, by job: taken by the restore's reply (:meth:`take_kept`).
        self.kept: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _note_holds(self) -> None:
        """Name every held table in a node-local file, for an agent that starts after this one died."""
        try:
            self.held_file.write_text("".join(f"{h.table}\n" for h in self.holds.values()))
        except OSError as exc:
            log.warning("cannot note the connection locks held: %s", exc)

    def _dump_file(self, job: str) -> Path:
        """Where a vacate under way names the tables there were before it (for :meth:`sweep`)."""
        return self.scratch / f"netlock-dump-{self.node}-{job}"

    async def sweep(self) -> list[str]:
        """Remove the tables an earlier agent noted as held, and those its vacates under way made
        (it died with them, and its criu with it): its holds died with it."""
        try:
            noted = self.held_file.read_text().split()
        except OSError:
            noted = []
        gone = [table for table in noted if not await run(self.nft, "delete", "table", "inet", table)]
        gone += await self._sweep_dumps()
        if gone:
            log.info("let go of %d connection lock(s) an earlier agent held: %s", len(gone), ", ".join(gone))
        self._note_holds()
        return gone

    async def _sweep_dumps(self) -> list[str]:
        """The tables that appeared during an earlier agent's vacates it never saw through: those
        not there before them, and held by no other agent of this host."""
        left = sorted(self.scratch.glob(f"netlock-dump-{self.node}-*"))
        if not left:
            return []
        now = set(await tables(self.nft, CRIU_PREFIX))
        others: set[str] = set()
        for held in self.scratch.glob("netlock-held-*"):
            if held != self.held_file:
                try:
                    others.update(held.read_text().split())
                except OSError:
                    continue
        gone = []
        for path in left:
            try:
                before = set(path.read_text().split())
            except OSError:
                continue
            for table in sorted(now - before - others):
                if not await run(self.nft, "delete", "table", "inet", table):
                    gone.append(table)
            now -= set(gone)
            path.unlink(missing_ok=True)
        return gone

    async def _release(self, table: str) -> None:
        why = await run(self.nft, "delete", "table", "inet", table)
        if why and "No such file" not in why:
            log.error("cannot remove the connection lock %s: %s", table, why)

    async def _drop_hold(self, job: str) -> None:
        hold = self.holds.pop(job, None)
        if hold is not None:
            if hold.timer is not None:
                hold.timer.cancel()
            await self._release(hold.table)
            self._note_holds()

    def _expire(self, job: str, hold: Hold) -> None:
        if self.holds.get(job) is hold:
            log.info("job %s: the %d connection(s) held since its vacate are let go (their peers get a reset)",
                     job, len(hold.connections))
            task = asyncio.ensure_future(self._drop_hold(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ dump

    async def before_dump(self, ctx: DumpContext) -> None:
        await self._drop_hold(ctx.job)  # (a hold outliving a restore elsewhere and a move back)
        ctx.keep_connections = (ctx.stop and self.hold_s > 0
                                and (ctx.policy is None or ctx.policy.connections == "keep"))
        if ctx.keep_connections:  # criu's table is named only in an inventory a killed criu never writes
            ctx.state[self.name] = before = set(await tables(self.nft, CRIU_PREFIX))
            try:  # for the next agent, should this one die with the vacate under way
                self._dump_file(ctx.job).write_text("".join(f"{t}\n" for t in sorted(before)))
            except OSError as exc:
                log.warning("cannot note the connection locks before job %s's vacate: %s", ctx.job, exc)

    async def after_dump(self, ctx: DumpContext) -> None:
        """criu left the job stopped, its connections locked by its table: hold it (its time
        starts once the vacate has committed: :meth:`arm`)."""
        if not ctx.keep_connections:
            return
        try:
            await self._after_dump(ctx)
        finally:
            self._dump_file(ctx.job).unlink(missing_ok=True)

    async def _after_dump(self, ctx: DumpContext) -> None:
        table = await asyncio.to_thread(criu_table, ctx.epoch_tmp)
        if table is None:
            log.error("job %s: criu's connection lock is not named in its images: its connections go", ctx.job)
            await self._release_new(ctx)
            return
        # The connections criu dumped, as the files step read them from its images (this step is last).
        connections = list(ctx.manifest.connections)
        self.holds[ctx.job] = Hold(table, ctx.generation, ctx.manifest.created_at, connections)
        self._arm(ctx.job, self.hold_s + ARM_GRACE_S)  # (until :meth:`arm` says the vacate committed)
        self._note_holds()
        if not connections:
            await self._drop_hold(ctx.job)

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        """The job runs on: its connections must too.  criu removes its lock when the dump itself
        fails, but not when it is killed, nor once it has dumped (a later step or the commit
        failed): that table goes here."""
        if not ctx.keep_connections:
            return
        if ctx.job in self.holds:
            await self._drop_hold(ctx.job)
        elif (table := await asyncio.to_thread(criu_table, ctx.epoch_tmp)) is not None:
            await self._release(table)
        else:
            await self._release_new(ctx)
        self._dump_file(ctx.job).unlink(missing_ok=True)

    async def _release_new(self, ctx: DumpContext) -> None:
        """Remove criu's tables that appeared during this dump and no hold owns (criu killed
        before it named its own: with another vacate dumping at once, that one's too, whose
        connections then come back closed)."""
        held = {h.table for h in self.holds.values()}
        for table in set(await tables(self.nft, CRIU_PREFIX)) - ctx.state.get(self.name, set()) - held:
            await self._release(table)

    def _arm(self, job: str, after_s: float) -> None:
        hold = self.holds.get(job)
        if hold is not None:
            if hold.timer is not None:
                hold.timer.cancel()
            hold.timer = asyncio.get_running_loop().call_later(after_s, self._expire, job, hold)

    def arm(self, job: str) -> None:
        """The vacate that took ``job``'s hold has committed and killed the job: the hold's
        ``hold_s`` start now."""
        self._arm(job, self.hold_s)

    # ------------------------------------------------------------------ restore

    async def before_restore(self, ctx: RestoreContext) -> None:
        self.kept.pop(ctx.job, None)
        hold = self.holds.get(ctx.job)
        if hold is None:
            return
        if (hold.generation, hold.created_at) == (ctx.manifest.generation, ctx.manifest.created_at):
            ctx.keep_connections = True  # no expiry while criu restores: released after it (or its failure)
            if hold.timer is not None:
                hold.timer.cancel()
                hold.timer = None
            return
        await self._drop_hold(ctx.job)  # another epoch: its connections come back closed

    async def after_restore(self, ctx: RestoreContext) -> None:
        """criu has removed its lock itself (the lock method is the dump's, from its inventory):
        the hold is done."""
        if ctx.keep_connections:
            hold = self.holds.get(ctx.job)
            await self._drop_hold(ctx.job)
            if hold is not None:
                self.kept[ctx.job] = hold.connections
                ctx.notes.append(f"{len(hold.connections)} connection(s) came back intact: restored on the node "
                                 "that vacated it, which held them")

    async def restore_failed(self, job: str) -> None:
        """A restore that claimed the hold failed: its connections go (a retry brings them back closed)."""
        self.kept.pop(job, None)
        hold = self.holds.get(job)
        if hold is not None and hold.timer is None:
            await self._drop_hold(job)

    def take_kept(self, job: str) -> list[str]:
        return self.kept.pop(job, [])

    async def close(self) -> None:
        """Let every hold go now (the agent stops): their peers get a reset, not a silence."""
        for job in list(self.holds):
            await self._drop_hold(job)


def _step(steps: list) -> NetLockStep | None:
    return next((s for s in steps if isinstance(s, NetLockStep)), None)


def kept_of(steps: list, job: str) -> list[str]:
    """The connections the restore of ``job`` just brought back intact (by ``steps``' NetLockStep)."""
    step = _step(steps)
    return step.take_kept(job) if step is not None else []


def vacated(steps: list, job: str) -> None:
    """``job``'s vacate has committed and killed it: its hold's time starts (agent/running/jobs.py)."""
    if (step := _step(steps)) is not None:
        step.arm(job)


async def restore_failed(steps: list, job: str) -> None:
    """``job``'s restore failed (agent/running/jobs.py): a hold it claimed goes."""
    if (step := _step(steps)) is not None:
        await step.restore_failed(job)


async def setup(nft_path: str, node: str, features: dict[str, bool], scratch: Path, *,
                hold_s: float) -> NetLockStep | None:
    """This node's holds on vacated jobs' connections, where criu can dump and lock connections
    and nft can remove a lock; an earlier agent's holds let go.  ``features["connection_hold"]``
    says whether."""
    found = None
    if features.get("tcp_established") and features.get("network_lock_nftables"):
        nft = locate(nft_path)
        why = await usable(nft, node)
        if why:
            log.warning("a vacate's connections are not held for a restore on this node: %s", why)
        else:
            assert nft is not None
            found = NetLockStep(nft, node, scratch, hold_s=hold_s)
            await found.sweep()
    features["connection_hold"] = found is not None
    return found
