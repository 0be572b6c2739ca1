"""The engine step that suspends a job's CUDA state around criu, and resumes it afterwards.

    before_dump      find the job's CUDA processes (NVML's compute processes inside the job's tree, and
                     any other of its processes that maps an NVIDIA device and that the driver knows),
                     refuse what cannot be checkpointed (before anything is locked), lock every one,
                     then checkpoint every one: device memory is now in host memory, the GPU released
    (criu dump)
    after_dump       a checkpoint that leaves the job running resumes it at once (restore, unlock)
    on_dump_failed   whatever failed, each process is brought back to running from the state the
                     driver says it is in (restore then unlock, or unlock), shielded from cancellation
    check_restore    the epoch's GPUs against this node's (common/gpufit.py): refused, or the remap
    (criu restore)
    after_restore    restore every CUDA process (onto this node's GPUs) then unlock every one

Every transition is checked with the driver's state query.  A process restored by criu has
another pid outside its PID namespace: the manifest records each CUDA process by its pid inside
the job's own namespace, which criu keeps, and the restored tree is searched for it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec

from revenant.agent.gpus.cuda import CHECKPOINTED, LOCKED, RUNNING, CudaError, Mechanism
from revenant.agent.gpus.gpu import CudaProcess, GpuScan
from revenant.agent.pipeline.blockers import NotCheckpointable
from revenant.agent.pipeline.steps import BaseStep, DumpContext, RestoreContext
from revenant.agent.processes.procs import signal_tree, tree_pids
from revenant.agent.storage.epochs import EpochError, Manifest
from revenant.common.errors import described
from revenant.common.gpufit import gpu_fit
from revenant.messages import Capabilities, JobGpu, JobResource

log = logging.getLogger(__name__)

# A multi-process NCCL job is told by its processes' maps.  Managed (UVM) and CUDA IPC memory leave
# no sign outside the process that tells them apart: the driver refuses those at the checkpoint, and
# its error is passed on with this hint.
_NCCL = "libnccl"
_INFLIGHT = "gpu-inflight"
UNSUPPORTED_HINT = ("CUDA checkpoints do not support unified (managed/UVM) memory, CUDA IPC memory, MPS, MIG "
                    "or multi-process NCCL jobs")


def ns_pid(pid: int) -> int:
    """``pid``'s number inside its own (innermost) PID namespace: the last NSpid entry."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return pid


def read_maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def device_mappers(pids: list[int], maps: Callable[[int], str]) -> dict[int, str]:
    """The processes among ``pids`` that map an NVIDIA device file, each with the first such path:
    criu cannot dump those mappings, so each must be one the driver checkpoints."""
    found = {}
    for pid in pids:
        for line in maps(pid).splitlines():
            fields = line.split(maxsplit=5)  # an anonymous mapping has no sixth field
            if len(fields) == 6 and fields[5].startswith("/dev/nvidia"):
                found[pid] = fields[5].strip()
                break
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def forked_mapping(why: str) -> str:
    """Why a process that maps the GPU but is no CUDA process of the driver's stops the checkpoint."""
    return (f"the driver holds no CUDA state for it to checkpoint ({why}); most likely a child forked after "
            "CUDA started (a PyTorch DataLoader worker, say): start such workers with the 'spawn' or "
            "'forkserver' method (DataLoader(..., multiprocessing_context='forkserver'))")


def unsupported(job: str, procs: list[CudaProcess], scan: GpuScan, maps: dict[int, str],
                mechanism: Mechanism) -> str | None:
    """Why ``job``'s CUDA processes cannot be checkpointed (a pure rule), or None."""
    pids = sorted({p.pid for p in procs})
    mig = sorted({p.gpu_index for p in procs if p.gpu_index in scan.mig})
    if mig:
        return f"job {job} uses GPU {', '.join(map(str, mig))} in MIG mode, which CUDA checkpoints do not support"
    mps = [p for p in pids if p in scan.mps_pids]
    if mps:
        return (f"job {job} runs under MPS (pid {', '.join(map(str, mps))}), which CUDA checkpoints "
                "do not support")
    if len(pids) > 1 and any(_NCCL in maps.get(p, "") for p in pids):
        return (f"job {job} is a multi-process NCCL job ({len(pids)} CUDA processes sharing GPU memory "
                "through NCCL), which CUDA checkpoints do not support")
    return toggles_one(job, len(pids), mechanism)


