"""A delta epoch served lazily (agent/lazyrestore/deltaserve.py): the scratch images criu restore
reads (only the pages it reads itself, the rest holes), and criu's page-server protocol answered
from the recipes, each page checked against the epoch's digest of it; corrupt pages, odd requests
and pre-dumped epochs.  Real criu through it: tests/test_incremental_cluster.py."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest

from revenant.agent.lazyrestore import deltaserve
from revenant.agent.lazyrestore.deltaserve import HEADER, PE_LAZY, PE_PARENT, PE_PRESENT, PS_IOV_GET
from revenant.agent.storage import chain, packs
from revenant.agent.storage.epochs import CorruptEpoch, JobFiles, Manifest

pytestmark = pytest.mark.unit

PAGE = chain.PAGE
PID, NONLAZY_AT, LAZY_AT = 41, 0x400000, 0x7F0000000000
NONLAZY, LAZY = 8, 56  # pages: a stack's, then private anonymous memory's


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def pagemap(pages_id: int, extents: list[tuple[int, int, int]]) -> bytes:
    """A criu pagemap image: the magics, a head, then (vaddr, pages, flags) entries."""
    msgs = [b"\x08" + varint(pages_id)]
    msgs += [b"\x08" + varint(v) + b"\x10" + varint(n) + b"\x20" + varint(f) for v, n, f in extents]
    return b"\0" * 8 + b"".join(struct.pack("=I", len(m)) + m for m in msgs)


EXTENTS = [(NONLAZY_AT, NONLAZY, PE_PRESENT), (LAZY_AT, LAZY, PE_PRESENT | PE_LAZY)]


def commit(files: JobFiles, body: list[bytes], extents=EXTENTS) -> Manifest:
    tmp = files.new_tmp("n1")
    (tmp / "pages-1.img").write_bytes(b"".join(body))
    (tmp / f"pagemap-{PID}.img").write_bytes(pagemap(1, extents))
    (tmp / "core-1.img").write_bytes(b"core")
    m = Manifest(job=files.job, epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.2.1",
                 kernel="k")
    return files.commit(tmp, m)


def three_epochs(tmp_path, extents=EXTENTS) -> tuple[JobFiles, dict[int, bytes]]:
    """Epochs 1-3 of a 64-page image, a few pages changed between them; 1 and 2 converted."""
    files, rnd = JobFiles(tmp_path / "storage", "7"), random.Random(5)
    body = [rnd.randbytes(PAGE) for _ in range(NONLAZY + LAZY)]
    images = {}
    for n in (1, 2, 3):
        images[commit(files, body, extents).epoch] = b"".join(body)
        for i in (3, 20, 40):
            body[i] = rnd.randbytes(PAGE)
    packs.convert(files, 1, 10)
    packs.convert(files, 2, 10)
    assert all(deltaserve.servable(files.read_manifest(n)) for n in (1, 2))
    return files, images


def ask(sock: socket.socket, vaddr: int, nr: int, pid: int = PID) -> tuple[int, bytes]:
    sock.sendall(HEADER.pack(PS_IOV_GET, nr, vaddr, pid))
    cmd, got, at, dst = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert (at, dst) == (vaddr, pid) and 0 < got <= nr
    return got, sock.recv(got * PAGE, socket.MSG_WAITALL)


OPEN: list[deltaserve.DeltaServer] = []


@pytest.fixture(autouse=True)
def _closed():
    yield
    while OPEN:
        OPEN.pop().close()


def serving(files: JobFiles, n: int, dest) -> tuple[deltaserve.DeltaServer, socket.socket]:
    server = deltaserve.prepare(files, files.read_manifest(n), dest)
    assert server is not None
    OPEN.append(server)
    server.start()
    return server, server.theirs


def test_scratch_holds_what_criu_reads_itself_and_the_server_the_rest_exactly(tmp_path):
    files, images = three_epochs(tmp_path)
    for n in (1, 2):
        server, sock = serving(files, n, tmp_path / f"r{n}")
        scratch = (tmp_path / f"r{n}" / "pages-1.img").read_bytes()
        assert len(scratch) == len(images[n])
        assert scratch[:NONLAZY * PAGE] == images[n][:NONLAZY * PAGE]  # the stack: criu restore reads it
        assert scratch[NONLAZY * PAGE:] == bytes(LAZY * PAGE)  # the rest: holes, served
        assert (tmp_path / f"r{n}" / "core-1.img").read_bytes() == b"core"
        served, vaddr = b"", LAZY_AT
        while vaddr < LAZY_AT + LAZY * PAGE:  # in requests of 7 pages, as the daemon's grow and shrink
            got, data = ask(sock, vaddr, min(7, (LAZY_AT + LAZY * PAGE - vaddr) // PAGE))
            served += data
            vaddr += got * PAGE
        assert served == images[n][NONLAZY * PAGE:]
        sock.sendall(HEADER.pack(deltaserve.PS_IOV_FORCE_CLOSE, 0, 0, 0))
        assert struct.unpack("=i", sock.recv(4, socket.MSG_WAITALL)) == (0,)
        assert server.outcome() == ("", False) and server.served == LAZY * PAGE


def test_a_corrupt_page_is_refused_as_served_naming_the_pack_and_page(tmp_path):
    files, images = three_epochs(tmp_path)
    m = files.read_manifest(2)
    ref = next(r for r in m.packs if r.split("/")[1].startswith("2-"))  # image pages 3, 20, 40 (changed after 2)
    with open(chain.pack_path(files, ref), "r+b") as f:  # its page 1: the image's page 20, a lazy one
        f.seek(PAGE + 9)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    server, sock = serving(files, 2, tmp_path / "r")
    served, vaddr = b"", LAZY_AT
    while True:
        sock.sendall(HEADER.pack(PS_IOV_GET, LAZY, vaddr, PID))
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
        if not head:  # refused: the daemon sees the server hang up
            break
        got = HEADER.unpack(head)[1]
        served += sock.recv(got * PAGE, socket.MSG_WAITALL)
        vaddr += got * PAGE
    assert served == images[2][NONLAZY * PAGE:20 * PAGE]  # every page before it, never the corrupt one
    why, corrupt = server.outcome()
    assert corrupt and why == f"epoch 2: pages-1.img: page 20 (page 1 of pack {ref}) does not match its digest", why


def test_a_corrupt_page_criu_reads_itself_fails_the_preparation(tmp_path):
    files, _ = three_epochs(tmp_path)
    image = files.epoch_dir(3) / "pages-1.img"
    with open(image, "r+b") as f:  # page 1 (the stack's), which epochs 1-3 share
        f.seek(PAGE + 7)
        f.write(b"\xff\xfe")
    with pytest.raises(CorruptEpoch, match=r"epoch 1: pages-1.img: page 1 \(page 1 of image @3/pages-1.img\)"):
        deltaserve.prepare(files, files.read_manifest(1), tmp_path / "r")


def test_a_request_outside_the_epoch_is_an_error_not_corruption(tmp_path):
    files, _ = three_epochs(tmp_path)
    for vaddr, pid in ((LAZY_AT, PID + 1), (LAZY_AT + LAZY * PAGE, PID), (LAZY_AT + 5, PID)):
        server, sock = serving(files, 1, tmp_path / f"r{vaddr}-{pid}")
        sock.sendall(HEADER.pack(PS_IOV_GET, 1, vaddr, pid))
        assert sock.recv(HEADER.size) == b""
        why, corrupt = server.outcome()
        assert not corrupt and f"page {vaddr:#x} of pid {pid}, which the epoch does not hold" in why
    server, sock = serving(files, 1, tmp_path / "cmd")
    sock.sendall(HEADER.pack(1, 1, LAZY_AT, PID))
    assert sock.recv(HEADER.size) == b"" and "page-server command 0x1, not a request" in server.outcome()[0]


def test_an_aborted_restore_stops_the_server(tmp_path):
    files, _ = three_epochs(tmp_path)
    server, sock = serving(files, 1, tmp_path / "r")
    server.close()
    assert server.outcome() == ("", False)
    never = deltaserve.prepare(files, files.read_manifest(1), tmp_path / "r2")
    never.close()  # never started: its files are closed all the same
    assert never.reader._fds == {}


def test_pages_in_a_parent_or_a_pre_dump_are_rebuilt_instead(tmp_path):
    files, _ = three_epochs(tmp_path, [(NONLAZY_AT, NONLAZY, PE_PARENT), (LAZY_AT, NONLAZY + LAZY, PE_PRESENT)])
    assert deltaserve.prepare(files, files.read_manifest(1), tmp_path / "r") is None
    assert not (tmp_path / "r").exists()  # nothing made: the caller rebuilds it there
    m = files.read_manifest(1)
    entry = m.recipes["pages-1.img"]
    assert not deltaserve.servable(Manifest(**{**msgspec_fields(m), "files": {**m.files, "predump/pages-2.img": m.files["core-1.img"]}}))
    assert not deltaserve.servable(Manifest(**{**msgspec_fields(m), "recipes": {
        "pages-1.img": type(entry)(**{**msgspec_fields(entry), "recipe": "pages-1.recipe"})}}))
    assert not deltaserve.servable(files.read_manifest(3))  # plain: no recipes at all


def msgspec_fields(obj) -> dict:
    return {f: getattr(obj, f) for f in obj.__struct_fields__}


def test_a_corrupt_page_shared_with_the_newest_image_is_named_there(tmp_path):
    files, images = three_epochs(tmp_path)
    with open(files.epoch_dir(3) / "pages-1.img", "r+b") as f:  # page 30: unchanged since epoch 1
        f.seek(30 * PAGE + 99)
        f.write(b"\x00\x01\x02")
    for n in (1, 2):  # both read it from there
        server, sock = serving(files, n, tmp_path / f"r{n}")
        data, vaddr = b"", LAZY_AT
        while vaddr < LAZY_AT + (30 - NONLAZY) * PAGE:  # pages 8-29: whole
            got, more = ask(sock, vaddr, (LAZY_AT + (30 - NONLAZY) * PAGE - vaddr) // PAGE)
            data, vaddr = data + more, vaddr + got * PAGE
        assert data == images[n][NONLAZY * PAGE:30 * PAGE]
        sock.sendall(HEADER.pack(PS_IOV_GET, 1, LAZY_AT + (30 - NONLAZY) * PAGE, PID))
        assert sock.recv(HEADER.size) == b""
        assert server.outcome() == (f"epoch {n}: pages-1.img: page 30 (page 30 of image @3/pages-1.img) does not "
                                    "match its digest", True)
