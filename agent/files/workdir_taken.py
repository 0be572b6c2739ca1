"""What a working directory's snapshot took while the job was frozen (agent/files/workdir.py), and its
finish once the job runs again: the gated copies made, the packed files' runs numbered over the
epoch's packs (agent/files/workdir_packs.py), the unchanged files' copies linked from the previous
epoch, the recorded files checked again, and workdir-files.json written."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from revenant.agent.files import beneath, workdir_packs
from revenant.agent.files.gate import cowgate
from revenant.agent.storage.epochs import FILES_DIR, WORKDIR_FILES, EpochError
from revenant.agent.storage.manifest import JobCaused, WorkdirFile

# Where files to be packed are copied while the job is frozen (agent/files/workdir_packs.py), in the epoch's
# temporary directory: removed once they are packed (never sealed: its name is no image's, no copy's).
SCRATCH = "workdir-scratch"


@dataclass
class Taken:
    """A snapshot taken while the job was frozen, to be finished once it runs again."""

    files: dict[str, WorkdirFile] = field(default_factory=dict)
    copied: int = 0  # bytes copied (or cloned) into the epoch
    linked: int = 0  # bytes linked from the previous epoch
    recorded: int = 0  # bytes of files never written since the job started: recorded, not copied
    known: dict[str, tuple[int, str]] = field(default_factory=dict)  # linked copies' checksums
    # (the previous epoch's copy, this epoch's name for it), names in those epochs' directories:
    # made by link_all() once the job runs.
    links: list[tuple[str, str]] = field(default_factory=list)
    link_from: Path = Path()
    link_to: Path = Path()
    # The changed files copied after the job resumes (agent/files/gate/cowgate.py), or None.
    gate: cowgate.CowGate | None = None
    # Packed files' runs by copy (agent/files/workdir_packs.py): those kept from the previous epoch here,
    # the new ones from the packer once the gate has copied them.
    runs: dict[str, tuple[workdir_packs.Runs, str]] = field(default_factory=dict)  # and CRC-32
    # Unchanged packed files: the previous epoch's runs (numbered over its packs) and CRC-32, by copy.
    kept: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    kept_table: list[str] = field(default_factory=list)  # the previous epoch's packs
    sizes: dict[str, int] = field(default_factory=dict)  # what the packer read of each
    # Packed files copied while frozen (copy, where in the scratch file, size): packed from there.
    repack: list[tuple[str, int, int]] = field(default_factory=list)
    scratch: int = -1  # that file (epoch_tmp/SCRATCH), open
    packer: workdir_packs.Packer | None = None
    epoch_tmp: Path = Path()  # where workdir-files.json is (written again once the packed files are in)
    table: list[str] = field(default_factory=list)  # Manifest.workdir_packs, once finished
    workdir: str = ""  # the working directory: its recorded files are checked again once the job runs

    def abandon(self) -> None:
        """Let the gated files go uncopied (the dump failed): every open of them goes through."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.close()
        if self.scratch >= 0:
            os.close(self.scratch)
            self.scratch = -1


