"""Epoch images encrypted at rest (``image_encryption = "aead"``): what someone who can read the
shared storage learns of a job's memory is its size.

**Keys.**  Each job has its own 256-bit data key, made at its first encrypted checkpoint and
kept *wrapped* (AES-256-GCM under a key derived from the cluster's current image key, the job's
id as associated data) in ``jobs/<job>/data.key``; every manifest carries its wrapped key too
(``data_key``, ``"<image key id> <hex>"``, signed with the rest), so an epoch is read with its own
manifest alone, and stays readable after ``revenant keys --rotate`` for as long as the node
holds the image key it names.  A new current key rewraps data.key at the next checkpoint.

**Files.**  criu's images (``*.img``, a pre-dump's, ``stats-dump``: :func:`names`) are encrypted
as the commit copies them from node-local staging to the storage (so no plaintext image is
ever written there: encryption needs staging, ``staging_dir`` or the agent's node-local scratch).
A sealed file is a 24-byte header (``MAGIC``, 16 random bytes of salt) and the image in 1 MiB
chunks, each AES-256-GCM with its 16-byte tag, under a key derived from the data key and the
salt (so no two files share a key, and a nonce is the chunk's number and a last-chunk flag: a
file cut short or with chunks swapped fails).  Each chunk's associated data is the header and
the file's name in the epoch, so a file moved to another name fails too.  The manifest's size
and MAC (imagekeys.py) are of the stored, encrypted bytes, so an epoch verifies without being
decrypted; the restore decrypts its images into node-local scratch (:func:`open_epoch`) and
criu restores from there.  It is eager: a lazy restore would serve pages from the storage
(agent/lazyrestore/lazy.py), and encrypted pages must be opened first.

Not encrypted: the copies of the job's own files (``files/``) and its working directory's
snapshot, which are the job's files as they are in the working directory, on the same storage;
and, in memory, the decrypted images during a restore (node-local, root's 0700).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import mmap
import os
import secrets
from pathlib import Path
from typing import Callable, Iterator

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from revenant.agent.storage.imagekeys import Digest, ImageKeys, derive
from revenant.agent.storage.manifest import CorruptEpoch, EpochError, Manifest
from revenant.agent.storage.private import PRIVATE_FILE, private_dir, write_atomic

ALGORITHM = "aes-256-gcm"
MAGIC = b"rvnseal1"
_SALT = 16
HEADER = len(MAGIC) + _SALT
CHUNK = 1 << 20
_TAG = 16
DATA_KEY = "data.key"
_WRAP_CONTEXT = "revenant 2026-12-05 job data key wrap"
_FILE_CONTEXT = "revenant 2026-12-05 sealed image file key"
_THREADS = 3  # files at once
_AHEAD = 2  # chunks of one file in flight


class SealError(EpochError):
    code = "sealed"


def sealed_size(size: int) -> int:
    """What an image of ``size`` bytes takes sealed (one chunk at least, for an empty one)."""
    return HEADER + size + _TAG * max(1, -(-size // CHUNK))


def names(all_names: list[str]) -> list[str]:
    """Which of an epoch's files are sealed: criu's images, a pre-dump's, criu's statistics."""
    return [n for n in all_names if n.endswith(".img") or n == "stats-dump"]


# ------------------------------------------------------------------ the job's data key


def wrap(keys: ImageKeys, job: str, data_key: bytes, key_id: str | None = None) -> str:
    kid = key_id or keys.current
    nonce = secrets.token_bytes(12)
    sealed = AESGCM(derive(keys.keys[kid], _WRAP_CONTEXT)).encrypt(nonce, data_key, _wrap_aad(job))
    return f"{kid} {(nonce + sealed).hex()}"


def unwrap(keys: ImageKeys, job: str, wrapped: str) -> bytes:
    """The data key in ``wrapped`` (SealError, one line, if this node cannot open it)."""
    kid, _, blob = wrapped.partition(" ")
    if kid not in keys.keys:
        raise SealError(f"job {job}'s data key is wrapped with image key {kid!r}, which this node does not hold")
    try:
        raw = bytes.fromhex(blob)
        return AESGCM(derive(keys.keys[kid], _WRAP_CONTEXT)).decrypt(raw[:12], raw[12:], _wrap_aad(job))
    except (ValueError, InvalidTag):
        raise SealError(f"job {job}'s data key does not open with image key {kid!r} (changed, or another "
                        "job's)") from None


def _wrap_aad(job: str) -> bytes:
    return b"revenant job data key\0" + job.encode()


def job_key(keys: ImageKeys, job_dir: Path, job: str) -> tuple[bytes, str]:
    """(data key, wrapped with the current image key) of the job whose directory is ``job_dir``:
    its data.key's, rewrapped if an older key wrapped it; a new one where there is none (or one
    that does not open: a key made by someone without the cluster's key is never used)."""
    path = job_dir / DATA_KEY
    try:
        wrapped = path.read_text().strip()
        key = unwrap(keys, job, wrapped)
        if wrapped.partition(" ")[0] == keys.current:
            return key, wrapped
    except (OSError, SealError):
        key = secrets.token_bytes(32)
    wrapped = wrap(keys, job, key)
    write_atomic(path, (wrapped + "\n").encode())
    return key, wrapped


