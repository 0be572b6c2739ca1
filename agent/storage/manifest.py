"""An epoch's manifest and the errors of epoch storage: what agent/storage/epochs.py writes and checks,
and what agent/storage/chain.py (the pack format, below epochs.py) reads, without either importing the
other's module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import msgspec

from revenant.agent.storage.imagekeys import Digest
from revenant.common.errors import RevenantError
from revenant.messages import JobGpu

MANIFEST = "manifest.json"
# An epoch's snapshot of its job's working directory (agent/files/workdir.py): {relative path: WorkdirFile}.
WORKDIR_FILES = "workdir-files.json"
MANIFEST_VERSION = 1


# The manifest's signature, its last key: "<key id> <keyed BLAKE3 of the JSON without it>" (imagekeys.py).
SIGNATURE = b',"signature":"'


def join_signed(body: bytes, signature: bytes) -> bytes:
    """A manifest's JSON object ``body`` with ``signature`` as its last key."""
    return body[:-1] + SIGNATURE + signature + b'"}'


def split_signed(raw: bytes) -> tuple[bytes, bytes]:
    """A manifest file's JSON as it was signed, and its signature ("<key id> <mac>"; b"" if it has none)."""
    at = raw.rfind(SIGNATURE)
    if at < 0 or not raw.endswith(b'"}'):
        return raw, b""
    return raw[:at] + b"}", raw[at + len(SIGNATURE):-2]


class EpochError(RevenantError):
    code = "epoch"


class CorruptEpoch(EpochError):
    code = "corrupt_epoch"


class NoEpoch(EpochError):
    code = "no_epoch"


class JobCaused(EpochError):
    """A checkpoint the job failed by itself (its working directory over the budget, a file it
    truncated by path as it was copied): counted against the job, never the node's health."""

    code = "job_caused"
    job_caused = True


class FilesChanged(EpochError):
    """The job's files changed since the epoch in a way it cannot put back (agent/files/jobfiles_restore.py)."""

    code = "files_changed"


class FileEntry(msgspec.Struct):
    size: int
    # Hex digest in the manifest's ``checksum`` algorithm.
    checksum: str


class RecipeEntry(FileEntry, kw_only=True):
    recipe: str  # an image stored in packs: its original size and checksum, its recipe (agent/storage/chain.py)


class JobFile(msgspec.Struct, kw_only=True):
    """A regular file the job held open for writing at the dump (agent/files/jobfiles.py)."""

    size: int
    mode: int
    uid: int
    gid: int
    ino: int
    mtime_ns: int
    # Every descriptor of it was O_APPEND: writes after the dump only added to it.
    append: bool = False
    # The copy inside the epoch ("files/<i>"); "" if none, and no_copy says why.
    copy: str = ""
    no_copy: str = ""
    # fingerprint() of its content at the dump, for a file with no copy.
    sample: str = ""


class WorkdirFile(msgspec.Struct, array_like=True):
    """A regular file of the job's working directory at the dump (agent/files/workdir.py)."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    uid: int
    gid: int
    # Its copy in the epoch ("files/w<i>"; two links to one inode share one).  A packed one
    # (``runs`` not None) has no file of that name: the name only says which records share it.
    copy: str
    # Its times cannot vouch for its content: the job maps or holds it (a write through a mapping
    # may not touch them), or it changed within a tick of the dump (agent/files/workdir.py RACY_NS: a
    # filesystem's clock may be that coarse).  Never linked to by the next epoch, always put back on restore.
    racy: bool = False
    # Packed: its content as runs of 4 KiB pages, flat (index into Manifest.workdir_packs, first
    # page, count) triples (agent/storage/chain.py), and its CRC-32.
    runs: list[int] | None = None
    crc: str = ""

    @property
    def key(self) -> tuple[int, int, int, int]:
        """What says the file is unchanged since (unless it is racy)."""
        return self.ino, self.size, self.mtime_ns, self.ctime_ns

    def same(self, st: os.stat_result) -> bool:
        return not self.racy and self.key == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_workdir(epoch_dir: Path) -> dict[str, WorkdirFile] | None:
    """An epoch's snapshot of its working directory; None if it has none."""
    try:
        return msgspec.json.decode((epoch_dir / WORKDIR_FILES).read_bytes(), type=dict[str, WorkdirFile])
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        raise CorruptEpoch(f"epoch {epoch_dir.name}: unreadable {WORKDIR_FILES}: {exc}") from None


