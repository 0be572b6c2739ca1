"""A vacated job's connections held on its node (agent/network/netlock.py), and what a job's sockets say
of themselves (agent/network/netstate.py): the table criu's lock is named by, the holds an agent notes
and a later one lets go, with the real nft."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from revenant.agent.network import netlock, netstate

NFT = netlock.locate() or "nft"  # set-up installs it (Debian package nftables)


@pytest.mark.unit
def test_criu_names_its_lock_by_its_run_id_cut_to_its_buffer(tmp_path):
    # (a protobuf inventory: the run id is a string field among others)
    (tmp_path / "inventory.img").write_bytes(b"\x54\x4f\x80\x58\x12\x24" + b"1aa5ad7b-09ef-4c4e-a8f3-0c1d2e3f4a5b"
                                             + b"\x18\x01")
    assert netlock.criu_table(tmp_path) == "CRIU-1aa5ad7b-09ef-4c4e-a8"
    assert len("inet " + netlock.criu_table(tmp_path)) == 31  # criu's char table[32]
    (tmp_path / "inventory.img").write_bytes(b"no run id")
    assert netlock.criu_table(tmp_path) is None
    assert netlock.criu_table(tmp_path / "missing") is None


@pytest.mark.unit
def test_without_nft_the_node_says_so():
    assert "nftables" in asyncio.run(netlock.usable(None, "n1"))


@pytest.mark.criu
def test_an_agent_that_starts_lets_go_of_the_holds_an_earlier_one_noted(tmp_path):
    async def main() -> None:
        table = "CRIU-00000000-test-sweep-a"
        assert await netlock.run(NFT, "add", "table", "inet", table) == ""
        try:
            (tmp_path / "netlock-held-n1").write_text(f"{table}\n")
            step = netlock.NetLockStep(NFT, "n1", tmp_path)
            assert await step.sweep() == [table]
            assert (tmp_path / "netlock-held-n1").read_text() == ""
            assert "No such file" in await netlock.run(NFT, "list", "table", "inet", table)
            assert await netlock.NetLockStep(NFT, "n2", tmp_path).sweep() == []  # another node's: none noted
        finally:
            await netlock.run(NFT, "delete", "table", "inet", table)
    asyncio.run(main())


@pytest.mark.criu
def test_an_agent_that_starts_removes_the_locks_of_a_vacate_an_earlier_one_died_in(tmp_path):
    """The agent (and its criu with it) killed mid-vacate: no hold was noted, but the vacate noted
    the tables there were before it; the next agent of the node removes those that appeared
    since, and keeps those that were there, and those another agent of the host holds."""
    from revenant.agent.storage.epochs import JobFiles, Manifest
    from revenant.agent.pipeline.steps import DumpContext

    m = Manifest(job="9", epoch=0, generation=1, node="n1", created_at=1.0, criu_version="4.2.1", kernel="k")
    older, theirs, made = "CRIU-00000000-test-dead-old", "CRIU-00000000-test-dead-n2h", "CRIU-00000000-test-dead-new"

    async def main() -> None:
        assert await netlock.run(NFT, "add", "table", "inet", older) == ""
        ctx = DumpContext(job="9", generation=1, pid=os.getpid(), files=JobFiles(tmp_path, "9"), workdir=tmp_path,
                          stop=True, manifest=m, epoch_tmp=tmp_path)
        await netlock.NetLockStep(NFT, "n1", tmp_path).before_dump(ctx)  # then the agent dies
        assert ctx.keep_connections and (tmp_path / "netlock-dump-n1-9").exists()
        for table in (made, theirs):  # its criu's; another agent's hold, made meanwhile
            assert await netlock.run(NFT, "add", "table", "inet", table) == ""
        (tmp_path / "netlock-held-n2").write_text(f"{theirs}\n")
        assert await netlock.NetLockStep(NFT, "n1", tmp_path).sweep() == [made]
        assert not (tmp_path / "netlock-dump-n1-9").exists()
        assert "No such file" in await netlock.run(NFT, "list", "table", "inet", made)
        for kept in (older, theirs):
            assert await netlock.run(NFT, "list", "table", "inet", kept) == ""
    try:
        asyncio.run(main())
    finally:
        for table in (older, theirs, made):
            asyncio.run(netlock.run(NFT, "delete", "table", "inet", table))


HOLDER = r"""
import socket, sys, time
tcp4 = socket.create_server(("127.0.0.1", 0))
tcp6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 0))
unbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
out = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
mapped = socket.socket(socket.AF_INET6); mapped.connect(("::ffff:127.0.0.1", int(sys.argv[1])))
unix = socket.socketpair()
print(tcp4.getsockname()[1], tcp6.getsockname()[1], udp.getsockname()[1], out.getsockname()[1],
      mapped.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.mark.criu
def test_a_jobs_sockets_are_told_by_the_sockets_themselves():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        tcp4, tcp6, udp, out, mapped = map(int, proc.stdout.readline().split())
        listening, connections = netstate.sockets(proc.pid)
        assert listening == sorted([f"tcp 127.0.0.1:{tcp4}", f"tcp [::1]:{tcp6}", f"udp 127.0.0.1:{udp}"])
        assert connections == sorted([f"127.0.0.1:{out} -> 127.0.0.1:{port}",
                                      f"[::ffff:127.0.0.1]:{mapped} -> [::ffff:127.0.0.1]:{port}"])
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        server.close()


@pytest.mark.criu
def test_an_epochs_sockets_are_read_from_crius_images_as_the_running_job_shows_them(tmp_path):
    """What show job and the restored event list of an epoch comes from criu's images, after the
    dump (the job is not kept frozen for it), and says what the running job's sockets say."""
    from revenant.agent.network import criuimages
    from revenant.agent.pipeline.criu import locate_criu

    server = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(server.getsockname()[1])], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        proc.stdout.readline()
        live = netstate.sockets(proc.pid)
        images = tmp_path / "images"
        images.mkdir()
        done = subprocess.run([locate_criu(), "dump", "-t", str(proc.pid), "-D", str(images), "-W", str(tmp_path),
                               "-o", "dump.log", "--leave-running", "--tcp-close", "--ext-unix-sk",
                               "--shell-job"], capture_output=True, text=True)
        assert done.returncode == 0, (tmp_path / "dump.log").read_text()[-2000:]
        assert criuimages.inet_sockets(images, netstate.MAX_LISTED) == live
        assert len(live[0]) == 3 and len(live[1]) == 2
        assert netstate.sockets(proc.pid) == live  # --tcp-close: the job's connections untouched
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        server.close()