def toggles_one(job: str, n: int, mechanism: Mechanism) -> str | None:
    if n > 1 and getattr(mechanism, "toggle", False):
        return (f"job {job} has {n} CUDA processes; this node's cuda-checkpoint only toggles one "
                "process (driver 570 or later checkpoints process trees)")
    return None


class GpuStep(BaseStep):
    name = "gpu"

    def __init__(self, mechanism: Mechanism | None, why_none: str, scan: Callable[[], GpuScan],
                 capabilities: Callable[[], Capabilities], lock_timeout_s: float = 10.0,
                 maps: Callable[[int], str] = read_maps, to_ns_pid: Callable[[int], int] = ns_pid,
                 tree: Callable[[int], list[int]] = tree_pids, clock: Callable[[], float] = time.monotonic,
                 kill: Callable[[int], None] = lambda root: signal_tree(root, signal.SIGKILL)) -> None:
        self.mechanism = mechanism
        self.why_none = why_none
        self.scan = scan  # blocking (NVML): called in a worker thread
        self.capabilities = capabilities
        self.lock_timeout_ms = max(1, int(lock_timeout_s * 1000))
        self.maps = maps
        self.ns_pid = to_ns_pid
        self.tree = tree
        self.clock = clock
        self.kill = kill

    # ------------------------------------------------------------------ checkpoint

    async def before_dump(self, ctx: DumpContext) -> None:
        scan = await asyncio.to_thread(self.scan)
        tree = set(await asyncio.to_thread(self.tree, ctx.pid))
        procs = [p for p in scan.processes if p.pid in tree]
        listed = {p.pid for p in procs}
        mappers = await asyncio.to_thread(device_mappers, sorted(tree - listed), self.maps)
        if not procs and not mappers:
            return  # no CUDA context in the job right now: a plain criu dump
        if self.mechanism is None:
            what = (f"GPU {procs[0].gpu_index} (pid {procs[0].pid})" if procs else
                    f"the GPU ({next(iter(mappers.values()))})")
            raise CudaError(f"job {ctx.job} uses {what} but this node cannot checkpoint CUDA: "
                            f"{self.why_none or 'no mechanism'}")
        maps = {p.pid: await asyncio.to_thread(self.maps, p.pid) for p in procs}
        why = unsupported(ctx.job, procs, scan, maps, self.mechanism)
        if why:
            raise CudaError(why)
        # A process NVML does not list (a child that shares its parent's context, a context NVML has not
        # seen yet) is checkpointed too if the driver knows it; else criu could never dump its mappings.
        for pid, path in sorted(mappers.items()):
            if why := await asyncio.to_thread(self._unknown_to_driver, pid):
                raise NotCheckpointable(f"checkpoint of {ctx.job} refused: its process {pid} ({_comm(pid)}) "
                                        f"maps {path} but {forked_mapping(why)}")
        pids = sorted(listed | set(mappers))
        why = toggles_one(ctx.job, len(pids), self.mechanism)
        if why:
            raise CudaError(why)
        for pid in pids:  # the driver knows each as a CUDA process it can checkpoint (its error, if not)
            await asyncio.to_thread(self.mechanism.restore_tid, pid)
        ctx.state[self.name] = pids  # from here on, a failure brings each of them back
        started = self.clock()
        await self._each(pids, self._lock, ctx)  # every process locked before any is checkpointed
        locked = self.clock()
        await self._each(pids, self._checkpoint, ctx)
        done = self.clock()
        ctx.manifest.gpus = _job_gpus(procs)
        ctx.manifest.gpu_driver = scan.driver
        inside = {p: await asyncio.to_thread(self.ns_pid, p) for p in pids}
        ctx.manifest.cuda_pids = {inside[p]: sorted({q.gpu_uuid for q in procs if q.pid == p}) for p in pids}
        held = sum(g.memory_bytes for g in ctx.manifest.gpus)
        ctx.notes.append(f"CUDA suspended in {len(pids)} process(es) through {self.mechanism.name}: lock "
                         f"{locked - started:.2f} s, device memory {held / 2**30:.2f} GiB copied out in "
                         f"{done - locked:.2f} s")

    async def after_dump(self, ctx: DumpContext) -> None:
        pids = ctx.state.get(self.name)
        if pids and not ctx.stop:  # the job goes on: back onto its GPUs now
            await self._each(pids, lambda pid: self._restore(pid, None), ctx)
            await self._each(pids, self._unlock, ctx)

    async def on_dump_failed(self, ctx: DumpContext) -> None:
        pids = ctx.state.get(self.name)
        if not pids:
            return
        inflight = ctx.state.get(_INFLIGHT)
        if inflight is not None:  # a call cancelled in our task still runs in its thread: let it end
            await asyncio.wait([inflight])
        errors = []
        for pid in pids:  # every one, whatever the others do
            try:
                await asyncio.to_thread(self.recover, pid)
            except Exception as exc:
                errors.append(described(exc))
        if errors:
            # Its CUDA calls would block for ever: a wedged job is worse than one restored from its epoch.
            await asyncio.to_thread(self.kill, ctx.pid)
            raise CudaError(f"job {ctx.job} was killed, its CUDA state could not be resumed ({'; '.join(errors)}); "
                            "restart it from its newest epoch")

    def recover(self, pid: int) -> None:
        """Bring ``pid``'s CUDA back to running from whatever state the driver reports (blocking)."""
        assert self.mechanism is not None
        for _ in range(3):
            state = self.mechanism.state(pid)
            if state == RUNNING:
                return
            if state == CHECKPOINTED:
                self._restore(pid, None)
            elif state == LOCKED:
                self._unlock(pid)
            else:
                raise CudaError(f"pid {pid}'s CUDA state is {state}: it cannot be resumed")
        raise CudaError(f"pid {pid}'s CUDA did not come back to running")

    def inspect(self, pid: int) -> list[JobResource]:
        """revenant check: the job's CUDA processes, and its other processes that map the GPU."""
        tree = set(self.tree(pid))
        listed = sorted({p.pid for p in self.scan().processes if p.pid in tree})
        out = []
        for p in listed:
            if self.mechanism is None:
                out.append(JobResource(kind="gpu", what=f"CUDA process {p}", verdict="blocking",
                                       reason=f"this node cannot checkpoint CUDA: {self.why_none or 'no mechanism'}"))
            else:
                out.append(JobResource(kind="gpu", what=f"CUDA process {p}", verdict="carried",
                                       reason=f"suspended around the dump through {self.mechanism.name}; a restore "
                                              "needs a node with the same GPUs"))
        for p, path in sorted(device_mappers(sorted(tree - set(listed)), self.maps).items()):
            why = self._unknown_to_driver(p) if self.mechanism is not None else "this node has no mechanism"
            reason = forked_mapping(why) if why else "the driver knows it: suspended with the others"
            out.append(JobResource(kind="gpu", what=f"process {p} ({_comm(p)}) maps {path}",
                                   verdict="blocking" if why else "carried", reason=reason))
        return out

    def _unknown_to_driver(self, pid: int) -> str:
        """Why the driver cannot checkpoint ``pid`` ("" if it knows it as a running CUDA process)."""
        assert self.mechanism is not None
        try:
            state = self.mechanism.state(pid)
        except CudaError as exc:
            return described(exc)
        return "" if state == RUNNING else f"its state is {state}"

    # ------------------------------------------------------------------ restore

    def check_restore(self, manifest: Manifest, epoch_dir: Path, gpus: Sequence[str] = ()) -> Any:
        if not manifest.gpus:
            return {}
        caps = self.capabilities()
        if gpus:  # placement gave the job these: its GPUs go onto them, no other of the node's
            caps = msgspec.structs.replace(caps, gpus=[g for g in caps.gpus if g.uuid in gpus])
        why, moved = gpu_fit(manifest.gpus, manifest.gpu_driver, caps)
        if why:
            raise EpochError(f"epoch {manifest.epoch} of {manifest.job}: {why}")
        if self.mechanism is None:
            raise EpochError(f"epoch {manifest.epoch} of {manifest.job} holds CUDA state but this node cannot "
                             f"restore it: {self.why_none or 'no mechanism'}")
        # A remapping names every checkpointed GPU (NVIDIA's rule for the pairs), those that stay too.
        return {g.uuid: moved.get(g.uuid, g.uuid) for g in manifest.gpus} if moved else {}

    async def after_restore(self, ctx: RestoreContext) -> None:
        m = ctx.manifest
        if not m.cuda_pids:
            return
        remap: dict[str, str] = ctx.checked.get(self.name) or {}
        wanted = sorted(m.cuda_pids)
        pids = await asyncio.to_thread(self._restored_pids, ctx.pid, wanted)
        # Each process's own GPUs in its pairs (all of them when one moves: NVIDIA's rule), none if none move.
        own = {pid: {u: remap.get(u, u) for u in m.cuda_pids[n]} for pid, n in zip(pids, wanted)}
        pairs = {pid: mine if any(o != n for o, n in mine.items()) else {} for pid, mine in own.items()}
        started = self.clock()
        await self._each(pids, lambda pid: self._restore(pid, pairs[pid]))
        await self._each(pids, self._unlock)
        moved = f", GPUs remapped ({', '.join(f'{o} -> {n}' for o, n in sorted(remap.items()) if o != n)})" \
            if remap else ""
        ctx.notes.append(f"CUDA resumed in {len(pids)} process(es) in {self.clock() - started:.2f} s{moved}")

    def _restored_pids(self, root: int, wanted: list[int]) -> list[int]:
        found = {self.ns_pid(pid): pid for pid in self.tree(root)}
        missing = [p for p in wanted if p not in found]
        if missing:
            raise CudaError(f"the restored job has no process {', '.join(map(str, missing))} (its pid in the "
                            "job's namespace at the checkpoint) to resume CUDA in")
        return [found[p] for p in wanted]

    # ------------------------------------------------------------------ transitions, each checked

    async def _each(self, pids: list[int], fn: Callable[[int], None], ctx: DumpContext | None = None) -> None:
        for pid in pids:
            call = asyncio.ensure_future(asyncio.to_thread(fn, pid))
            if ctx is not None:
                ctx.state[_INFLIGHT] = call
            await asyncio.shield(call)  # cancelled, the call still ends before on_dump_failed acts

    def _checked(self, pid: int, want: str, what: str) -> None:
        assert self.mechanism is not None
        state = self.mechanism.state(pid)
        if state != want:
            raise CudaError(f"after the CUDA {what} of pid {pid} the driver reports {state}, not {want}")

    def _lock(self, pid: int) -> None:
        assert self.mechanism is not None
        try:
            self.mechanism.lock(pid, self.lock_timeout_ms)
        except CudaError as exc:
            if "TIMEOUT" in str(exc).upper():
                raise CudaError(f"{exc} (work submitted to the GPU did not finish within gpu_lock_timeout_s = "
                                f"{self.lock_timeout_ms / 1000:g} s)") from None
            raise
        if not getattr(self.mechanism, "toggle", False):  # --toggle locks inside its checkpoint
            self._checked(pid, LOCKED, "lock")

    def _checkpoint(self, pid: int) -> None:
        assert self.mechanism is not None
        try:
            self.mechanism.checkpoint(pid)
        except CudaError as exc:
            if "NOT_SUPPORTED" in str(exc).upper():
                raise CudaError(f"{exc} ({UNSUPPORTED_HINT})") from None
            raise
        self._checked(pid, CHECKPOINTED, "checkpoint")

    def _restore(self, pid: int, remap: dict[str, str] | None) -> None:
        assert self.mechanism is not None
        self.mechanism.restore(pid, remap or None)
        self._checked(pid, RUNNING if getattr(self.mechanism, "toggle", False) else LOCKED, "restore")

    def _unlock(self, pid: int) -> None:
        assert self.mechanism is not None
        self.mechanism.unlock(pid)
        self._checked(pid, RUNNING, "unlock")


def _job_gpus(procs: list[CudaProcess]) -> list[JobGpu]:
    by_uuid: dict[str, JobGpu] = {}
    for p in procs:
        g = by_uuid.get(p.gpu_uuid)
        used = (g.memory_bytes if g else 0) + p.used_bytes
        by_uuid[p.gpu_uuid] = JobGpu(index=p.gpu_index, uuid=p.gpu_uuid, name=p.gpu_name, memory_bytes=used)
    return sorted(by_uuid.values(), key=lambda g: g.index)
