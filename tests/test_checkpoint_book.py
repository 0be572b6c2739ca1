"""Checkpoint bookkeeping (agent/checkpointing/checkpoints.py): epoch events, the failure count the health
rules read, and retention after a commit; epochs faked on local disk, the clock fixed."""

from __future__ import annotations

import pytest

from revenant.agent.checkpointing.checkpoints import CheckpointBook
from revenant.agent.storage.epochs import MANIFEST, JobFiles, Manifest
from revenant.common.errors import CriuError
from revenant.messages import subjects

pytestmark = pytest.mark.unit


def _committed(files: JobFiles, n: int) -> Manifest:
    d = files.epoch_dir(n)
    d.mkdir(parents=True)
    (d / MANIFEST).write_text("{}")
    return Manifest(job=files.job, epoch=n, generation=2, node="n1", created_at=1.0, criu_version="4.1.1",
                    kernel="k", freeze_s=0.05, dump_s=0.4)


async def test_failures_count_until_a_commit_and_retention_follows_it(tmp_path):
    events = []
    book = CheckpointBook("n1", lambda subject, msg: events.append((subject, msg)), wall_clock=lambda: 1234.5)
    files = JobFiles(tmp_path, "7")
    book.failed("7", 2, CriuError("criu dump failed: (00.2) Error (criu/cr-dump.c:2120): Dumping FAILED."))
    book.failed("7", 2, CriuError("again"))
    assert book.failures == 2
    subject, failed = events[0]
    assert subject == subjects.epoch_event("7", "failed", "n1", user="")
    assert (failed.kind, failed.at, failed.node, failed.generation) == ("failed", 1234.5, "n1", 2)
    assert failed.error == "criu dump failed: (00.2) Error (criu/cr-dump.c:2120): Dumping FAILED."

    for n in (1, 2):
        _committed(files, n)
    events.clear()
    info, pruned = await book.committed(files, 2, _committed(files, 3), max_epochs=2)
    assert book.failures == 0
    assert info.n == 3 and info.generation == 2 and pruned == [1]
    assert [(m.kind, m.n) for _, m in events] == [("created", 3), ("pruned", 1)]
    created = events[0][1]
    assert (created.freeze_s, created.duration_s, created.at) == (0.05, 0.4, 1234.5)
    assert files.committed() == [2, 3]


async def test_at_least_one_epoch_is_kept(tmp_path):
    events = []
    book = CheckpointBook("n1", lambda subject, msg: events.append(msg), wall_clock=lambda: 0.0)
    files = JobFiles(tmp_path, "7")
    _committed(files, 1)
    await book.committed(files, 1, _committed(files, 2), max_epochs=0)
    assert files.committed() == [2]
    assert [(m.kind, m.n) for m in events] == [("created", 2), ("pruned", 1)]


def test_a_failure_the_job_caused_itself_is_the_jobs_never_the_nodes_health():
    """Issue 44: a user's own failed checkpoints (a workdir over the budget, a file they truncate
    as it is copied) must not turn their node RED and evict other users' jobs."""
    from revenant.agent.files.workdir import OverBudget
    from revenant.agent.storage.manifest import JobCaused
    events = []
    book = CheckpointBook("n1", lambda subject, msg: events.append(msg))
    for _ in range(5):
        book.failed("7", 1, OverBudget("the working directory's changes since the last epoch are 5.0 GiB"))
        book.failed("7", 1, JobCaused("the working directory changed while its snapshot was copied"))
    assert book.failures == 0
    assert [m.kind for m in events] == ["failed"] * 10  # still the job's failed events, each with its error
    book.failed("8", 1, CriuError("criu dump failed: no space"))
    assert book.failures == 1