def finish(taken: Taken, on_step: Callable[[str], None] = lambda step: None) -> None:
    """Blocking, once the job runs again: the gated files' copies, then the unchanged files'
    links.  A gated file changed without an open (truncated by path) fails the epoch."""
    gate, taken.gate = taken.gate, None
    if gate is not None:
        errors = gate.run()
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise JobCaused(f"the working directory changed while its snapshot was copied: {errors[0]}{more}")
        _unkept(taken, gate.unkept())
    _packed(taken)
    link_all(taken, on_step)
    check_recorded(taken)
    taken.recorded = sum(rec.size for rec in taken.files.values() if not rec.copy and not rec.racy)
    # Written now, the job running: at 10,000 files the encoding alone would be milliseconds of freeze.
    with open(os.open(taken.epoch_tmp / WORKDIR_FILES, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(msgspec.json.encode(taken.files))


def unkept(rec: WorkdirFile) -> None:
    """``rec`` was written by another process as the epoch was taken: the epoch keeps it by
    identity only (a restore leaves it as it is then), and never trusts its times."""
    rec.copy, rec.runs, rec.crc, rec.racy = "", None, "", True


def _unkept(taken: Taken, dests: list[str]) -> None:
    if not dests:
        return
    names = {os.path.relpath(d, taken.epoch_tmp) for d in dests}
    for rec in taken.files.values():
        if rec.copy in names:
            unkept(rec)
            taken.copied -= rec.size if taken.packer is None or rec.size < taken.packer.pack_min else 0
    for d in dests:
        try:
            os.unlink(d)
        except FileNotFoundError:
            pass
    if taken.packer is not None:
        for name in names:
            taken.packer.results.pop(name, None)


def check_recorded(taken: Taken) -> None:
    """The files recorded by identity (never written since the job started; their stat may be
    from before the freeze: agent/files/workdir_scan.py) are still as recorded: else one changed
    around the dump, its content then unknown, and the epoch fails (the next one copies it)."""
    recorded = [(rel, rec) for rel, rec in taken.files.items() if not rec.copy and not rec.racy]
    if not recorded or not taken.workdir:
        return
    dirs = beneath.Dirs(taken.workdir)
    changed = []
    try:
        for rel, rec in recorded:
            head, _, name = rel.rpartition("/")
            try:
                st = beneath.lstat_in(dirs.get(head), name)
            except OSError:
                st = None
            if st is None or (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != rec.key:
                changed.append(rel)
    finally:
        dirs.close()
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise JobCaused(f"{os.path.join(taken.workdir, changed[0])}{more} was written for the first time since the "
                         "job started while the checkpoint was taken: its content at the dump is unknown, so this "
                         "epoch is not kept (the next one copies it)")


def _packed(taken: Taken) -> None:
    """The packed files' runs, numbered over the epoch's packs (Manifest.workdir_packs), and
    workdir-files.json written again with them."""
    if taken.packer is None or not any(rec.runs is not None for rec in taken.files.values()):
        return
    if taken.scratch >= 0:
        try:
            for copy, at, size in taken.repack:
                taken.packer.pack(taken.scratch, copy, at, size)
        finally:
            os.close(taken.scratch)
            taken.scratch = -1
            (taken.epoch_tmp / SCRATCH).unlink(missing_ok=True)
    taken.packer.close()
    for copy, (numbers, crc) in taken.kept.items():
        taken.runs[copy] = (workdir_packs.named(numbers, taken.kept_table), crc)
    for copy, (runs, size, crc) in taken.packer.results.items():
        taken.runs[copy] = (runs, crc)
        taken.sizes[copy] = size
    taken.table = workdir_packs.table_of([runs for runs, _ in taken.runs.values()])
    numbered = {copy: (workdir_packs.numbered(runs, taken.table), crc) for copy, (runs, crc) in taken.runs.items()}
    for rel, rec in taken.files.items():
        if rec.copy in numbered:  # a packed file, or another link to one
            rec.runs, rec.crc = numbered[rec.copy]
            if taken.sizes.get(rec.copy, rec.size) != rec.size:
                raise EpochError(f"the working directory changed while its snapshot was copied: {rel} changed size")
    taken.copied += taken.packer.new_bytes


def link_all(taken: Taken, on_step: Callable[[str], None] = lambda step: None) -> None:
    """Link the unchanged files' copies from the previous epoch (blocking; the job runs again)."""
    if not taken.links:
        return
    (taken.link_to / FILES_DIR).mkdir(mode=0o700, exist_ok=True)
    src_dir, dst_dir = os.open(taken.link_from, os.O_RDONLY | os.O_DIRECTORY), os.open(taken.link_to, os.O_RDONLY)
    try:
        for src, dst in taken.links:
            try:
                os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            except OSError as exc:
                raise EpochError(f"cannot link {dst} to the previous epoch's copy {taken.link_from / src}: "
                                 f"{exc.strerror or exc}") from None
            on_step(f"linked {dst}")
    finally:
        os.close(src_dir)
        os.close(dst_dir)