class Manifest(msgspec.Struct, kw_only=True):
    version: int = MANIFEST_VERSION
    job: str
    epoch: int
    generation: int
    node: str
    # The Unix user the job belongs to (JobSpec.user); "" for epochs written before jobs had users.
    user: str = ""
    created_at: float
    criu_version: str
    kernel: str
    cpu_flags: list[str] = []
    files: dict[str, FileEntry] = {}
    # Absolute path -> size in bytes at the moment of the dump (epochs written before job_files).
    outputs: dict[str, int] = {}
    # Absolute path -> what the job's files were at the dump (while frozen).
    job_files: dict[str, JobFile] = {}
    # The job's working directory, and why its listing (workdir.json) was not taken ("" if it was).
    workdir: str = ""
    workdir_note: str = ""
    # Its snapshot (workdir-files.json, agent/files/workdir.py): regular files in it, bytes stored by
    # this epoch (whole copies, new pages with their digests), bytes of the files unchanged since the
    # previous one (their copy linked, or their pages kept).  0 files: none was taken (an older epoch).
    workdir_files: int = 0
    workdir_copied: int = 0
    workdir_linked: int = 0
    # The job's start (wall clock ns, less a margin): a file whose ctime is older, never written by the
    # job before, is recorded by identity (its bytes here), not copied.  0: every file is copied.
    workdir_since_ns: int = 0
    workdir_recorded: int = 0
    # The packs its larger files' pages are in (agent/files/workdir_packs.py): "<segment>/<N>-<rnd>".
    workdir_packs: list[str] = []
    checksum: str = "crc32"
    # With checksum "blake3-keyed": the image key its digests (and its signature, manifest.mac) are made with.
    key_id: str = ""
    # Its images encrypted at rest (agent/storage/sealed.py): the algorithm ("" if not), and the job's data
    # key wrapped with an image key ("<key id> <hex>").  Sizes and digests above are of the stored bytes.
    encryption: str = ""
    data_key: str = ""
    # criu's own freeze (files_s of it on the job's own files); criu's whole dump; checksums,
    # fsync (and copy, with staging); all of it.
    freeze_s: float = 0.0
    files_s: float = 0.0
    dump_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    # A converted epoch (agent/storage/packs.py): its images by recipe, the packs they read, their segment.
    recipes: dict[str, RecipeEntry] = {}
    packs: list[str] = []
    segment: int = 0
    # A GPU job (agent/gpus/gpustep.py): its GPUs, the driver, each CUDA process's GPUs by its pid in the job's namespace.
    gpus: list[JobGpu] = []
    gpu_driver: str = ""
    cuda_pids: dict[int, list[str]] = {}
    # The job's internet sockets at the dump, as criu recorded them (agent/network/criuimages.py): what it
    # listened on, and its established TCP connections ("local -> peer").
    listening: list[str] = []
    connections: list[str] = []

    @property
    def total_bytes(self) -> int:  # what a restore reads: converted images at their original size
        plain = (f.size for n, f in self.files.items() if n not in {r.recipe for r in self.recipes.values()})
        return sum(plain) + sum(r.size for r in self.recipes.values())


class EpochStore(Protocol):
    """What of a job's storage (agent/storage/epochs.py JobFiles) the pack format reads."""

    job: str
    packs_dir: Path

    def epoch_dir(self, n: int) -> Path: ...

    def digest_of(self, m: Manifest) -> Digest: ...

    def read_manifest(self, n: int) -> Manifest: ...

    def committed(self) -> list[int]: ...

