"""A job's own files are part of its epoch: real criu, real files, two supervisors (nodes) on one
shared storage.  The job (tests/jobs/filewriter.py) checks at every step that its files are where
it left them, and exits 3 if not."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from helpers import until
from conftest import REPO
from revenant.agent.processes.procs import signal_tree
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles, NoEpoch
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

WRITER = REPO / "tests" / "jobs" / "filewriter.py"


@pytest.fixture
def nodes(supervisors):
    """Two supervisors ("n1", "n2") sharing one storage, as two nodes would."""
    return supervisors



def steps_in(path: Path) -> int:
    return path.read_bytes().count(b"step ")


async def run_writer(sup: Supervisor, workdir: Path, *args: str, job: str = "1", max_epochs: int = 1) -> JobSpec:
    workdir.mkdir(exist_ok=True)
    spec = JobSpec(id=job, argv=[sys.executable, str(WRITER), *args], workdir=str(workdir), max_epochs=max_epochs)
    await sup.start(spec, 1)
    return spec


def node_dies(sup: Supervisor, job: str = "1") -> None:
    """The node is gone: its job dies with it, nothing is cleaned up."""
    signal_tree(sup.jobs[job].pid, signal.SIGKILL)


def exact_steps(path: Path, csv: bool = False) -> int:
    """How many steps ``path`` holds, asserting they are exactly steps 0, 1, ... with no gap,
    no repeat and no torn line ("step i" lines, or metrics.csv's "i,loss" rows under a header)."""
    text = path.read_text()
    if csv:
        assert text.startswith("step,loss\n"), text[:100]
        text = text[len("step,loss\n"):]
    assert not text or text.endswith("\n"), (path.name, text[-100:])
    lines = text.splitlines()
    steps = [int(ln.split(",")[0]) if csv else int(ln.split()[1]) for ln in lines]
    assert steps == list(range(len(steps))), (path.name, lines[-30:])
    return len(steps)


async def test_files_opened_w_and_a_come_back_exact_after_a_failover(tmp_path, nodes):
    n1, n2 = nodes("n1"), nodes("n2")
    wd = tmp_path / "wd"
    spec = await run_writer(n1, wd, "100000", "0.02", "7")
    out = JobFiles(n1.storage, "1").output
    await until(lambda: steps_in(out) >= 15)
    reply = await n1.checkpoint("1", 1, stop=False)
    at_dump = (wd / "metrics.csv").read_text().count("\n") - 1
    await until(lambda: steps_in(out) >= at_dump + 15)  # more lines after the epoch
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())

    restored = await n2.restore(spec, 2)
    assert restored.epoch.n == reply.epoch.n
    notes = " | ".join(restored.notes)
    # "w" files are copied with the epoch; append-mode ones cut back; rewritten ones put back.
    assert f"restored {wd / 'metrics.csv'} from epoch 1's copy (grown since the dump)" in notes, notes
    assert f"cut {wd / 'train.log'} back" in notes, notes
    assert f"restored {wd / 'state.bin'} from epoch 1's copy (rewritten since the dump)" in notes, notes
    assert f"restored {wd / 'steps.db'} from epoch 1's copy" in notes, notes
    assert f"cut {out} back" in notes, notes
    # Its own checkpoint, closed at the dump and renamed over after it, is put back as at the epoch.
    assert f"files of {wd} as they were at epoch 1" in notes and "ckpt.json" in notes, notes
    assert json.loads((wd / "ckpt.json").read_text())["step"] <= at_dump
    # Only what a kill can leave half-way appears after the epoch: SQLite's hot journal, or the
    # job's checkpoint not yet renamed. It is moved aside, never left for the restored job.
    aside = wd / "revenant-after-epoch-1"
    left = sorted(p.name for p in aside.iterdir()) if aside.exists() else []
    assert set(left) <= {"steps.db-journal", "ckpt.json.tmp"}, left
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 20)
    await n2.kill("1", 2, "test over")
    assert b"INCONSISTENT" not in out.read_bytes()
    final = exact_steps(out)
    # Every file holds steps 0.. with no gap and no repeat: the job went on from the epoch (the
    # kill may land between a step's lines in two files).
    assert final - 1 <= exact_steps(wd / "train.log") <= final + 1
    assert final - 1 <= exact_steps(wd / "metrics.csv", csv=True) <= final + 1
    with sqlite3.connect(wd / "steps.db") as db:
        rows = [n for (n,) in db.execute("SELECT n FROM steps ORDER BY n")]
    db.close()
    assert rows == list(range(len(rows))) and final - 1 <= len(rows) <= final + 1