# ------------------------------------------------------------------ one file


def _file_key(data_key: bytes, salt: bytes) -> AESGCM:
    return AESGCM(blake3.blake3(data_key + salt, derive_key_context=_FILE_CONTEXT).digest())


def _nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


def _in_order(count: int, work: Callable[[int], bytes], consume: Callable[[bytes], object]) -> None:
    """``consume(work(i))`` for i in 0..count-1, in order, the work a few chunks ahead on other
    threads (AES-GCM lets go of the GIL: the encryption of one chunk runs beside the digest and
    the write of the one before)."""
    with concurrent.futures.ThreadPoolExecutor(_AHEAD) as pool:
        pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
        for i in range(count):
            pending.append(pool.submit(work, i))
            if len(pending) > _AHEAD:
                consume(pending.popleft().result())
        while pending:
            consume(pending.popleft().result())


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[memoryview]:
    """The file's bytes, mapped (no copy through a read buffer); an empty one is b""."""
    if size == 0:
        yield memoryview(b"")
        return
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            yield view
        finally:
            view.release()


def seal_file(src: Path, dst: Path, name: str, data_key: bytes, digest: Digest) -> tuple[int, str]:
    """Encrypt ``src`` (whole: criu has exited) into a new private ``dst`` (``name``: its name in
    the epoch); returns the stored size and ``digest`` of the stored bytes (the manifest's)."""
    header = MAGIC + secrets.token_bytes(_SALT)
    aead, aad = _file_key(data_key, header[len(MAGIC):]), header + name.encode()
    hasher = digest.new()

    def write(out: bytes) -> None:
        fout.write(out)
        hasher.update(out)

    with open(src, "rb", buffering=0) as fin, \
            open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE), "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        count = max(1, -(-size // CHUNK))
        write(header)
        with _mapped(fin.fileno(), size) as view:
            _in_order(count, lambda i: aead.encrypt(_nonce(i, i == count - 1), view[i * CHUNK:(i + 1) * CHUNK], aad),
                      write)
    return sealed_size(size), hasher.hexdigest()


def open_file(src: Path, dst: Path, name: str, data_key: bytes, epoch: int) -> int:
    """Decrypt sealed ``src`` into a new private ``dst``; its plain size.  CorruptEpoch names the
    file and the chunk that fails (changed, cut short, moved from another name, another key)."""
    with open(src, "rb", buffering=0) as fin, \
            open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE), "wb") as fout:
        stored = os.fstat(fin.fileno()).st_size
        header = fin.read(HEADER)
        body = stored - HEADER
        if len(header) != HEADER or header[:len(MAGIC)] != MAGIC or body < _TAG:
            raise CorruptEpoch(f"epoch {epoch}: {name} is not a sealed image")
        count = max(1, -(-body // (CHUNK + _TAG)))
        aead, aad = _file_key(data_key, header[len(MAGIC):]), header + name.encode()

        def opened(i: int) -> bytes:
            chunk = os.pread(fin.fileno(), CHUNK + _TAG, HEADER + i * (CHUNK + _TAG))
            try:
                return aead.decrypt(_nonce(i, i == count - 1), chunk, aad)
            except InvalidTag:
                raise CorruptEpoch(f"epoch {epoch}: {name} fails to decrypt at chunk {i} of {count} (changed, "
                                   "cut short, or not this job's)") from None

        _in_order(count, opened, fout.write)
    return stored - HEADER - _TAG * count


# ------------------------------------------------------------------ an epoch


def seal_all(staging: Path, tmp: Path, todo: list[str], data_key: bytes, digest: Digest) -> dict[str, tuple[int, str]]:
    """Encrypt ``todo`` from ``staging`` into ``tmp`` (a few at a time: AES-GCM and BLAKE3 let go of
    the GIL); their stored (size, digest) by name."""
    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        done = pool.map(lambda n: seal_file(staging / n, tmp / n, n, data_key, digest), todo)
        return dict(zip(todo, done))


def open_epoch(keys: ImageKeys | None, job: str, m: Manifest, epoch_dir: Path, dest: Path) -> None:
    """Decrypt epoch ``m``'s sealed images (verified: their MACs match) from ``epoch_dir`` into
    ``dest``, a private node-local directory, where criu restores them from."""
    if keys is None:
        raise SealError(f"epoch {m.epoch} of {job} is encrypted, and this node holds no image keys")
    data_key = unwrap(keys, job, m.data_key)
    private_dir(dest)
    todo = names(sorted(m.files))
    for parent in sorted({(dest / n).parent for n in todo} - {dest}):
        private_dir(parent)
    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(lambda n: open_file(epoch_dir / n, dest / n, n, data_key, m.epoch), todo))
