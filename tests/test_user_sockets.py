"""A user's job listening on a unix socket in the user's own directory (agent/files/asuser/sockets.py):
checkpointed, and its socket made again at the restore by the user, never by root: a vacate and a
restore on another node (two supervisors on one storage) answer on the same path, the socket
file the user's with its mode; a directory on its way swapped for a link into root's directory
makes the restore fail as the user would, touching nothing there; a connection the job accepted
from itself is carried (criu joins it to its peer, given no name); a connection waiting to be
accepted at the dump (the job's own: one from outside the job is dropped, as criu drops it)
fails that checkpoint only.  A root's job there is still refused
(tests/test_security_remade.py)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from helpers import until
from test_job_user import PYTHON, test_user  # noqa: F401 - the fixture: an unprivileged user

from revenant.agent.files.asuser import sockets as usersockets
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

SERVER = """import os, select, socket, sys, time
path, mode = sys.argv[1], sys.argv[2]
if os.path.lexists(path):
    os.unlink(path)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o770)
s.listen(8)
pair = None
if mode == "deleted":  # a first listener, its file deleted, then this one bound at the same path
    old = s
    os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(8)
if mode in ("self", "pair"):  # a connection of its own: never accepted, or accepted and used each step
    me = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    me.connect(path)
    if mode == "pair":
        pair, _ = s.accept()  # named as its listener: getsockname() says path
s.setblocking(False)
n = 0
while True:
    n += 1
    if pair is not None:
        me.sendall(b"x")
        if pair.recv(1) != b"x":
            print("INCONSISTENT", flush=True)
    print(n, flush=True)
    if mode in ("accept", "pair") and select.select([s], [], [], 0.02)[0]:
        c, _ = s.accept()
        c.setblocking(True)
        c.sendall(f"pong {os.getuid()}\\n".encode())
        c.close()
    else:
        time.sleep(0.02)
"""


@pytest.fixture
def place(test_user):
    """/var/tmp/<place> (root's 0755): ``wd`` (the user's workdir) and ``run`` (the user's
    directory for the socket, outside the workdir), and ``root-only`` (root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="revenant-usersock-", dir="/var/tmp"))
    base.chmod(0o755)
    for name in ("wd", "run"):
        (base / name).mkdir()
        os.chown(base / name, test_user.uid, test_user.gid)
    (base / "root-only").mkdir(mode=0o700)
    (base / "wd" / "server.py").write_text(SERVER)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def ping(path: Path) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        return s.recv(64).decode().strip()


def counts(out: Path) -> list[int]:
    text = out.read_text()
    assert "INCONSISTENT" not in text
    return [int(line) for line in text.split()]


def _spec(place: Path, user, mode: str = "pair") -> JobSpec:
    return JobSpec(id="1", argv=[PYTHON, str(place / "wd" / "server.py"), str(place / "run" / "sock"), mode],
                   workdir=str(place / "wd"), user=user.name)


async def test_a_users_listening_socket_comes_back_made_by_the_user_on_another_node(place, supervisors, test_user):
    n1, n2 = supervisors("n1", allow_root_jobs=False), supervisors("n2", allow_root_jobs=False)
    spec, sock = _spec(place, test_user), place / "run" / "sock"
    await n1.start(spec, 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: len(counts(out)) >= 5)
    assert ping(sock) == f"pong {test_user.uid}"
    await n1.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in n1.jobs)
    [epoch] = JobFiles(n1.storage, "1").committed()
    epoch_dir = JobFiles(n1.storage, "1").epoch_dir(epoch)
    taken = usersockets.read(epoch_dir)
    assert [sk.path for sk in taken.make] == [str(sock)] and len(taken.nameless) == 1, taken  # its accepted one
    # What criu is given names neither the listener nor the connection it accepted: criu
    # neither unlinks nor binds anything at that path.
    usersockets.shadow(epoch_dir, place / "shadow", taken)
    names = {usersockets._name(sk) for sk in usersockets._unix_sockets(epoch_dir).values()}
    assert str(sock) in names  # the dump's own images
    assert str(sock) not in {usersockets._name(sk) for sk in usersockets._unix_sockets(place / "shadow").values()}
    with pytest.raises(ConnectionRefusedError):  # the old socket file stays, with no one listening
        ping(sock)
    await n2.restore(spec, 2)
    assert ping(sock) == f"pong {test_user.uid}"
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and (st.st_uid, st.st_gid) == (test_user.uid, test_user.gid)
    assert stat.S_IMODE(st.st_mode) == 0o770
    at = len(counts(out))
    await until(lambda: len(counts(out)) >= at + 10)
    got = counts(out)
    assert got == list(range(1, len(got) + 1))  # one unbroken count, from the epoch on
    # And again from the restored job: the socket made by the user is checkpointed like the first.
    await n2.checkpoint("1", 2, stop=True)
    await until(lambda: "1" not in n2.jobs)
    await n1.restore(spec, 3)
    assert ping(sock) == f"pong {test_user.uid}"


async def test_a_directory_swapped_for_a_link_to_roots_makes_the_restore_fail_as_the_user(
        place, supervisors, test_user):
    n1 = supervisors("n1", allow_root_jobs=False)
    spec = _spec(place, test_user)
    await n1.start(spec, 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: len(counts(out)) >= 5)
    await n1.checkpoint("1", 1, stop=True)
    await until(lambda: "1" not in n1.jobs)
    # What the user could do at any moment of a restore: its directory now leads into root's,
    # where root has a socket of the same name.
    roots = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    roots.bind(str(place / "root-only" / "sock"))
    roots.close()
    os.rename(place / "run", place / "run.orig")
    os.symlink(place / "root-only", place / "run")
    with pytest.raises(RevenantError) as refused:
        await n1.restore(spec, 2)
    why = str(refused.value)
    assert "cannot make its socket again as its user" in why and "Permission denied" in why, why
    assert len(why.splitlines()) == 1
    assert os.listdir(place / "root-only") == ["sock"]  # nothing made there, nothing unlinked
    assert os.lstat(place / "root-only" / "sock").st_uid == 0
    os.unlink(place / "run")
    os.rename(place / "run.orig", place / "run")
    await n1.restore(spec, 3)
    assert ping(place / "run" / "sock") == f"pong {test_user.uid}"


@pytest.mark.parametrize("mode", ["self", "deleted"])
async def test_what_criu_would_still_make_by_the_name_fails_that_checkpoint_and_the_job_runs_on(
        place, supervisors, test_user, mode):
    """A connection of the job's own waiting to be accepted (criu would connect it again by the
    socket's name), or a listener deleted and another bound at its path (criu would bind the
    first again there, as root)."""
    n1 = supervisors("n1", allow_root_jobs=False)
    await n1.start(_spec(place, test_user, mode=mode), 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: len(counts(out)) >= 5)
    with pytest.raises(RevenantError) as refused:
        await n1.checkpoint("1", 1, stop=True)
    why = str(refused.value)
    sock = place / "run" / "sock"
    want = (f"a connection to the job's socket {sock} was waiting to be accepted" if mode == "self"
            else f"the job holds a unix socket bound to {sock}, deleted since")
    assert want in why, why
    assert len(why.splitlines()) == 1
    assert JobFiles(n1.storage, "1").committed() == []
    at = len(counts(out))
    await until(lambda: len(counts(out)) >= at + 5)  # resumed, unharmed