@pytest.mark.unit
def test_a_malformed_files_image_is_an_error_not_a_guess(tmp_path):
    from revenant.agent.network import criuimages
    (tmp_path / "files.img").write_bytes(b"\0" * 8 + (20).to_bytes(4, "little") + b"\x08\x04\x22\x30\x08")
    with pytest.raises(ValueError, match="files.img is malformed"):
        criuimages.inet_sockets(tmp_path, 64)
    (tmp_path / "files.img").write_bytes(b"\0" * 8)
    assert criuimages.inet_sockets(tmp_path, 64) == ([], [])


@pytest.mark.criu
def test_a_vacates_hold_keeps_crius_lock_until_a_restore_here_or_its_end(tmp_path):
    """The hold names criu's table from the images and the connections from the epoch; a
    restore of that epoch here is told to keep them, one of another epoch lets them go; a hold
    that ends unused removes the table (the peers then get their reset)."""
    from revenant.agent.storage.epochs import JobFiles, Manifest
    from revenant.agent.pipeline.steps import DumpContext, RestoreContext
    from revenant.messages import CheckpointPolicy

    server = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(server.getsockname()[1])], stdout=subprocess.PIPE,
                            text=True)
    run_id = "0badc0de-1234-4321-abcd-0123456789ab"
    table = f"CRIU-{run_id[:21]}"

    def dump(stop: bool, policy: CheckpointPolicy | None = None) -> DumpContext:
        m = Manifest(job="9", epoch=0, generation=3, node="n1", created_at=1234.5, criu_version="4.2.1", kernel="k",
                     connections=netstate.sockets(proc.pid)[1])  # (the files step reads them from the images)
        return DumpContext(job="9", generation=3, pid=proc.pid, files=JobFiles(tmp_path, "9"), workdir=tmp_path,
                           stop=stop, manifest=m, epoch_tmp=tmp_path, policy=policy)

    def restore(created_at: float) -> RestoreContext:
        m = Manifest(job="9", epoch=2, generation=3, node="n1", created_at=created_at, criu_version="4.2.1",
                     kernel="k")
        return RestoreContext(job="9", generation=4, files=JobFiles(tmp_path, "9"), epoch_dir=tmp_path,
                              workdir=tmp_path, manifest=m)

    async def main() -> None:
        proc.stdout.readline()
        (tmp_path / "inventory.img").write_bytes(b"\0" * 12 + run_id.encode())
        step = netlock.NetLockStep(NFT, "n1", tmp_path, hold_s=30)
        for ctx in (dump(False), dump(True, CheckpointPolicy(connections="close"))):  # a create; a close job's vacate
            await step.before_dump(ctx)
            assert not ctx.keep_connections
        ctx = dump(True)
        await step.before_dump(ctx)
        assert ctx.keep_connections  # criu dumps them whole, under its lock
        assert await netlock.run(NFT, "add", "table", "inet", table) == ""  # (criu's, as its lock leaves it)
        await step.after_dump(ctx)
        hold = step.holds["9"]
        assert hold.table == table and len(hold.connections) == 2
        assert (tmp_path / "netlock-held-n1").read_text() == f"{table}\n"
        other = restore(1.0)
        await step.before_restore(other)  # another epoch: closed, and the lock goes
        assert not other.keep_connections and step.holds == {}
        assert "No such file" in await netlock.run(NFT, "list", "table", "inet", table)

        assert await netlock.run(NFT, "add", "table", "inet", table) == ""
        await step.before_dump(ctx)
        await step.after_dump(ctx)
        same = restore(1234.5)
        await step.before_restore(same)
        assert same.keep_connections and step.holds["9"].timer is None  # claimed: no expiry mid-restore
        await step.after_restore(same)
        assert netlock.kept_of([step], "9") == hold.connections and step.holds == {}
        assert "came back intact" in same.notes[0]
        assert "No such file" in await netlock.run(NFT, "list", "table", "inet", table)

        assert await netlock.run(NFT, "add", "table", "inet", table) == ""  # a restore here that fails
        await step.before_dump(ctx)
        await step.after_dump(ctx)
        await step.before_restore(restore(1234.5))
        await netlock.restore_failed([step], "9")
        assert step.holds == {} and "No such file" in await netlock.run(NFT, "list", "table", "inet", table)

        assert await netlock.run(NFT, "add", "table", "inet", table) == ""
        step.hold_s = 0.2
        await step.before_dump(ctx)
        await step.after_dump(ctx)
        await asyncio.sleep(0.4)
        assert "9" in step.holds  # its clock starts when the vacate has committed and killed the job
        netlock.vacated([step], "9")
        await asyncio.sleep(0.6)  # unused: let go
        assert step.holds == {} and "No such file" in await netlock.run(NFT, "list", "table", "inet", table)
    try:
        asyncio.run(main())
    finally:
        asyncio.run(netlock.run(NFT, "delete", "table", "inet", table))
        proc.kill()
        proc.wait()
        proc.stdout.close()
        server.close()