async def test_a_log_rotated_after_the_epoch_comes_back_from_its_copy(tmp_path, nodes):
    """An append-mode file held open at the dump, renamed away and replaced by a shorter one since
    (a rotated log, a file a tool moved and wrote again): it cannot be cut back, so the failover
    puts back the epoch's copy of it rather than falling back to an older epoch."""
    n1, n2 = nodes("n1"), nodes("n2")
    wd = tmp_path / "wd"
    spec = await run_writer(n1, wd, "100000", "0.02", "7", max_epochs=2)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: steps_in(out) >= 10)
    await n1.checkpoint("1", 1, stop=False)
    await until(lambda: steps_in(out) >= 20)
    reply = await n1.checkpoint("1", 1, stop=False)
    await until(lambda: steps_in(out) >= 35)
    (wd / "train.log").rename(wd / "train.log.1")  # the job's handler writes on into the renamed file
    (wd / "train.log").write_text("step 0\n")
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())

    restored = await n2.restore(spec, 2)
    assert restored.epoch.n == reply.epoch.n, restored.notes
    notes = " | ".join(restored.notes)
    assert f"restored {wd / 'train.log'} from epoch {reply.epoch.n}'s copy" in notes, notes
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 10)
    await n2.kill("1", 2, "test over")
    final = exact_steps(out)
    assert final - 1 <= exact_steps(wd / "train.log") <= final + 1


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
async def test_vacate_then_restart_elsewhere_changes_nothing(tmp_path, nodes, staged):
    # Staged: criu and the file copies go to node-local staging, moved to the storage after.
    n1 = nodes("n1", staging=tmp_path / "staging-n1" if staged else None)
    n2 = nodes("n2")
    wd = tmp_path / "wd"
    spec = await run_writer(n1, wd, "100000", "0.02", "1000")  # no checkpoint file of its own
    out = JobFiles(n1.storage, "1").output
    await until(lambda: steps_in(out) >= 10)
    (wd / "metrics.csv").chmod(0o640)
    os.chown(wd / "train.log", 65534, 65534)
    vacated = await n1.checkpoint("1", 1, stop=True)
    m = JobFiles(n1.storage, "1").read_manifest(vacated.epoch.n)
    copied = {Path(p).name for p, f in m.job_files.items() if f.copy and not f.append}
    # metrics.csv, state.bin, steps.db (and SQLite's journal if the dump caught a transaction)
    assert copied - {"steps.db-journal"} == {"metrics.csv", "state.bin", "steps.db"}, copied
    # The append-mode ones are cut back on restore, and copied as well while they are small.
    assert {Path(p).name for p, f in m.job_files.items() if f.copy and f.append} == {"train.log", "output.log"}
    assert all((JobFiles(n1.storage, "1").epoch_dir(vacated.epoch.n) / f.copy).is_file()
               for f in m.job_files.values() if f.copy)
    names = ("metrics.csv", "train.log", "state.bin", "steps.db")  # not SQLite's passing journal
    before = {n: ((st := (wd / n).stat()).st_ino, st.st_mode, st.st_uid) for n in names}
    restored = await n2.restore(spec, 2)
    # Nothing changed after a vacate: nothing to cut back, restore or move aside; every file
    # keeps its inode, owner and mode (the restored job is already writing to them).
    assert restored.epoch.n == vacated.epoch.n and restored.notes == []
    assert {n: ((st := (wd / n).stat()).st_ino, st.st_mode, st.st_uid) for n in before} == before
    n = steps_in(out)
    await until(lambda: steps_in(out) >= n + 10)
    await n2.kill("1", 2, "test over")
    assert b"INCONSISTENT" not in out.read_bytes()
    final = exact_steps(out)
    assert final - 1 <= exact_steps(wd / "train.log") <= final + 1
    assert (wd / "metrics.csv").stat().st_mode & 0o777 == 0o640 and (wd / "train.log").stat().st_uid == 65534


async def test_a_big_file_rewritten_in_place_refuses_its_epoch_and_an_older_one_is_used(tmp_path, nodes):
    n1 = nodes("n1", max_bytes=1024**2)
    n2 = nodes("n2", max_bytes=1024**2)
    wd = tmp_path / "wd"
    # big.bin (2 MiB, over the 1 MiB limit, no reflinks on this filesystem) opens at step 30.
    spec = await run_writer(n1, wd, "100000", "0.02", "1000", "2", "30", max_epochs=2)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: steps_in(out) >= 10)
    first = await n1.checkpoint("1", 1, stop=False)
    await until(lambda: steps_in(out) >= 40)
    second = await n1.checkpoint("1", 1, stop=False)
    shown = {f.path: f for f in second.epoch.files}
    assert "over file_snapshot_max_bytes" in shown[str(wd / "big.bin")].not_copied
    assert shown[str(wd / "state.bin")].copied and not shown[str(wd / "state.bin")].not_copied
    at_second = steps_in(out)
    await until(lambda: steps_in(out) >= at_second + 10)  # big.bin rewritten since
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())

    restored = await n2.restore(spec, 2)
    notes = " | ".join(restored.notes)
    assert restored.epoch.n == first.epoch.n, notes
    assert (f"{wd / 'big.bin'} was rewritten in place since epoch {second.epoch.n} and epoch {second.epoch.n} "
            "holds no copy of it: 2097152 bytes, over file_snapshot_max_bytes (1048576)") in notes, notes
    # big.bin did not exist at the first epoch: moved aside with the rest of what came later.
    assert (wd / f"revenant-after-epoch-{first.epoch.n}" / "big.bin").exists() and not (wd / "big.bin").exists()
    n = steps_in(out)
    await until(lambda: steps_in(out) >= max(n + 10, 35))  # past step 30: big.bin made anew
    await n2.kill("1", 2, "test over")
    assert b"INCONSISTENT" not in out.read_bytes()
    exact_steps(out)


async def test_no_consistent_epoch_refuses_the_restore_with_the_file_named(tmp_path, nodes):
    n1 = nodes("n1", max_bytes=1024**2)
    n2 = nodes("n2", max_bytes=1024**2)
    wd = tmp_path / "wd"
    spec = await run_writer(n1, wd, "100000", "0.02", "1000", "2", "0")
    out = JobFiles(n1.storage, "1").output
    await until(lambda: steps_in(out) >= 10)
    await n1.checkpoint("1", 1, stop=False)
    at_dump = steps_in(out)
    await until(lambda: steps_in(out) >= at_dump + 5)
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())
    before = (wd / "state.bin").read_bytes()
    with pytest.raises(NoEpoch, match=r"no epoch can be restored \(.*big.bin was rewritten in place since epoch 1"):
        await n2.restore(spec, 2)
    assert (wd / "state.bin").read_bytes() == before  # a refused epoch changes nothing
    assert not any(p.name.startswith("revenant-after-epoch-") for p in wd.iterdir())
