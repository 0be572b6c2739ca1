"""Lazy (post-copy) restore: criu's lazy-pages daemon, serving a restored job's memory on demand.

``criu restore --lazy-pages`` returns as soon as the job runs; its pages arrive afterwards from
a ``criu lazy-pages`` daemon the agent started beforehand (same -D and -W: the two meet on the
relative ``lazy-pages.socket`` in -W), on the job's page faults and by a background fill.

The daemon's exit status alone proves nothing: it exits 0 when the job ends early too, and a
daemon that dies mid-fill leaves the job reading zeros where its pages should be, silently.
So a restore is complete only when the daemon exited 0 and its log (at -v4) shows every task's
pages transferred; anything else, and a pages image failing its checksum, means the job must be
killed (by the caller).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Awaitable, Callable
from pathlib import Path

from revenant.agent.lazyrestore import deltaserve, tether
from revenant.agent.pipeline import criu
from revenant.agent.processes import procs
from revenant.agent.storage import packs
from revenant.agent.storage.imagekeys import KEYED, by_extent
from revenant.agent.storage.epochs import PREDUMP_DIR, EpochError, JobFiles, Manifest, checksum_file
from revenant.common.errors import CriuError

LAZY_LOG = "lazy-pages.log"
_CHUNK = 8 * 1024 * 1024
SOCKET = "lazy-pages.socket"  # criu's own name for it, relative to -W
PAGE_SIZE = mmap.PAGESIZE

_PAGES_RE = re.compile(rf"^(?:{PREDUMP_DIR}/)?pages-[0-9]+\.img$")
# uffd.c, lp_debug: "uffd: <pid>-<uffd>: ..." (the uffd negative once the task exited).
_RECEIVED_RE = re.compile(r"uffd: Received PID: (\d+),")
_SUMMARY_RE = re.compile(r"uffd: (\d+)--?\d+: UFFD transferred pages: \((\d+)/(\d+)\)")
_EXIT_RE = re.compile(r"uffd: (\d+)--?\d+: EXIT$", re.M)


# In the job's directory: its last lazy restore failed for a reason other than its data (the daemon
# died, a read failed); the next restore, on whichever node, is eager, so a failure does not repeat.
EAGER_NEXT = "restore-eagerly"


def served_lazily(m: Manifest) -> bool:
    """Whether an epoch is restored lazily where the node can: not an encrypted one (opened
    first), nor a GPU job's (resuming CUDA copies device memory back from host memory that would
    still be arriving), nor a delta with a pre-dump (rebuilt first); a delta is served from its
    recipes (agent/lazyrestore/deltaserve.py)."""
    return not m.gpus and not m.encryption and (not m.recipes or deltaserve.servable(m))


def lazy_serves(m: Manifest, name: str) -> bool:
    """criu's page data (``pages-<id>.img``, a pre-dump's too) of an epoch restored lazily: what the
    lazy restore serves, and checks as it does (left out of the check before criu)."""
    base = name.rsplit("/", 1)[-1]
    return served_lazily(m) and base.startswith("pages-") and base.endswith(".img") and \
        (not by_extent(m.files, name) or deltaserve.plain_servable(m))  # checked by extent as served


def eager_next(files: JobFiles) -> bool:
    """Whether this restore of the job must be eager (and so the mark is used up)."""
    try:
        (files.dir / EAGER_NEXT).unlink()
        return True
    except FileNotFoundError:
        return False


def mark_eager_next(files: JobFiles) -> None:
    (files.dir / EAGER_NEXT).touch(mode=0o600)


@dataclass
class LazyResult:
    ok: bool
    seconds: float
    bytes: int
    error: str = ""
    corrupt: bool = False


def lazy_pages_argv(criu_path: str, *, images: Path, workdir: Path, status_fd: int) -> list[str]:
    """-v4: the per-task page counts that prove a complete restore are debug lines."""
    return [criu_path, "lazy-pages", "-D", str(images), "-W", str(workdir), "-o", LAZY_LOG, "-v4",
            "--status-fd", str(status_fd)]


def pages_images(images: Path, manifest: Manifest) -> list[str]:
    """The page data of an epoch (its pre-dump's too), on disk or in its manifest."""
    names = {n for n in manifest.files if _PAGES_RE.match(n)}
    for d, prefix in ((images, ""), (images / PREDUMP_DIR, f"{PREDUMP_DIR}/")):
        if d.is_dir():
            names.update(prefix + p.name for p in d.iterdir() if _PAGES_RE.match(prefix + p.name))
    return sorted(names)


class _Stopped(Exception):
    pass


def _crc32(path: Path, stop: threading.Event | None) -> str:
    """checksum_file's CRC-32, stopping within a file once ``stop`` is set (GiBs take seconds)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            if stop is not None and stop.is_set():
                raise _Stopped
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def check_pages(images: Path, manifest: Manifest, stop: threading.Event | None = None) -> tuple[str, bool]:
    """(the first pages image not matching the manifest, as one line, "" if all match; whether
    that proves the epoch corrupt); blocking I/O.  A read that failed proves nothing about the
    epoch (as retention holds).  ``stop``: give up (returning "") once set."""
    epoch = manifest.epoch
    if manifest.checksum == KEYED:  # every file's MAC was checked before the restore began (epochs.verify)
        return "", False
    try:
        for name in pages_images(images, manifest):
            entry = manifest.files.get(name)
            if entry is None:
                return f"epoch {epoch}: {name} is not in its manifest", True
            path = images / name
            try:
                size = path.stat().st_size
                if size != entry.size:
                    return f"epoch {epoch}: {name} is {size} bytes, manifest says {entry.size}", True
                crc = _crc32(path, stop) if manifest.checksum == "crc32" else checksum_file(path, manifest.checksum)
                if crc != entry.checksum:
                    return f"epoch {epoch}: {name} fails its checksum", True
            except FileNotFoundError:
                return f"epoch {epoch}: {name} is missing", False
            except OSError as exc:
                return f"epoch {epoch}: cannot read {name}: {exc.strerror or exc}", False
            except EpochError as exc:
                return str(exc), False
    except _Stopped:
        return "", False
    return "", False


def judge_log(text: str, returncode: int) -> tuple[str, int]:
    """(why the daemon did not serve every page, "" if it did; bytes it transferred), from its
    exit status and log."""
    done: dict[int, tuple[int, int]] = {}
    for m in _SUMMARY_RE.finditer(text):
        done[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    moved = sum(copied for copied, _ in done.values()) * PAGE_SIZE
    if returncode != 0:
        if "Error" in text:
            return criu.error_line(text), moved
        if returncode > 128:
            return f"lazy-pages was killed by signal {returncode - 128}", moved
        return f"lazy-pages exited with status {returncode}", moved
    tasks = {int(p) for p in _RECEIVED_RE.findall(text)}
    if not tasks and not done:
        return "lazy-pages ended without serving any task", moved
    # A task that exited while its pages arrived (the daemon alive and well) needed no more of them:
    # every page it touched was served.  Every other task must have had them all.
    exited = {int(m.group(1)) for m in _EXIT_RE.finditer(text)}
    if uncounted := sorted(tasks - done.keys() - exited):
        return f"lazy-pages ended without counting the pages of pid {uncounted[0]}", moved
    for pid, (copied, total) in sorted(done.items()):
        if copied != total and pid not in exited:
            return f"lazy-pages ended with only {copied} of {total} pages of pid {pid} transferred", moved
    return "", moved


class LazyPages:
    """One criu lazy-pages daemon, serving one lazy restore from a local images dir."""

    def __init__(self, proc: subprocess.Popen[bytes], out, workdir: Path, started: float,
                 server: deltaserve.DeltaServer | None = None) -> None:
        self._proc = proc
        self.server = server  # a delta's pages come from it, not from the images dir
        self._out = out  # its console output (a failure before its log opened), read once it exited
        self._console = ""
        self._started = started
        self._waiter = asyncio.ensure_future(self._wait())
        self.log_path = workdir / LAZY_LOG
        self.restore_args = ["--lazy-pages"]
        self._hold = -1  # the tether's pipe: the daemon lives on without the agent once it is told

    def handed_over(self) -> None:
        """The restored job runs: its daemon outlives the agent from now on (agent/lazyrestore/tether.py)."""
        if self._hold >= 0:
            try:
                os.write(self._hold, b"1")
            except OSError:
                pass  # the tether is gone: so is the daemon, which the fetch finds
            self._let_go()

    def _let_go(self) -> None:
        if self._hold >= 0:
            os.close(self._hold)
            self._hold = -1

    @property
    def pid(self) -> int:
        """Its tether's (agent/lazyrestore/tether.py): killing it kills the daemon."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    @classmethod
    async def start(cls, criu_path: str, images: Path, workdir: Path, timeout_s: float = 30,
                    server: deltaserve.DeltaServer | None = None) -> "LazyPages":
        """Start the daemon and wait until it listens; raises CriuError (and leaves nothing
        running) if it fails to, or takes longer than ``timeout_s``.  ``server``: the daemon asks
        it for the pages (a delta epoch), over a socket only the two of them hold."""
        try:
            return await cls._start(criu_path, images, workdir, timeout_s, server)
        except BaseException:
            if server is not None:
                server.close()
            raise

    @classmethod
    async def _start(cls, criu_path: str, images: Path, workdir: Path, timeout_s: float,
                     server: deltaserve.DeltaServer | None) -> "LazyPages":
        started = time.monotonic()
        if not (images / "pstree.img").is_file():
            what = "holds no criu images (no pstree.img)" if images.is_dir() else "is not a directory"
            raise CriuError(f"criu lazy-pages cannot serve {images}: it {what}")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            for stale in (SOCKET, LAZY_LOG):
                (workdir / stale).unlink(missing_ok=True)
        except OSError as exc:
            raise CriuError(f"cannot prepare {workdir} for criu lazy-pages: {exc.strerror or exc}") from None
        out = tempfile.TemporaryFile()
        r, w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(r, False)
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)  # the tether's: closed before the hand-over, the daemon dies
        argv = [sys.executable, "-I", "-S", tether.__file__, str(hold_r), "--",
                *lazy_pages_argv(criu_path, images=images, workdir=workdir, status_fd=w)]
        fds = (w, hold_r)
        if server is not None:
            argv += ["--page-server", "--ps-socket", str(server.theirs.fileno())]
            fds += (server.theirs.fileno(),)
            server.start()
        try:
            # Through its tether (agent/lazyrestore/tether.py), not killed with the agent: the job
            # it serves outlives an agent that dies (until its dead man's switch freezes it) and
            # must not read zeros meanwhile; the daemon ends by itself once every page is in or
            # the job is gone.  Until the job runs, the agent's death kills it.
            proc = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                               pass_fds=fds, close_fds=True)
        except BaseException as exc:
            os.close(r)
            os.close(hold_w)
            out.close()
            if isinstance(exc, OSError):
                raise CriuError(f"cannot run {criu_path} lazy-pages: {exc.strerror or exc}") from None
            raise
        finally:
            os.close(w)
            os.close(hold_r)
            if server is not None:
                server.handed_over()
        lp = cls(proc, out, workdir, started, server)
        lp._hold = hold_w
        try:
            status = await lp._status(r, timeout_s)
        except BaseException:
            await lp.abort()
            raise
        finally:
            os.close(r)
        if status != b"\0":
            await lp.abort()
            text = criu.read_log(lp.log_path, lp._console)
            if status is None:
                why = f"not ready after {timeout_s:g} s"
            elif "Error" in text:
                why = criu.error_line(text)
            else:
                why = f"exited with status {lp.returncode}: {criu.error_line(text)}"
            raise CriuError(f"criu lazy-pages failed on {images}: {why}")
        return lp

    async def _status(self, fd: int, timeout_s: float) -> bytes | None:
        """The daemon's one status byte; b"" if it closed the pipe first (exited), None on timeout."""
        loop = asyncio.get_running_loop()
        got: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            try:
                data = os.read(fd, 1)
            except BlockingIOError:
                return
            if not got.done():
                got.set_result(data)

        loop.add_reader(fd, readable)
        try:
            return await asyncio.wait_for(got, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)

    async def finished(self, manifest: Manifest, images: Path) -> LazyResult:
        """Wait until the daemon served every page, checking the page data's checksums meanwhile.
        Whichever speaks first against the restore decides at once: a mismatch (corrupt=True,
        the daemon still running), or the daemon dead or ended short (its missing pages read as
        zeros): the caller kills the job, then calls abort()."""
        stop = threading.Event()
        crc = asyncio.ensure_future(asyncio.to_thread(check_pages, images, manifest, stop) if self.server is None
                                    else asyncio.to_thread(self.server.outcome, stop))  # each page as served
        try:
            done, _ = await asyncio.wait({crc, self._waiter}, return_when=asyncio.FIRST_COMPLETED)
            if crc in done and (bad := crc.result())[0]:
                return LazyResult(ok=False, seconds=self._elapsed(), bytes=0, error=bad[0], corrupt=bad[1])
            code = await asyncio.shield(self._waiter)
            text = await asyncio.to_thread(criu.read_log, self.log_path, self._console)
            why, moved = judge_log(text, code)
            if why and self.server is not None and (bad := await crc)[0]:
                why = bad[0]  # the daemon failed because the server refused: the page at fault named
                return LazyResult(ok=False, seconds=self._elapsed(), bytes=moved, error=why, corrupt=bad[1])
            if why:
                return LazyResult(ok=False, seconds=self._elapsed(), bytes=moved, error=why)
            bad = await crc  # the daemon served every page: the check must still pass
            if bad[0]:
                return LazyResult(ok=False, seconds=self._elapsed(), bytes=moved, error=bad[0], corrupt=bad[1])
            return LazyResult(ok=True, seconds=self._elapsed(), bytes=moved)
        finally:
            stop.set()  # the check ends within its current file, its outcome unwanted
            crc.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def abort(self) -> None:
        """SIGKILL the daemon and reap it (idempotent)."""
        if self.server is not None:
            self.server.close()
        self._let_go()  # not handed over: the tether kills the daemon (and is killed next)
        if self._proc.returncode is None:
            try:
                os.kill(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await asyncio.shield(self._waiter)

    async def _wait(self) -> int:
        try:
            if self._proc.returncode is None:
                self._proc.returncode = await procs.wait_pid(self._proc.pid)
            self._out.seek(0)
            self._console = self._out.read(64 * 1024).decode(errors="replace")
        finally:
            self._out.close()
        return self._proc.returncode

    def _elapsed(self) -> float:
        return time.monotonic() - self._started


async def delta_images(criu_path: str, files: JobFiles, m: Manifest, dest: Path, workdir: Path,
                       lazily: bool) -> LazyPages | None:
    """Delta epoch ``m``'s images in ``dest`` (private, on the storage): with ``lazily``, what criu
    restore reads itself and a daemon started to serve the rest from the recipes (returned), or,
    where it cannot be served so or without ``lazily``, every image rebuilt (None)."""
    server = await asyncio.to_thread(deltaserve.prepare, files, m, dest) if lazily else None
    if server is None and not m.recipes:  # a signed plain epoch (deltaserve.plain_servable) always is
        raise EpochError(f"epoch {m.epoch}: its page images do not match its pagemaps")
    if server is None:
        await asyncio.to_thread(packs.materialize, files, m, dest)
        return None
    return await LazyPages.start(criu_path, dest, workdir, server=server)


@dataclass
class LazyFetch:
    """The rest of a lazy restore: its page server, until the last page is in (or it fails)."""

    pages: LazyPages
    manifest: Manifest
    images: Path
    workdir: Path
    keep_log: Callable[[str], Awaitable[str]]  # the daemon's log kept beside criu's: a pointer to it
    scratch: Path | None = None  # a delta's scratch images, removed with the work directory

    async def wait(self) -> LazyResult:
        """Every page fetched and the page data verified, or why not: the caller kills the job at
        once, then calls :meth:`failed`."""
        return await self.pages.finished(self.manifest, self.images)

    async def failed(self) -> str:
        """The daemon stopped and its log kept beside criu's: a pointer to the log."""
        await self.pages.abort()
        text = await asyncio.to_thread(criu.read_log, self.pages.log_path, "")
        return (await self.keep_log(text)).replace("criu log", "lazy-pages log")

    async def abort(self) -> None:
        await self.pages.abort()
        await self.close()

    async def close(self) -> None:
        for path in (self.workdir, self.scratch):
            if path is not None:
                await asyncio.to_thread(shutil.rmtree, path, ignore_errors=True)
