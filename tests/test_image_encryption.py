"""Images encrypted at rest (agent/storage/sealed.py, ``image_encryption = "aead"``): a data key per
job, wrapped by the cluster's image keys; criu's images AES-256-GCM in 1 MiB chunks on the storage,
their MACs over the stored bytes; a restore decrypts them into node-local scratch, eagerly, and
refuses a file changed, cut short, moved to another name or opened with another job's key."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import blake3
import pytest

from conftest import COUNTER, counter_reference
from helpers import until
from revenant.agent.processes import procs
from revenant.agent.storage import imagekeys, packs, sealed
from revenant.agent.storage.epochs import CorruptEpoch, EpochError, JobFiles, Manifest
from revenant.common.errors import ConfigError
from revenant.messages import JobSpec

SIZES = [0, 1, sealed.CHUNK - 1, sealed.CHUNK, sealed.CHUNK + 1, 3 * sealed.CHUNK + 4097]


def sealing_keys(path: Path, rotate: bool = False) -> imagekeys.ImageKeys:
    return dataclasses.replace(imagekeys.write(path, rotate)[0], seal=True)


def sealed_epoch(files: JobFiles, staging: Path, payload: bytes) -> Manifest:
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "pages-1.img").write_bytes(payload)
    (staging / "core-1.img").write_bytes(b"core" * 10)
    (staging / "files").mkdir(exist_ok=True)
    (staging / "files" / "0").write_bytes(b"a copy of the job's own file")
    m = Manifest(job=files.job, epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.2.1",
                 kernel="k")
    return files.commit(files.new_tmp("n1"), m, staging)


@pytest.mark.unit
@pytest.mark.parametrize("size", SIZES)
def test_a_sealed_file_opens_to_its_bytes_and_refuses_any_change(tmp_path, size):
    keys = sealing_keys(tmp_path / "k")
    data = os.urandom(size)
    (tmp_path / "plain").write_bytes(data)
    key = os.urandom(32)
    stored, digest = sealed.seal_file(tmp_path / "plain", tmp_path / "sealed", "pages-1.img", key, keys.digest())
    raw = (tmp_path / "sealed").read_bytes()
    assert stored == len(raw) == sealed.sealed_size(size) and raw.startswith(sealed.MAGIC)
    assert digest == blake3.blake3(raw, key=keys.digest().file_key).hexdigest()  # of the stored bytes
    if size >= 64:
        assert data[:64] not in raw
    assert sealed.open_file(tmp_path / "sealed", tmp_path / "out", "pages-1.img", key, 3) == size
    assert (tmp_path / "out").read_bytes() == data

    def refused(blob: bytes, name: str = "pages-1.img", with_key: bytes = key, match: str = "fails to decrypt"):
        (tmp_path / "bad").write_bytes(blob)
        (tmp_path / "out2").unlink(missing_ok=True)
        with pytest.raises(CorruptEpoch, match=rf"^epoch 3: {name} {match}"):
            sealed.open_file(tmp_path / "bad", tmp_path / "out2", name, with_key, 3)

    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01  # a byte changed: in the header, a chunk or a tag
    refused(bytes(flipped))
    refused(raw, name="pages-2.img")  # moved to another name
    refused(raw, with_key=os.urandom(32))  # another job's key
    refused(raw[:-1], match="fails to decrypt" if size else "is not a sealed image")  # cut short
    if size > sealed.CHUNK:  # cut at a chunk's end: the new last chunk was not sealed as the last
        refused(raw[:sealed.HEADER + sealed.CHUNK + 16])
    refused(b"not sealed at all", match="is not a sealed image")


@pytest.mark.unit
def test_the_data_key_is_per_job_wrapped_private_and_rewrapped_after_a_rotation(tmp_path):
    path = tmp_path / "image.keys"
    keys = sealing_keys(path)
    job_dir = tmp_path / "jobs" / "7"
    job_dir.mkdir(parents=True)
    key, wrapped = sealed.job_key(keys, job_dir, "7")
    assert len(key) == 32 and wrapped.startswith("k1 ") and key.hex() not in wrapped
    assert oct((job_dir / sealed.DATA_KEY).stat().st_mode & 0o777) == "0o600"
    assert sealed.job_key(keys, job_dir, "7") == (key, wrapped)  # kept
    other_dir = tmp_path / "jobs" / "8"
    other_dir.mkdir()
    assert sealed.job_key(keys, other_dir, "8")[0] != key  # a key per job
    with pytest.raises(sealed.SealError, match=r"^job 8's data key does not open with image key 'k1'"):
        sealed.unwrap(keys, "8", wrapped)  # job 7's key is not job 8's
    rotated = sealing_keys(path, rotate=True)
    again, rewrapped = sealed.job_key(rotated, job_dir, "7")
    assert again == key and rewrapped.startswith("k2 ")
    assert sealed.unwrap(rotated, "7", wrapped) == key  # an epoch's older wrapping still opens
    only_new = imagekeys.ImageKeys({"k2": rotated.keys["k2"]}, "k2", seal=True)
    with pytest.raises(sealed.SealError, match=r"^job 7's data key is wrapped with image key 'k1', which this node"):
        sealed.unwrap(only_new, "7", wrapped)
    # A data.key someone else wrote (without the cluster's key) is never used: a new one replaces it.
    (job_dir / sealed.DATA_KEY).write_text("k2 " + "00" * 60 + "\n")
    fresh, _ = sealed.job_key(rotated, job_dir, "7")
    assert fresh != key and len(fresh) == 32


@pytest.mark.unit
def test_encryption_needs_the_image_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"^image_encryption = aead needs image_integrity = mac"):
        imagekeys.for_config("crc32", "", "aead")
    imagekeys.write(tmp_path / "k")
    assert imagekeys.for_config("mac", str(tmp_path / "k"), "aead").seal
    assert not imagekeys.for_config("mac", str(tmp_path / "k")).seal


@pytest.mark.unit
def test_an_encrypted_epoch_verifies_as_stored_opens_for_criu_and_is_never_converted(tmp_path):
    keys = sealing_keys(tmp_path / "k")
    files = JobFiles(tmp_path / "s", "7", keys)
    payload = os.urandom(2 * sealed.CHUNK + 5)
    m = sealed_epoch(files, tmp_path / "st1", payload)
    d = files.epoch_dir(1)
    assert m.encryption == "aes-256-gcm" and m.data_key.startswith("k1 ") and m.checksum == "blake3-keyed"
    assert (d / "pages-1.img").read_bytes().startswith(sealed.MAGIC) and payload[:4096] not in (d / "pages-1.img").read_bytes()
    assert m.files["pages-1.img"].size == sealed.sealed_size(len(payload))
    assert (d / "files" / "0").read_bytes() == b"a copy of the job's own file"  # the job's files: as they are
    assert files.verify(1).encryption == "aes-256-gcm"  # verified as stored, not decrypted
    files.open_sealed(files.verify(1), tmp_path / "opened")
    assert (tmp_path / "opened" / "pages-1.img").read_bytes() == payload
    assert (tmp_path / "opened" / "core-1.img").read_bytes() == b"core" * 10
    assert oct((tmp_path / "opened" / "pages-1.img").stat().st_mode & 0o777) == "0o600"
    sealed_epoch(files, tmp_path / "st2", payload)
    assert packs.convert(files, 1, 8).note == "encrypted: kept whole"
    # A sealed page changed, its MAC not recomputable without the key: the epoch is refused.
    with open(d / "pages-1.img", "r+b") as f:
        f.seek(sealed.HEADER + 10)
        f.write(b"\x00")
    with pytest.raises(CorruptEpoch, match=r"^epoch 1: pages-1.img fails its checksum$"):
        files.verify(1)
    # No staging, no encryption: a plain image would have been written to the storage first.
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "pages-1.img").write_bytes(b"x")
    with pytest.raises(EpochError, match="encrypted images need node-local staging"):
        files.commit(files.new_tmp("n1"), Manifest(job="7", epoch=0, generation=1, node="n1", created_at=0.0,
                                                   criu_version="4.2.1", kernel="k"))


@pytest.mark.criu
async def test_a_job_checkpointed_encrypted_restores_exact_on_another_node_eagerly(tmp_path, supervisors):
    """Real criu: the images on the storage hold none of the job's memory in clear (its decrypted
    images do), and a lazy-restoring node restores it eagerly, saying so, with its output exact."""
    keys = sealing_keys(tmp_path / "image.keys")
    n1, n2 = supervisors("n1", keys=keys), supervisors("n2", keys=keys, lazy_restore=True)
    marker = "revenant-encryption-marker-" + os.urandom(8).hex()
    spec = JobSpec(id="1", argv=["python3", str(COUNTER), "150", "0.02"], workdir=str(tmp_path), max_epochs=2,
                   env={"MARKER": marker})
    await n1.start(spec, 1)
    out = n1.jobs["1"].files.output
    await until(lambda: out.read_bytes().count(b"\n") >= 30)
    info = await n1.checkpoint("1", 1, stop=False)
    files = JobFiles(n1.storage, "1", keys)
    m = files.verify(files.committed()[-1])
    assert m.encryption == "aes-256-gcm"
    stored = files.epoch_dir(m.epoch)
    images = sorted(stored.glob("*.img"))
    assert images and all(p.read_bytes().startswith(sealed.MAGIC) for p in images)
    assert not any(marker.encode() in p.read_bytes() for p in images)
    files.open_sealed(m, tmp_path / "opened")
    assert any(marker.encode() in p.read_bytes() for p in (tmp_path / "opened").glob("*.img"))
    assert info.epoch is not None and info.epoch.n == m.epoch
    procs.signal_tree(n1.jobs["1"].pid, signal.SIGKILL)  # the node dies
    await until(lambda: "1" not in n1.jobs)
    restored = await n2.restore(spec, 2)
    assert restored.epoch is not None and restored.epoch.n == m.epoch
    assert "restored eagerly: its images are encrypted" in restored.notes, restored.notes
    rt = n2.jobs["1"]
    await asyncio.wait_for(rt.exited.wait(), 60)
    assert rt.exit_code == 0 and out.read_bytes() == counter_reference(tmp_path, 150)
    # Nothing decrypted is left behind in the node's scratch.
    assert not [p for p in (n2.storage.parent / "work-n2").rglob("*.img")]


@pytest.mark.cluster
@pytest.mark.criu
def test_an_encrypted_cluster_fails_a_job_over_exactly_from_sealed_images(make_cluster, tmp_path):
    """`revenant up` with ``image_encryption = aead`` (and lazy restores): the job's epochs are
    sealed on the storage, its node dies, and it comes back on node-2, eagerly and saying why,
    its output exact."""
    from test_failover import INTERVAL, LINES, job_events, output, submit, wait_for

    cluster = make_cluster(2, env={"REVENANT_AGENT_IMAGE_ENCRYPTION": "aead", "REVENANT_AGENT_RESTORE_MODE": "lazy"})
    job = submit(cluster, "--checkpoint", "0:01")
    first = wait_for(cluster, job, lambda j: j["epochs"] and output(cluster, job).count(b"\n") > 40, 30,
                     "a checkpoint")
    epochs = cluster.storage / "jobs" / job / "epochs"
    newest = max((p for p in epochs.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert all(p.read_bytes()[:8] == sealed.MAGIC for p in newest.glob("pages-*.img"))
    assert (cluster.storage / "jobs" / job / sealed.DATA_KEY).is_file()
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", 30, "failover")
    restored = [e for e in job_events(cluster, job) if e["kind"] == "restored"]
    assert restored and "restored eagerly: its images are encrypted" in restored[0]["reason"], restored
    wait_for(cluster, job, lambda j: j["state"] == "completed", 60, "completion")
    assert output(cluster, job) == counter_reference(tmp_path, LINES, INTERVAL)
