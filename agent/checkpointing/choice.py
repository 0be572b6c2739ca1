"""Which epoch a restore starts from: the newest that verifies and that every step accepts, or
exactly the one an operator named (no fallback then)."""

from __future__ import annotations

from typing import Callable

from revenant.agent.storage.epochs import CorruptEpoch, FilesChanged, JobFiles, Manifest, NoEpoch


def chosen(files: JobFiles, epoch: int, check: Callable[[Manifest], None],
           skip: Callable[[Manifest, str], bool] | None = None) -> tuple[Manifest, list[str]]:
    """The newest epoch that verifies and ``check`` accepts (notes on the newer ones refused),
    or with ``epoch``, exactly that one (no fallback: an operator asked for it).  ``skip``: the
    files a lazy restore checks as it serves them."""
    if not epoch:
        return files.newest_verified(check, skip)
    files.check_trusted()
    if epoch not in files.committed():
        kept = ", ".join(map(str, files.committed())) or "none"
        raise NoEpoch(f"job {files.job} has no epoch {epoch} (it keeps: {kept})")
    try:
        m = files.verify(epoch, skip, pages=False)  # a delta's pages: checked as rebuilt or served
        check(m)
    except (CorruptEpoch, FilesChanged) as exc:
        raise NoEpoch(f"job {files.job}: epoch {epoch} cannot be restored: {exc}") from None
    return m, []
