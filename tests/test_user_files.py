"""A user's job holding a named FIFO and a file it deleted, in the user's own directory
(agent/files/asuser/files.py): checkpointed, and both handed to criu at the restore by the user,
never opened or written again at their paths by root.  A vacate and a restore on another node
(two supervisors on one storage) carry the FIFO's queued bytes and the deleted file's content,
at the job's offsets; a FIFO gone since is made again by the user, with its mode; a directory
swapped for a link into root's directory makes the restore fail as the user would, touching
nothing there.  A root's job there is still refused (tests/test_security_remade.py)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from helpers import until
from test_job_user import PYTHON, test_user  # noqa: F401 - the fixture: an unprivileged user

from revenant.agent.files.asuser import files as userfiles
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

# Each step: a line appended to the deleted file (checked whole, from its start), and an 8-byte
# record through the FIFO, one always queued in it (written a step before it is read).
JOB = """import os, sys, time
d, hold = sys.argv[1], sys.argv[2]
fifo = scratch = None
if "fifo" in hold:
    if not os.path.exists(d + "/pipe"):
        os.mkfifo(d + "/pipe", 0o640)
    fifo = os.open(d + "/pipe", os.O_RDWR)
    os.write(fifo, b"%08d" % 0)
if "deleted" in hold:
    scratch = os.open(d + "/scratch", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
    os.unlink(d + "/scratch")
n, want = 0, b""
while True:
    n += 1
    ok = True
    if fifo is not None:
        os.write(fifo, b"%08d" % n)
        ok = ok and os.read(fifo, 8) == b"%08d" % (n - 1)
    if scratch is not None:
        os.write(scratch, b"%d\\n" % n)
        want += b"%d\\n" % n
        ok = ok and os.pread(scratch, 1 << 20, 0) == want
    print(n if ok else f"INCONSISTENT {n}", flush=True)
    time.sleep(0.02)
"""


@pytest.fixture
def place(test_user):
    """/var/tmp/<place> (root's 0755): ``wd`` (the user's workdir) and ``run`` (the user's
    directory for the FIFO and the deleted file), and ``root-only`` (root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="revenant-userfile-", dir="/var/tmp"))
    base.chmod(0o755)
    for name in ("wd", "run"):
        (base / name).mkdir()
        os.chown(base / name, test_user.uid, test_user.gid)
    (base / "root-only").mkdir(mode=0o700)
    (base / "wd" / "job.py").write_text(JOB)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def counts(out: Path) -> list[int]:
    text = out.read_text()
    assert "INCONSISTENT" not in text
    return [int(line) for line in text.split()]


def _spec(place: Path, user, hold: str = "fifo,deleted") -> JobSpec:
    return JobSpec(id="1", argv=[PYTHON, str(place / "wd" / "job.py"), str(place / "run"), hold],
                   workdir=str(place / "wd"), user=user.name)


async def _vacated(sup, spec: JobSpec) -> Path:
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(counts(out)) >= 10)
    await sup.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in sup.jobs)
    [epoch] = JobFiles(sup.storage, "1").committed()
    return JobFiles(sup.storage, "1").epoch_dir(epoch)


async def test_a_users_fifo_and_deleted_file_come_back_by_the_user_on_another_node(place, supervisors, test_user):
    n1, n2 = supervisors("n1", allow_root_jobs=False), supervisors("n2", allow_root_jobs=False)
    spec = _spec(place, test_user)
    epoch_dir = await _vacated(n1, spec)
    taken = {f.kind: f for f in userfiles.read(epoch_dir)}
    assert set(taken) == {"fifo", "deleted"}, taken
    assert taken["fifo"].path == str(place / "run" / "pipe") and taken["fifo"].uid == test_user.uid
    assert taken["deleted"].path == str(place / "run" / "scratch") and taken["deleted"].size > 0
    assert (epoch_dir / taken["deleted"].copy).stat().st_size == taken["deleted"].size
    out = JobFiles(n1.storage, "1").output
    at = len(counts(out))
    os.unlink(place / "run" / "pipe")  # gone since: made again by the user
    await n2.restore(spec, 2)
    await until(lambda: len(counts(out)) >= at + 20)
    got = counts(out)
    assert got == list(range(1, len(got) + 1))  # one unbroken count: both came back as they were
    st = os.lstat(place / "run" / "pipe")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert (st.st_uid, st.st_gid) == (test_user.uid, test_user.gid)
    assert os.listdir(place / "run") == ["pipe"]  # the deleted file came back unnamed
    # And again from the restored job: what the user handed over is checkpointed like the first.
    await n2.checkpoint("1", 2, stop=True)
    await until(lambda: "1" not in n2.jobs)
    at = len(counts(out))
    await n1.restore(spec, 3)
    await until(lambda: len(counts(out)) >= at + 10)
    got = counts(out)
    assert got == list(range(1, len(got) + 1))


@pytest.mark.parametrize("hold", ["fifo", "deleted"])
async def test_a_directory_swapped_for_a_link_to_roots_makes_the_restore_fail_as_the_user(
        place, supervisors, test_user, hold):
    n1 = supervisors("n1", allow_root_jobs=False)
    spec = _spec(place, test_user, hold)
    await _vacated(n1, spec)
    # What the user could do at any moment of a restore: its directory now leads into root's,
    # where root has a FIFO of the same name.
    os.mkfifo(place / "root-only" / "pipe", 0o600)
    os.rename(place / "run", place / "run.orig")
    os.symlink(place / "root-only", place / "run")
    with pytest.raises(RevenantError) as refused:
        await n1.restore(spec, 2)
    why = str(refused.value)
    assert "cannot open its file again as its user" in why and "Permission denied" in why, why
    assert len(why.splitlines()) == 1
    assert os.listdir(place / "root-only") == ["pipe"]  # nothing made there
    os.unlink(place / "run")
    os.rename(place / "run.orig", place / "run")
    out = JobFiles(n1.storage, "1").output
    at = len(counts(out))
    await n1.restore(spec, 3)
    await until(lambda: len(counts(out)) >= at + 10)


async def test_a_users_job_checkpointed_through_node_local_staging_restores(place, supervisors, test_user, tmp_path):
    """What the dump writes beside the images (what criu makes again by path, every path the job
    held, what is taken from the user) goes from node-local staging to the storage with them,
    signed: a user's epoch without ``remade.json`` is refused at a restore."""
    n1 = supervisors("n1", allow_root_jobs=False, staging=tmp_path / "staging")
    spec = _spec(place, test_user)
    epoch_dir = await _vacated(n1, spec)
    m = JobFiles(n1.storage, "1").read_manifest(int(epoch_dir.name))
    assert {"remade.json", "held.json", "user-files.json"} <= set(m.files), sorted(m.files)
    out = JobFiles(n1.storage, "1").output
    at = len(counts(out))
    await n1.restore(spec, 2)
    await until(lambda: len(counts(out)) >= at + 10)
