"""Epochs on shared storage: atomic commit, verification, retention.

Layout, per job, under ``<storage>/jobs/<job>/``::

    output.log                the job's stdout and stderr (append mode)
    epochs/<N>/               a committed epoch: criu images, files/ (copies of the job's own
                              files, agent/files/jobfiles.py), workdir.json, manifest.json
    epochs/.tmp-<node>-<rnd>/ an epoch being written (or a delta rebuilt); never listed
    epochs/.trash-<N>-<rnd>/  an epoch being deleted; never listed
    epochs/.lock, packs/      the job's storage lock; pages of older epochs (agent/checkpointing/policy.py, packs.py)

An epoch is committed by writing its files into a temporary directory, then ``manifest.json``
(size and CRC-32 of every file, the criu version, kernel, CPU flags, the job's own files at the
dump), fsyncing, and renaming it to ``<N>``: a directory named by a number is a complete epoch.

Where the node holds the cluster's image keys (``keys``, agent/storage/imagekeys.py) the digests are
keyed BLAKE3 and the manifest is signed (its last key, ``"signature": "<key id> <keyed BLAKE3 of
the JSON without it>"``, so that the manifest and its signature are replaced together by one
rename, a conversion's too, and it stays JSON): someone who can write the storage cannot
change an epoch, nor rewrite its manifest, without the restore refusing it.  Without keys they
are CRC-32 (zlib, several GB/s), which guards against corruption (a torn write, a bad disk, a
truncated copy) only.

Epochs are private: root's, directories 0700 and files 0600 (agent/storage/private.py).
Everything here is blocking file I/O, run in a worker thread by the engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
import zlib
from pathlib import Path
from typing import Callable, Collection

import msgspec

from revenant.agent.storage import imagekeys, imagesum, sealed
from revenant.agent.storage.imagekeys import ImageKeys
from revenant.agent.storage.chain import read_from, verify_recipes, verify_workdir
from revenant.agent.storage.fileio import Durable, copy_bytes, fsync_path
from revenant.agent.storage.manifest import (MANIFEST, MANIFEST_VERSION, CorruptEpoch, EpochError, FileEntry,  # noqa: F401
                                     FilesChanged, JobFile, Manifest, NoEpoch, RecipeEntry, WORKDIR_FILES,
                                     join_signed, split_signed)
from revenant.agent.storage.private import PRIVATE_FILE, make_private, private_dir, trusted
from revenant.common import retention
from revenant.messages import EpochFile, EpochInfo
from revenant.messages.parts import MAX_EPOCH_FILES
from revenant.messages.subjects import check_name

log = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024
_EPOCH_RE = re.compile(r"^[0-9]{1,9}$")


def checksum_file(path: Path, algo: str = "crc32") -> str:
    """An unkeyed digest of ``path`` (a keyed one is imagesum.crc32_file's, with JobFiles.digest_of)."""
    with open(path, "rb", buffering=0) as f:
        if algo == "crc32":
            crc = 0
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
            return f"{crc:08x}"
        if algo == "sha256":  # manifests written before CRC-32 was the default
            h = hashlib.sha256()
            while chunk := f.read(_CHUNK):
                h.update(chunk)
            return h.hexdigest()
    raise CorruptEpoch(f"{path}: unknown checksum algorithm {algo!r}")


def _write_synced(path: Path, data: bytes) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fsync_path(path, directory=True)


def _copy_file(src: Path, dst: Path) -> None:
    """A private (0600) copy of ``src`` at ``dst``, in the kernel (made durable by the commit)."""
    with open(src, "rb") as fin, open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "wb") as fout:
        copy_bytes(fin.fileno(), fout.fileno(), os.fstat(fin.fileno()).st_size)


# A pre-dump's images inside the epoch (agent/checkpointing/predump.py), and criu's link to them.
PREDUMP_DIR, PARENT_LINK = "predump", "parent"


def _image_names(directory: Path) -> list[str]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix == ".img")
    pre = directory / PREDUMP_DIR
    names += sorted(f"{PREDUMP_DIR}/{p.name}" for p in pre.iterdir() if p.suffix == ".img") if pre.is_dir() else []
    return names + [n for n in ("stats-dump",) if (directory / n).is_file()]


