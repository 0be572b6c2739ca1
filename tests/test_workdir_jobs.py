"""Jobs whose files are closed between writes come back exactly from each epoch: real criu, two
supervisors (nodes) on one shared storage, the job (tests/jobs/closedfiles.py) checking at every
step that its files are as it left them.  SQLite opened and closed per transaction, a training
script rewriting ``model.ckpt`` in place, and ``git commit`` in a loop: each through a failover
from its newest epoch, then a vacate and a restart of its older epoch."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import REPO
from helpers import until
from test_job_files import exact_steps, node_dies, steps_in
from revenant.agent.files import workdir
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

CLOSED = REPO / "tests" / "jobs" / "closedfiles.py"


@pytest.mark.parametrize("mode, interval", [("sqlite", "0.02"), ("ckpt", "0.02"), ("git", "0.01")])
async def test_a_job_that_closes_its_files_goes_on_exactly_from_each_epoch(tmp_path, supervisors, mode, interval):
    n1, n2 = supervisors("n1"), supervisors("n2")
    wd = tmp_path / "wd"
    wd.mkdir()
    spec = JobSpec(id="1", argv=[sys.executable, str(CLOSED), mode, "100000", interval], workdir=str(wd),
                   max_epochs=3)
    await n1.start(spec, 1)
    started = time.monotonic()
    files = JobFiles(n1.storage, "1")
    out = files.output
    # Files changed within a tick of a dump (2 s where times are whole seconds) are never linked by
    # the next (agent/files/workdir.py RACY_NS): the first epoch comes once the first files are older.
    await until(lambda: steps_in(out) >= 10 and time.monotonic() - started > 3)
    first = await n1.checkpoint("1", 1, stop=False)
    at_first = steps_in(out)
    await until(lambda: steps_in(out) >= at_first + 10)
    second = await n1.checkpoint("1", 1, stop=False)
    m1, m2 = files.read_manifest(first.epoch.n), files.read_manifest(second.epoch.n)
    # Its snapshot was taken (a file the job held open at the dump is in job_files instead).
    assert (files.epoch_dir(first.epoch.n) / "workdir-files.json").is_file() and not m1.workdir_note
    assert m1.workdir_linked == 0 and m2.workdir_files + len(m2.job_files) > 0
    if mode == "git":  # objects written before the first epoch are never rewritten: linked, not copied
        assert m2.workdir_linked > 0, (m2.workdir_copied, m2.workdir_linked)
    if mode == "ckpt":  # 4 MiB: its pages in the epoch's packs, unless the job held it at the dump
        for m in (m1, m2):
            rec = workdir.read(files.epoch_dir(m.epoch)).get("model.ckpt")
            if rec is None:  # held open at the dump: saved with the job's open files instead
                assert str(wd / "model.ckpt") in m.job_files, (sorted(m.job_files), m.workdir_files)
                continue
            assert (rec.runs is not None and m.workdir_packs) or rec.racy, rec
    at_second = steps_in(out)
    await until(lambda: steps_in(out) >= at_second + 10)  # its files changed after the epoch
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())

    restored = await n2.restore(spec, 2)  # a failover: from the newest epoch
    assert restored.epoch.n == second.epoch.n, restored.notes
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 10)
    await n2.checkpoint("1", 2, stop=True)  # a vacate, then a restart of the older epoch
    again = await n1.restore(spec, 3, epoch=first.epoch.n)
    assert again.epoch.n == first.epoch.n
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 10)
    await n1.kill("1", 3, "test over")
    text = out.read_text()
    assert "INCONSISTENT" not in text, text[-500:]
    exact_steps(out)
    # Nothing that existed at an epoch was moved aside: only what appeared after it.
    for aside in wd.glob("revenant-after-epoch-*"):
        assert not {p.name for p in aside.rglob("*")} & {"steps.db", "model.ckpt", "HEAD", "index"}, \
            sorted(aside.rglob("*"))
