"""Checkpoint images are private (agent/storage/private.py): after a real checkpoint every path under the
job's epochs/ is root's, directories 0700 and files 0600, whatever the agent's umask and whether
criu wrote an image in place or it was copied from staging; another user cannot read a job's
memory from its pages-*.img even with every directory above it opened to 0755."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import until
from conftest import REPO
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

WRITER = REPO / "tests" / "jobs" / "filewriter.py"


@pytest.fixture
def storage():
    """Storage outside pytest's own (0700) temporary tree, so that loosening its modes means
    something; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="revenant-private-"))
    path.chmod(0o755)
    yield path / "storage"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def supervisor(supervisors, storage):
    return lambda **engine_kw: supervisors("n1", storage, **engine_kw)



def steps_in(path: Path) -> int:
    return path.read_bytes().count(b"step ") if path.exists() else 0


def nobody_reads(path: Path) -> bool:
    """Whether user nobody can open ``path`` for reading."""
    user = pwd.getpwnam("nobody")
    done = subprocess.run(["/bin/cat", str(path)], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=30)
    assert done.returncode == 0 or "Permission denied" in done.stderr, done.stderr
    return done.returncode == 0


def assert_private(tree: Path) -> list[Path]:
    """Every path under ``tree`` (itself included) is root's, 0700 or 0600; returns the files."""
    files = []
    for root, dirs, names in os.walk(tree):
        for path in [Path(root)] + [Path(root) / n for n in dirs + names]:
            st = os.lstat(path)
            assert (st.st_uid, st.st_gid) == (0, 0), path
            if stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o700, (path, oct(st.st_mode))
            else:
                assert stat.S_ISREG(st.st_mode), path
                assert stat.S_IMODE(st.st_mode) == 0o600, (path, oct(st.st_mode))
                files.append(path)
    return files


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
async def test_epochs_are_root_only_whatever_the_umask(tmp_path, storage, supervisor, staged):
    # A careless umask: without the fix, criu's images would be 0666 and directories 0777.
    old = os.umask(0)
    try:
        sup = supervisor(staging=tmp_path / "staging" if staged else None)
        wd = tmp_path / "wd"
        wd.mkdir(mode=0o755)  # a root job's workdir no one else may write (0777 under this umask)
        spec = JobSpec(id="1", argv=[sys.executable, str(WRITER), "100000", "0.02", "1000"], workdir=str(wd),
                       max_epochs=3)
        await sup.start(spec, 1)
        out = JobFiles(storage, "1").output
        await until(lambda: steps_in(out) >= 5)
        first = await sup.checkpoint("1", 1, stop=False)
        assert sup.engine is not None
        # The manifest records who owns the job.
        manifest, _, _ = await sup.engine.checkpoint("1", 1, sup.jobs["1"].pid, stop=False, workdir=str(wd),
                                                  user="nobody")
    finally:
        os.umask(old)
    files = JobFiles(storage, "1")
    assert files.committed() == [first.epoch.n, manifest.epoch]
    assert files.read_manifest(manifest.epoch).user == "nobody" == manifest.user
    assert files.read_manifest(first.epoch.n).user == spec.user
    private = assert_private(files.epochs_dir)
    latest = files.epoch_dir(manifest.epoch)
    names = {p.relative_to(latest).as_posix() for p in private if latest in p.parents}
    assert any(n.startswith("pages-") for n in names) and "manifest.json" in names
    assert any(n.startswith("files/") for n in names)  # the job's own files, copied
    if staged:  # and nothing of the staging is left behind, private or not
        assert list((tmp_path / "staging").iterdir()) == []
    await sup.kill("1", 1, "test over")


async def test_nobody_cannot_read_a_jobs_memory_even_through_open_directories(tmp_path, storage, supervisor):
    sup = supervisor()
    wd = tmp_path / "wd"
    wd.mkdir()
    secret = "the-secret-" + os.urandom(8).hex()
    argv = [sys.executable, "-c", f"import time\nsecret = {secret!r} * 1000\n"
            "while True:\n    print('step', 1, flush=True)\n    time.sleep(0.05)\n"]
    await sup.start(JobSpec(id="1", argv=argv, workdir=str(wd)), 1)
    files = JobFiles(storage, "1")
    await until(lambda: steps_in(files.output) >= 2)
    done = await sup.checkpoint("1", 1, stop=True)
    epoch = files.epoch_dir(done.epoch.n)
    pages = [p for p in epoch.iterdir() if p.name.startswith("pages-")]
    assert pages and any(secret.encode() in p.read_bytes() for p in pages)
    # An operator loosens every directory on the way (the job's own directory may belong to its
    # user, too): the images' own modes still keep them private.
    for d in (storage, storage / "jobs", files.dir, files.epochs_dir, epoch):
        d.chmod(0o755)
    control = files.dir / "control"
    control.write_bytes(b"readable")
    control.chmod(0o644)
    assert nobody_reads(control)  # the path is open to nobody: only the modes below stop it
    for page in pages:
        assert stat.S_IMODE(page.stat().st_mode) == 0o600
        assert not nobody_reads(page)
    assert not nobody_reads(epoch / "manifest.json")