def link_predump(directory: Path, names: Collection[str]) -> None:
    """criu's ``parent`` link to the pre-dump, made again (always to PREDUMP_DIR, never elsewhere)."""
    if any(n.startswith(f"{PREDUMP_DIR}/") for n in names) and not os.path.lexists(directory / PARENT_LINK):
        os.symlink(PREDUMP_DIR, directory / PARENT_LINK)


# Taken with an epoch, beside its images, signed with them (agent/files/): the job's own files'
# copies and the workdir's listing; what its restore takes from the job's user, as it says as
# whom (asuser/sockets.py, asuser/files.py); what criu makes again by path (remade.py) and every
# path the job held (jobfiles.py), checked again at the restore.
FILES_DIR, LISTING = "files", "workdir.json"
USER_SOCKETS, USER_FILES = "user-sockets.json", "user-files.json"
REMADE, HELD = "remade.json", "held.json"


def _job_file_names(directory: Path) -> list[str]:
    copies = directory / FILES_DIR
    names = sorted(f"{FILES_DIR}/{p.name}" for p in copies.iterdir()) if copies.is_dir() else []
    return names + [n for n in (LISTING, WORKDIR_FILES, USER_SOCKETS, USER_FILES, REMADE, HELD)
                    if (directory / n).is_file()]


