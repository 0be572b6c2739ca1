"""Killed at any moment: an agent process committing, pruning, converting and collecting a job's
epochs is SIGKILLed at random points, again and again over the same storage (each time its
successor starts as an agent does: half-written epochs of its node removed); after every kill,
every epoch still listed verifies and restores to exactly the bytes it was committed with."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from helpers import EXAMPLES_SCALE

from revenant.agent.storage import packs
from revenant.agent.storage.epochs import JobFiles, Manifest

pytestmark = pytest.mark.unit

PAGE = 4096
PAGES = 256  # 1 MiB per epoch
# Lives (each a random kill): 14 in make test, 6 in make test-fast (tests/helpers.py).
LIVES = 14 if EXAMPLES_SCALE >= 1 else 6


def content(k: int) -> bytes:
    """Round ``k``'s memory: each round rewrites 8 of the pages (3 %) and appends none."""
    rnd = random.Random(0)
    body = [rnd.randbytes(PAGE) for _ in range(PAGES)]
    for r in range(1, k + 1):
        for i in random.Random(r).sample(range(PAGES), 8):
            body[i] = random.Random(r * 1000 + i).randbytes(PAGE)
    return b"".join(body)


def agent_life(storage: Path, first_round: int) -> None:
    """What an agent does for an incremental job with max_epochs 3 and full_every 4, forever."""
    files = JobFiles(storage, "9")
    files.clean_stale_tmp("n1")  # as agent start-up does
    k = first_round
    while True:
        tmp = files.new_tmp("n1")
        (tmp / "pages-1.img").write_bytes(content(k))
        (tmp / "core-1.img").write_bytes(str(k).encode())
        m = Manifest(job="9", epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.1.1",
                     kernel="k")
        committed = files.commit(tmp, m)
        files.prune(3, {committed.epoch})
        for n in files.committed()[:-1]:
            packs.convert(files, n, 4)
        packs.gc(files)
        k += 1


def restored(files: JobFiles, n: int, scratch: Path) -> tuple[int, bytes]:
    m = files.verify(n)
    d = files.epoch_dir(n)
    if packs.converted(m):
        scratch.mkdir(exist_ok=True)
        d = scratch / f"{n}-{time.monotonic_ns()}"
        packs.materialize(files, m, d)
    return int((d / "core-1.img").read_bytes()), (d / "pages-1.img").read_bytes()


def test_an_agent_killed_anywhere_leaves_every_listed_epoch_restorable(tmp_path: Path) -> None:
    files = JobFiles(tmp_path, "9")
    rnd = random.Random(5)
    cache: dict[int, bytes] = {}
    seen_converted = 0
    first_round = 0
    for life in range(LIVES):
        pid = os.fork()
        if pid == 0:
            try:
                agent_life(tmp_path, first_round)
            finally:
                os._exit(1)
        time.sleep(rnd.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        listed = files.committed()
        for n in listed:
            k, pages = restored(files, n, tmp_path / "scratch")
            if k not in cache:
                cache[k] = content(k)
            assert pages == cache[k], f"life {life}: epoch {n} (round {k}) restores other bytes"
            seen_converted += packs.converted(files.read_manifest(n))
        first_round = max(cache, default=-1) + 1
    assert len(files.committed()) >= 1
    assert seen_converted > 0  # the kills did land while epochs were deltas, not only before any
