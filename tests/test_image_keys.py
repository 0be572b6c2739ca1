"""Epochs that cannot be tampered with (agent/storage/imagekeys.py, docs/security.md "Epoch
integrity"): with the cluster's image keys every file of an epoch has a keyed BLAKE3 MAC, taken
as criu writes it, and the manifest is signed; a restore refuses an epoch whose signature or any
file's MAC fails, or that is unsigned, and falls back to an older one.  Keys rotate: an epoch
signed with an older key stays readable while the node holds it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import zlib
from pathlib import Path

import blake3
import msgspec
import pytest

from conftest import COUNTER, counter_reference
from helpers import until
from revenant.agent.processes import procs
from revenant.agent.storage import imagekeys, imagesum, packs
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, JobFiles, Manifest, NoEpoch, join_signed, split_signed
from revenant.common.errors import ConfigError
from revenant.messages import JobSpec


def keys_at(path: Path, rotate: bool = False) -> imagekeys.ImageKeys:
    return imagekeys.write(path, rotate)[0]


def fake_epoch(files: JobFiles, staging: Path, payload: bytes) -> Manifest:
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "pages-1.img").write_bytes(payload)
    (staging / "core-1.img").write_bytes(b"core")
    m = Manifest(job=files.job, epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.2.1",
                 kernel="k")
    return files.commit(files.new_tmp("n1"), m, staging)


# ------------------------------------------------------------------ the key file

@pytest.mark.unit
def test_the_key_file_is_private_and_rotates_keeping_the_old_keys(tmp_path):
    path = tmp_path / "image.keys"
    first, changed = imagekeys.write(path)
    assert changed and first.current == "k1" and len(first.keys["k1"]) == 32
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert imagekeys.write(path) == (first, False)  # kept
    second, changed = imagekeys.write(path, rotate=True)
    assert changed and second.current == "k2" and second.keys["k1"] == first.keys["k1"]
    assert second.digest().key_id == "k2" and second.digest("k1").file_key != second.digest().file_key
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"are readable by others \(mode 644\): chmod 600 it"):
        imagekeys.load(path)
    with pytest.raises(ConfigError, match=r"^cannot read the image keys .*/none: No such file or directory: "
                                          r"`revenant keys` writes them \(or set image_integrity = crc32\)$"):
        imagekeys.load(tmp_path / "none")
    bad = tmp_path / "bad.keys"
    bad.write_text("k1 nothex\n")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=r"bad.keys:1: not an image key"):
        imagekeys.load(bad)
    assert imagekeys.for_config("crc32", "") is None
    with pytest.raises(ConfigError, match="image_integrity = mac needs image_keys"):
        imagekeys.for_config("mac", "")


@pytest.mark.unit
def test_file_and_manifest_keys_are_derived_apart_and_the_digest_is_keyed_blake3(tmp_path):
    keys = keys_at(tmp_path / "k")
    d = keys.digest()
    h = d.new()
    h.update(b"abc")
    assert h.hexdigest() == blake3.blake3(b"abc", key=d.file_key).hexdigest() != blake3.blake3(b"abc").hexdigest()
    assert keys.manifest_mac("k1", b"abc") != h.hexdigest()  # no file MAC is ever a manifest's


# ------------------------------------------------------------------ commit and verify, pure files

@pytest.mark.unit
def test_a_signed_epoch_verifies_and_any_change_to_it_is_refused(tmp_path):
    keys = keys_at(tmp_path / "k")
    files = JobFiles(tmp_path / "s", "7", keys)
    m = fake_epoch(files, tmp_path / "st1", os.urandom(300_000))
    assert (m.checksum, m.key_id) == ("blake3-keyed", "k1") and len(m.files["pages-1.img"].checksum) == 64
    d = files.epoch_dir(1)
    body, signature = split_signed((d / MANIFEST).read_bytes())
    assert signature.startswith(b"k1 ") and files.verify(1).epoch == 1
    signed = json.loads((d / MANIFEST).read_bytes())  # still JSON, for jq and the like
    assert signed["signature"] == signature.decode() and signed["key_id"] == "k1"
    # A byte of the pages changed (size kept): the file's MAC fails.
    pages = bytearray((d / "pages-1.img").read_bytes())
    pages[1000] ^= 0xFF
    (d / "pages-1.img").write_bytes(pages)
    with pytest.raises(CorruptEpoch, match=r"^epoch 1: pages-1.img fails its checksum$"):
        files.verify(1)
    # ... and with a CRC-32 forged to match, as someone who can write the storage could: still refused.
    raw = msgspec.json.decode(body)
    raw["checksum"], raw["key_id"] = "crc32", ""
    raw["files"] = {n: {"size": (d / n).stat().st_size, "checksum": f"{zlib.crc32((d / n).read_bytes()):08x}"}
                    for n in raw["files"]}
    (d / MANIFEST).write_bytes(join_signed(msgspec.json.encode(raw), signature))
    with pytest.raises(CorruptEpoch, match=r"^epoch 1 of 7: its manifest fails its MAC"):
        files.verify(1)
    (d / MANIFEST).write_bytes(msgspec.json.encode(raw))  # the signature removed
    with pytest.raises(CorruptEpoch, match=r"^epoch 1 of 7 is not signed"):
        files.verify(1)
    assert JobFiles(tmp_path / "s", "7").verify(1).checksum == "crc32"  # a node without keys takes anything


@pytest.mark.unit
def test_a_tampered_epoch_falls_back_to_the_older_one_naming_the_file_and_keys_rotate(tmp_path):
    path = tmp_path / "image.keys"
    old = keys_at(path)
    fake_epoch(JobFiles(tmp_path / "s", "7", old), tmp_path / "st1", b"one" * 1000)
    new = keys_at(path, rotate=True)
    files = JobFiles(tmp_path / "s", "7", new)
    assert fake_epoch(files, tmp_path / "st2", b"two" * 1000).key_id == "k2"
    assert files.newest_verified()[0].epoch == 2
    assert files.verify(1).key_id == "k1"  # signed with the older key: still readable
    with open(files.epoch_dir(2) / "core-1.img", "r+b") as f:
        f.write(b"CORE")
    m, notes = files.newest_verified()
    assert m.epoch == 1 and notes == ["epoch 2: core-1.img fails its checksum; falling back to an older epoch"]
    # A node that no longer holds k1 (pruned from its file) refuses epoch 1.
    only_new = imagekeys.ImageKeys({"k2": new.keys["k2"]}, "k2")
    with pytest.raises(NoEpoch, match=r"epoch 1 of 7 is signed with image key 'k1', which this node does not hold"):
        JobFiles(tmp_path / "s", "7", only_new).newest_verified()
    # An epoch made without keys is never restored by a node that holds them.
    fake_epoch(JobFiles(tmp_path / "s", "8"), tmp_path / "st3", b"x" * 100)
    with pytest.raises(NoEpoch, match=r"epoch 1 of 8 is not signed"):
        JobFiles(tmp_path / "s", "8", new).newest_verified()


@pytest.mark.unit
def test_a_signed_epoch_converted_to_packs_stays_signed_and_a_changed_pack_page_is_refused(tmp_path):
    keys = keys_at(tmp_path / "k")
    files = JobFiles(tmp_path / "s", "7", keys)
    base = os.urandom(64 * 4096)
    fake_epoch(files, tmp_path / "st1", base)
    fake_epoch(files, tmp_path / "st2", base[:32 * 4096] + os.urandom(32 * 4096))
    result = packs.convert(files, 1, 10)
    assert result.converted, result.note
    m = files.verify(1)  # its signature, its recipes' MACs and every page of its image, rebuilt
    assert m.recipes and m.checksum == "blake3-keyed" and split_signed((files.epoch_dir(1) / MANIFEST).read_bytes())[1]
    pack = packs.pack_path(files, m.packs[0])
    with open(pack, "r+b") as f:
        f.seek(5 * 4096 + 7)
        f.write(b"\xff")
    with pytest.raises(CorruptEpoch, match=r"epoch 1: pages-1.img rebuilt from its packs fails its checksum"):
        files.verify(1)


@pytest.mark.unit
def test_the_follower_takes_the_keyed_digest_as_the_file_grows(tmp_path):
    keys = keys_at(tmp_path / "k")
    d = tmp_path / "epoch"
    d.mkdir()
    follower = imagesum.Follower(d, writeback=False, read_during=True, poll_s=0.001, digest=keys.digest()).start()
    data = os.urandom(3 * imagesum.CHUNK + 12345)
    with open(d / "pages-1.img", "wb") as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
            f.flush()
            time.sleep(0.002)
    got = follower.finish()
    tables: dict[str, bytes] = {}
    assert got == {"pages-1.img": imagesum.crc32_file(d / "pages-1.img", keys.digest(), tables)}
    # A page image's digest: a MAC of each 64 KiB extent (and its number), and of their table.
    macs = imagekeys.ExtentMacs(keys.digest().file_key)
    macs.update(data)
    assert got["pages-1.img"][1] == macs.hexdigest() != blake3.blake3(data, key=keys.digest().file_key).hexdigest()
    assert follower.tables == tables == {"pages-1.img": macs.macs()}
    assert len(macs.macs()) == -(-len(data) // imagekeys.EXTENT) * imagekeys.EXTENT_MAC


# ------------------------------------------------------------------ real jobs, real criu

@pytest.mark.criu
async def test_a_restore_refuses_a_tampered_epoch_and_comes_back_exact_from_the_one_before(tmp_path, supervisors):
    keys = keys_at(tmp_path / "image.keys")
    n1, n2 = supervisors("n1", keys=keys), supervisors("n2", keys=keys)
    spec = JobSpec(id="1", argv=["python3", str(COUNTER), "150", "0.02"], workdir=str(tmp_path), max_epochs=2)
    await n1.start(spec, 1)
    out = n1.jobs["1"].files.output
    await until(lambda: out.read_bytes().count(b"\n") >= 20)
    await n1.checkpoint("1", 1, stop=False)
    await until(lambda: out.read_bytes().count(b"\n") >= 50)
    await n1.checkpoint("1", 1, stop=False)
    files = JobFiles(n1.storage, "1", keys)
    assert files.committed() == [1, 2] and files.read_signed(2).checksum == "blake3-keyed"
    procs.signal_tree(n1.jobs["1"].pid, signal.SIGKILL)  # the node dies
    await until(lambda: "1" not in n1.jobs)
    # Someone who can write the storage changes a page of the newest epoch, size kept.
    pages = max(files.epoch_dir(2).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    restored = await n2.restore(spec, 2)
    assert restored.epoch is not None and restored.epoch.n == 1
    assert any(f"epoch 2: {pages.name} fails its checksum" in note for note in restored.notes), restored.notes
    rt = n2.jobs["1"]
    await asyncio.wait_for(rt.exited.wait(), 60)
    assert rt.exit_code == 0 and out.read_bytes() == counter_reference(tmp_path, 150)


@pytest.mark.unit
@pytest.mark.parametrize("read_during", [3 * imagesum.CHUNK + 100, 70_000, 65_536 * 3, 3 * imagesum.CHUNK + 69_996],
                         ids=["mid", "short", "aligned", "in-the-last"])
def test_a_page_images_macs_are_the_same_however_much_the_follower_read_before_criu_ended(tmp_path, read_during):
    """The follower reads some of an image while criu writes it, the rest after, by extent over the
    CPUs: the table is the same wherever that cut falls (inside an extent, at its end, or within
    the last, short one)."""
    keys = keys_at(tmp_path / "k")
    d = tmp_path / "epoch"
    d.mkdir()
    data = os.urandom(3 * imagesum.CHUNK + 70_001)
    (d / "pages-1.img").write_bytes(data[:read_during])
    follower = imagesum.Follower(d, writeback=False, read_during=True, poll_s=0.001, digest=keys.digest()).start()
    until_read = time.monotonic() + 10
    while not follower.images or follower.images["pages-1.img"].offset < read_during:
        assert time.monotonic() < until_read
        time.sleep(0.001)
    with open(d / "pages-1.img", "ab") as f:
        f.write(data[read_during:])
    got = follower.finish()
    macs = imagekeys.ExtentMacs(keys.digest().file_key)
    macs.update(data)
    assert got == {"pages-1.img": (len(data), macs.hexdigest())} and follower.tables["pages-1.img"] == macs.macs()