class JobFiles:
    """Paths of one job on shared storage."""

    def __init__(self, storage: str | os.PathLike[str], job: str, keys: ImageKeys | None = None) -> None:
        # The cluster's image keys: epochs are signed with them, and none unsigned is restored.
        self.keys = keys
        # The one way from a job id to a path: an id that could leave jobs/ is refused here.
        self.dir = Path(storage) / "jobs" / check_name(job, "job id")
        self.job = job
        self.epochs_dir = self.dir / "epochs"
        self.output = self.dir / "output.log"
        self.stamp = self.dir / "alive"  # the dead man's switch's stamp (agent/running/launcher.py)
        self.packs_dir = self.dir / "packs"  # pages of converted epochs (agent/storage/packs.py)

    def epoch_dir(self, n: int) -> Path:
        return self.epochs_dir / str(n)

    # ------------------------------------------------------------------ listing

    def committed(self) -> list[int]:
        """Committed epoch numbers, oldest first."""
        try:
            names = os.listdir(self.epochs_dir)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if _EPOCH_RE.match(n) and (self.epochs_dir / n / MANIFEST).is_file())

    def next_number(self) -> int:
        try:
            names = os.listdir(self.epochs_dir)
        except FileNotFoundError:
            return 1
        numbers = [int(n) for n in names if _EPOCH_RE.match(n)]
        numbers += [int(m.group(1)) for n in names if (m := re.match(r"^\.trash-([0-9]+)-", n))]
        return max(numbers, default=0) + 1

    def read_manifest(self, n: int) -> Manifest:
        path = self.epoch_dir(n) / MANIFEST
        try:
            return msgspec.json.decode(split_signed(path.read_bytes())[0], type=Manifest)
        except (OSError, msgspec.DecodeError) as exc:
            raise CorruptEpoch(f"epoch {n} of {self.job}: unreadable manifest: {exc}") from None

    def info(self, m: Manifest) -> EpochInfo:
        # The files it could not copy first: they are the ones an operator needs to see.
        files = sorted(m.job_files.items(), key=lambda kv: (bool(kv[1].copy) or kv[1].append, kv[0]))
        return EpochInfo(n=m.epoch, bytes=m.total_bytes, created_at=m.created_at, freeze_s=m.freeze_s,
                         duration_s=m.total_s or m.dump_s, node=m.node, generation=m.generation,
                         files=[EpochFile(path=path, size=f.size, copied=bool(f.copy), not_copied=f.no_copy)
                                for path, f in files[:MAX_EPOCH_FILES]],
                         files_total=len(m.job_files), files_copied=sum(1 for f in m.job_files.values() if f.copy),
                         workdir_note=m.workdir_note, workdir_files=m.workdir_files, workdir_copied=m.workdir_copied,
                         workdir_linked=m.workdir_linked, gpus=m.gpus, gpu_driver=m.gpu_driver,
                         listening=m.listening, connections=m.connections, output_bytes=self._output_at(m))

    def _output_at(self, m: Manifest) -> int:
        """The job's output size at ``m``'s dump (its path as this node names the storage)."""
        out = m.job_files.get(str(self.output))
        return out.size if out is not None else m.outputs.get(str(self.output), 0)

    # ------------------------------------------------------------------ commit

    def new_tmp(self, node: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        private_dir(self.epochs_dir)
        return private_dir(self.epochs_dir / f".tmp-{check_name(node)}-{secrets.token_hex(4)}")

    def commit(self, tmp: Path, manifest: Manifest, staging: Path | None = None,
               clock: Callable[[], float] = time.monotonic, follower: imagesum.Follower | None = None,
               durable: Durable | None = None) -> Manifest:
        """Make the images in ``tmp`` (copied there from ``staging`` first, if given) an epoch: a
        CRC-32 of every file (the ``follower``'s, taken as criu wrote them, where it has them), all
        of them durable at once (``durable``, opened before they were written: agent/storage/imagesum.py),
        the manifest, fsynced, last, then the rename to the next N."""
        started = clock()
        sealed_now: imagesum.Sums = {}
        if staging is not None:
            images = _image_names(staging)
            staged = images + _job_file_names(staging)
            for sub in (FILES_DIR, PREDUMP_DIR):
                if (staging / sub).is_dir():
                    (tmp / sub).mkdir(mode=0o700, exist_ok=True)
            link_predump(tmp, staged)
            if self.seals:  # images encrypted on their way (agent/storage/sealed.py), digested as stored
                key, manifest.data_key = sealed.job_key(self.keys, self.dir, self.job)  # type: ignore[arg-type]
                manifest.encryption = sealed.ALGORITHM
                sealed_now = sealed.seal_all(staging, tmp, images, key, self.digest)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda n: _copy_file(staging / n, tmp / n), [n for n in staged if n not in sealed_now]))
        elif self.seals:
            raise EpochError(f"checkpoint of {self.job}: encrypted images need node-local staging (no plain image "
                             "is written to the storage)")
        make_private(tmp)  # whatever criu's and the copies' modes were
        with Durable(tmp) if durable is None else contextlib.nullcontext(durable) as sync:
            # Set by a step: linked copies' digests ("": digested otherwise than this epoch, taken again).
            known = {n: (e.size, e.checksum) for n, e in manifest.files.items() if e.checksum} | sealed_now
            sums = imagesum.seal(tmp, _image_names(tmp) + _job_file_names(tmp), sync, follower, known, self.digest)
        manifest.checksum = self.digest.name
        manifest.key_id = self.digest.key_id
        manifest.files = {n: FileEntry(size=size, checksum=crc) for n, (size, crc) in sums.items()}
        manifest.commit_s = clock() - started
        manifest.total_s = manifest.dump_s + manifest.commit_s
        n = self.next_number()
        manifest.epoch = n
        _write_synced(tmp / MANIFEST, self.manifest_bytes(manifest))
        if (tmp / FILES_DIR).is_dir():
            _fsync_dir(tmp / FILES_DIR)
        _fsync_dir(tmp)
        final = self.epoch_dir(n)
        os.rename(tmp, final)  # the commit point; a crash before it leaves only .tmp-*
        _fsync_dir(self.epochs_dir)
        return manifest

    @property
    def seals(self) -> bool:  # new epochs' images are encrypted (image_encryption = "aead")
        return self.keys is not None and self.keys.seal

    def open_sealed(self, m: Manifest, dest: Path) -> None:
        """Decrypt encrypted epoch ``m``'s images (verified) into ``dest``, node-local, for criu."""
        sealed.open_epoch(self.keys, self.job, m, self.epoch_dir(m.epoch), dest)
        link_predump(dest, m.files)

    @property
    def digest(self) -> imagekeys.Digest:
        """How new epochs' files are digested: keyed with the current image key, or CRC-32."""
        return self.keys.digest() if self.keys is not None else imagekeys.PLAIN

    def digest_of(self, m: Manifest) -> imagekeys.Digest:
        """How ``m``'s files were digested (CorruptEpoch: with a key this node does not hold)."""
        if m.checksum != imagekeys.KEYED:
            return imagekeys.PLAIN
        if self.keys is None or m.key_id not in self.keys.keys:
            raise CorruptEpoch(f"epoch {m.epoch} of {self.job} is signed with image key {m.key_id!r}, which this "
                               "node does not hold")
        return self.keys.digest(m.key_id)

    def manifest_bytes(self, m: Manifest) -> bytes:
        """What manifest.json holds for ``m``: its JSON, signed with ``m.key_id`` where this node holds keys."""
        data = msgspec.json.encode(m)
        if self.keys is None or m.checksum != imagekeys.KEYED:
            return data
        return join_signed(data, f"{m.key_id} {self.keys.manifest_mac(m.key_id, data)}".encode())

    def read_signed(self, n: int) -> Manifest:
        """Epoch ``n``'s manifest, its signature checked first when this node holds image keys
        (CorruptEpoch if it fails, or is missing: an epoch written without keys, or rewritten)."""
        if self.keys is None:
            return self.read_manifest(n)
        try:
            data, signature = split_signed((self.epoch_dir(n) / MANIFEST).read_bytes())
        except OSError as exc:
            raise CorruptEpoch(f"epoch {n} of {self.job}: unreadable manifest: {exc}") from None
        if not signature:
            raise CorruptEpoch(f"epoch {n} of {self.job} is not signed (written without image keys, or its "
                               "signature removed)")
        key_id, _, mac = signature.decode(errors="replace").partition(" ")
        if key_id not in self.keys.keys:
            raise CorruptEpoch(f"epoch {n} of {self.job} is signed with image key {key_id!r}, which this node "
                               "does not hold")
        if not self.keys.check_manifest(key_id, data, mac):
            raise CorruptEpoch(f"epoch {n} of {self.job}: its manifest fails its MAC (changed since it was signed)")
        try:
            m = msgspec.json.decode(data, type=Manifest)
        except msgspec.DecodeError as exc:
            raise CorruptEpoch(f"epoch {n} of {self.job}: unreadable manifest: {exc}") from None
        if m.checksum != imagekeys.KEYED or m.key_id != key_id or m.epoch != n:
            raise CorruptEpoch(f"epoch {n} of {self.job}: its signed manifest does not match its place or its files' digests")
        return m

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def clean_stale_tmp(self, node: str) -> None:
        """Remove this node's half-written epochs (from a crash mid-dump) and unfinished deletions."""
        try:
            names = os.listdir(self.epochs_dir)
        except FileNotFoundError:
            return
        for name in names:
            # Exactly new_tmp's names for this node: node "n1" never takes node "n1-b"'s.
            if re.fullmatch(rf"\.tmp-{re.escape(node)}-[0-9a-f]{{8}}", name) or name.startswith(".trash-"):
                shutil.rmtree(self.epochs_dir / name, ignore_errors=True)

    # ------------------------------------------------------------------ verify, prune

    def verify(self, n: int, skip: Callable[[Manifest, str], bool] | None = None, pages: bool = True) -> Manifest:
        """Epoch ``n``'s manifest if every file matches its size and checksum (``skip``: files a lazy
        restore checks as served: with image keys, extents; not ``pages``: a delta's images, checked as rebuilt)."""
        m = self.read_signed(n)
        if m.job != self.job:  # an epoch moved here from another job's directory
            raise CorruptEpoch(f"epoch {n} of {self.job} is job {m.job}'s")
        d = self.epoch_dir(n)
        digest = self.digest_of(m) if m.checksum == imagekeys.KEYED else None
        for name, entry in m.files.items():
            path = d / name
            try:
                size = path.stat().st_size
            except OSError:
                raise CorruptEpoch(f"epoch {n}: {name} is missing") from None
            if size != entry.size:
                raise CorruptEpoch(f"epoch {n}: {name} is {size} bytes, manifest says {entry.size}")
            # With keys only a page image with MACs by extent: checked as served (lazyrestore/deltaserve.py).
            by_extent = imagekeys.by_extent(m.files, name)
            if skip is not None and (self.keys is None or by_extent) and skip(m, name):
                continue
            if (imagesum.crc32_file(path, digest, {} if by_extent else None)[1] if digest
                    else checksum_file(path, m.checksum)) != entry.checksum:
                raise CorruptEpoch(f"epoch {n}: {name} fails its checksum")
        if m.recipes and pages:  # every page it needs, from the packs
            verify_recipes(self, m)
        if m.workdir_packs:  # and its working directory's
            verify_workdir(self, m, d)
        return m

    def check_trusted(self) -> None:
        """Refuse to restore from an ``epochs/`` that is not the agent's own (agent/storage/private.py)."""
        if not trusted(self.epochs_dir):
            raise EpochError(f"job {self.job}: {self.epochs_dir} is not the agent's own directory; never restored from")

    def newest_verified(self, check: Callable[[Manifest], None] | None = None,
                        skip: Callable[[Manifest, str], bool] | None = None) -> tuple[Manifest, list[str]]:
        """The newest epoch that verifies (and that ``check`` does not refuse with FilesChanged),
        and a note for each newer one that did not."""
        self.check_trusted()
        notes: list[str] = []
        refused = False
        for n in reversed(self.committed()):
            try:
                m = self.verify(n, skip)
                if check is not None:
                    check(m)
                return m, notes
            except (CorruptEpoch, FilesChanged) as exc:
                refused = refused or isinstance(exc, FilesChanged)
                notes.append(f"{exc}; falling back to an older epoch")
        if notes:
            raise NoEpoch(f"job {self.job}: no epoch {'can be restored' if refused else 'verifies'} "
                          f"({'; '.join(notes)})")
        raise NoEpoch(f"job {self.job} has no checkpoint")

    def prune(self, keep: int, verified: Collection[int] = ()) -> list[int]:
        """Delete committed epochs beyond ``keep`` by the shared retention rule: those that fail
        verification first, never the newest that verifies, nor one whose images a kept epoch
        reads (chain.read_from); returns the numbers removed.  ``verified``: epochs known to verify,
        not read again (the one just committed: with ``keep`` 1 nothing is read at all).  ``keep``
        below 1 deletes nothing, and so does a storage error while verifying."""
        committed = self.committed()
        if keep < 1 or len(committed) <= keep:
            return []

        def verifies(n: int) -> bool:
            if n in verified:
                return True
            try:
                self.verify(n)
                return True
            except CorruptEpoch:
                return False

        try:
            doomed = retention.epochs_to_prune(committed, keep, verifies)
        except OSError as exc:
            log.warning("job %s: retention skipped, an epoch could not be read: %s", self.job, exc)
            return []
        needed = read_from(self, [n for n in committed if n not in doomed and n < max(doomed)]) if doomed else set()
        return [n for n in doomed if n not in needed and self.delete_epoch(n)]

    def delete_epoch(self, n: int) -> bool:
        """Unlist epoch ``n`` at once, then delete it; False if it was gone (another node's retention)."""
        trash = self.epochs_dir / f".trash-{n}-{secrets.token_hex(4)}"
        try:
            os.rename(self.epoch_dir(n), trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def purge(self) -> int:
        """Remove every checkpoint of the job, epochs first, then their packs; returns the bytes freed."""
        freed = 0
        for tree in (d for d in (self.epochs_dir, self.packs_dir) if d.exists()):
            for root, _, files in os.walk(tree):
                for f in files:
                    try:
                        freed += os.lstat(os.path.join(root, f)).st_size
                    except OSError:
                        pass
            trash = self.dir / f".purge-{secrets.token_hex(4)}"
            os.rename(tree, trash)
            shutil.rmtree(trash, ignore_errors=True)
        return freed