@pytest.mark.criu
def test_a_vacate_that_fails_before_its_hold_leaves_no_lock_of_criu_behind(tmp_path):
    """criu killed mid-dump writes no inventory, but its table is there: the tables that appeared
    during the dump go (and one named by an inventory, when criu got that far)."""
    from revenant.agent.storage.epochs import JobFiles, Manifest
    from revenant.agent.pipeline.steps import DumpContext

    m = Manifest(job="8", epoch=0, generation=1, node="n1", created_at=1.0, criu_version="4.2.1", kernel="k")
    before = "CRIU-00000000-test-older-aa"  # another vacate's, held before this dump began

    async def main() -> None:
        assert await netlock.run(NFT, "add", "table", "inet", before) == ""
        step = netlock.NetLockStep(NFT, "n1", tmp_path)
        ctx = DumpContext(job="8", generation=1, pid=os.getpid(), files=JobFiles(tmp_path, "8"), workdir=tmp_path,
                          stop=True, manifest=m, epoch_tmp=tmp_path)
        await step.before_dump(ctx)
        assert ctx.keep_connections
        made = "CRIU-00000000-test-killed-a"
        assert await netlock.run(NFT, "add", "table", "inet", made) == ""  # criu's, then criu killed
        await step.on_dump_failed(ctx)
        assert "No such file" in await netlock.run(NFT, "list", "table", "inet", made)
        assert await netlock.run(NFT, "list", "table", "inet", before) == ""  # not this dump's: kept
    try:
        asyncio.run(main())
    finally:
        for table in (before, "CRIU-00000000-test-killed-a"):
            asyncio.run(netlock.run(NFT, "delete", "table", "inet", table))


@pytest.mark.criu
def test_a_dump_that_holds_nothing_leaves_no_lock_behind(tmp_path):
    """A vacate that holds no connection (and a create) dumps with no lock at all: criu's own
    default would make a table at every dump and leave it whenever the job is left stopped."""
    from pathlib import Path

    from revenant.agent.pipeline import criu
    from revenant.agent.pipeline.criu import locate_criu

    server = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(server.getsockname()[1])], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        proc.stdout.readline()
        before = set(asyncio.run(netlock.tables(NFT, netlock.CRIU_PREFIX)))
        script = tmp_path / "action.sh"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
        for stop, images in ((False, tmp_path / "create"), (True, tmp_path / "vacate")):
            images.mkdir()
            argv = criu.dump_argv(locate_criu(), pid=proc.pid, images=images, workdir=tmp_path, action_script=script,
                                  leave_running=not stop)
            done = subprocess.run(argv, capture_output=True, text=True)
            assert done.returncode == 0, (Path(tmp_path) / criu.DUMP_LOG).read_text()[-2000:]
        assert set(asyncio.run(netlock.tables(NFT, netlock.CRIU_PREFIX))) == before
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        server.close()
