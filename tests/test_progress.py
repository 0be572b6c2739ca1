"""Progress of long dumps and restores, and criu's statistics: the pure parts.

criu's stats images are built here byte by byte from criu's images/stats.proto (varint fields in
a length-delimited entry), independently of the parser; the line a terminal shows and the
reporter's loop are checked with made-up reports and a publish that records."""

from __future__ import annotations

import asyncio
import io
import os
import struct

import pytest

from revenant.agent.checkpointing.guard import resident_bytes
from revenant.agent.pipeline import criustats, progress
from revenant.cli.progress import ProgressLine, Rate, progress_text, stats_table
from revenant.common.settings import security
from revenant.messages import Progress, decode_as, encode, subjects

pytestmark = pytest.mark.unit

MiB = 1024 * 1024


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb_fields(fields: dict[int, int]) -> bytes:
    return b"".join(varint(number << 3 | 0) + varint(value) for number, value in fields.items())


def stats_image(entry: int, fields: dict[int, int], extra: bytes = b"") -> bytes:
    """A stats image as criu writes it: service magic, stats magic, length, StatsEntry."""
    body = pb_fields(fields)
    pb = varint(entry << 3 | 2) + varint(len(body)) + body + extra
    return struct.pack("<III", 0x55105940, 0x57093306, len(pb)) + pb


# ---------------------------------------------------------------------- criu's statistics


def test_a_stats_dump_reads_as_seconds_and_pages():
    data = stats_image(1, {1: 1_234, 2: 456_789, 3: 120_000, 4: 2_500_000, 5: 52_000, 6: 0, 7: 51_300,
                           8: 0, 9: 0, 10: 3, 11: 17, 12: 8, 13: 0, 14: 8})
    stats = criustats.parse(data)
    assert stats["freezing_time_s"] == pytest.approx(0.001234)
    assert stats["frozen_time_s"] == pytest.approx(0.456789)
    assert stats["memory_dump_time_s"] == pytest.approx(0.12)
    assert stats["memory_write_time_s"] == pytest.approx(2.5)
    assert stats["memory_pages_scanned"] == 52_000
    assert stats["memory_pages_skipped_from_parent"] == 0
    assert stats["memory_pages_written"] == 51_300
    assert stats["shared_memory_pages_written"] == 8
    assert len(stats) == 14 and all(isinstance(v, float) for v in stats.values())


def test_a_stats_restore_reads_too_and_big_counts_survive():
    data = stats_image(2, {1: 7, 2: 3, 3: 15_000, 4: 310_000, 5: 2**40})
    assert criustats.parse(data) == {"pages_compared": 7, "pages_skipped_cow": 3, "forking_time_s": 0.015,
                                     "restore_time_s": 0.31, "pages_restored": float(2**40)}


def test_unknown_fields_are_skipped():
    # A newer criu: a field the parser does not know, in the entry and beside it.
    data = stats_image(1, {2: 1_000, 99: 5}, extra=varint(7 << 3 | 0) + varint(1))
    assert criustats.parse(data) == {"frozen_time_s": 0.001}


@pytest.mark.parametrize("data", [
    b"", b"\x00" * 11, struct.pack("<III", 0x55105940, 0x12345678, 0),  # not stats
    stats_image(1, {2: 1_000})[:-1],  # cut short
    struct.pack("<III", 0x55105940, 0x57093306, 3) + b"\x0a\x05\x10",  # the entry runs past the end
    struct.pack("<III", 0x55105940, 0x57093306, 2) + b"\x0d\x00",  # a 32-bit field: not criu's
    struct.pack("<III", 0x55105940, 0x57093306, 2) + b"\x10\xff",  # a varint that never ends
])
def test_anything_else_reads_as_no_statistics(data):
    assert criustats.parse(data) == {}


def test_a_missing_file_reads_as_no_statistics(tmp_path):
    assert criustats.read(tmp_path / criustats.DUMP_FILE) == {}
    (tmp_path / criustats.DUMP_FILE).write_bytes(stats_image(1, {7: 12}))
    assert criustats.read(tmp_path / criustats.DUMP_FILE) == {"memory_pages_written": 12}


def test_stats_table_names_what_criu_measured():
    table = stats_table({"frozen_time_s": 0.4123, "memory_pages_written": 51300.0, "restore_time_s": 0.031,
                         "page_pipes": 3.0})
    lines = table.splitlines()
    assert lines[0] == "criu statistics:"
    assert any(line.split() == ["frozen", "time", "412.3", "ms"] for line in lines)
    assert any(line.split() == ["pages", "written", "51,300"] for line in lines)
    assert any(line.split() == ["restore", "time", "31.0", "ms"] for line in lines)
    assert len({len(line.removesuffix(" ms")) for line in lines[1:]}) == 1  # the numbers aligned
    assert stats_table({}) == "criu statistics: none reported"


# ---------------------------------------------------------------------- the line on a terminal


def report(op="dump", done=0, total=0, elapsed=0.0, job="7") -> Progress:
    return Progress(job=job, op=op, node="node-1", bytes=done, total_bytes=total, elapsed_s=elapsed)


def test_progress_text():
    assert progress_text(report(done=int(1.2 * 1024 * MiB), total=4 * 1024 * MiB), 310 * MiB) == \
        "dumping job 7: 1.2 GiB of ~4.0 GiB, 310.0 MiB/s"
    assert progress_text(report(op="restore", done=512 * MiB, total=2048 * MiB), None) == \
        "restoring job 7: 512.0 MiB of ~2.0 GiB"
    # Past the estimate (images hold more than the job's RSS), or no estimate: the bytes alone.
    assert progress_text(report(done=5 * MiB, total=4 * MiB), 1.0) == "dumping job 7: 5.0 MiB, 1 B/s"
    assert progress_text(report(done=5 * MiB), None) == "dumping job 7: 5.0 MiB"
    assert progress_text(report(op="commit", done=4 * MiB, total=4 * MiB), 0.0) == "committing job 7: 4.0 MiB written"


def test_rate_over_the_last_reports():
    rate = Rate(window_s=2.0)
    assert rate.add(0.0, 0) is None
    assert rate.add(0.5, 50 * MiB) == pytest.approx(100 * MiB)
    assert rate.add(1.0, 100 * MiB) == pytest.approx(100 * MiB)
    assert rate.add(1.5, 100 * MiB) == pytest.approx(200 * MiB / 3)
    for t in (2.0, 2.5, 3.0, 3.5):
        last = rate.add(t, 100 * MiB)
    assert last == 0  # stalled for two seconds: the window has only the stall in it
    assert rate.add(4.0, 110 * MiB) == pytest.approx(10 * MiB / 2.0, rel=0.3)
    # Fewer bytes or an earlier time: another operation, measured from scratch.
    assert rate.add(0.5, 10 * MiB) == pytest.approx(20 * MiB)
    # A lost report changes nothing but the window: the agent's clock, not arrival times.
    fresh = Rate()
    fresh.add(0.5, 10 * MiB)
    assert fresh.add(2.0, 40 * MiB) == pytest.approx(20 * MiB)


def test_the_line_is_rewritten_in_place_and_cleared():
    out = io.StringIO()
    line = ProgressLine("7", out, width=80)
    line.heard(encode(report(done=10 * MiB, total=100 * MiB, elapsed=0.5)))
    line.heard(encode(report(done=30 * MiB, total=100 * MiB, elapsed=1.0)))
    line.heard(encode(report(job="8", done=90 * MiB, elapsed=1.0)))  # another job's
    line.heard(b"\x93garbage")
    line.heard(encode(report(op="commit", done=99 * MiB, total=100 * MiB, elapsed=1.5)))
    line.close()
    line.heard(encode(report(done=99 * MiB, elapsed=2.0)))  # after the reply: never drawn
    assert out.getvalue() == (
        "\rdumping job 7: 10.0 MiB of ~100.0 MiB, 20.0 MiB/s\x1b[K"
        "\rdumping job 7: 30.0 MiB of ~100.0 MiB, 40.0 MiB/s\x1b[K"
        "\rcommitting job 7: 99.0 MiB written\x1b[K"
        "\r\x1b[K")


def test_the_line_never_wraps_and_nothing_heard_leaves_nothing():
    out = io.StringIO()
    line = ProgressLine("7", out, width=20)
    line.heard(encode(report(done=10 * MiB, total=100 * MiB, elapsed=0.5)))
    assert out.getvalue() == "\rdumping job 7: 10.0\x1b[K"
    quiet = io.StringIO()
    ProgressLine("7", quiet).close()
    assert quiet.getvalue() == ""


# ---------------------------------------------------------------------- subjects and permissions


def test_progress_subjects_carry_the_user():
    assert subjects.progress("alice", "7") == "revenant.progress.alice.7"
    assert subjects.progress("", "7") == "revenant.progress.root.7"  # a record from before users: root's
    assert subjects.job_progress("7", "alice") == "revenant.progress.alice.7"
    assert subjects.job_progress("7") == "revenant.progress.*.7"  # admin: whoever's job 7 is
    with pytest.raises(subjects.InvalidName):
        subjects.progress("al.ice", "7")


def test_who_may_publish_and_hear_progress():
    agent, admin = security.permissions_for("agent-node-1"), security.permissions_for("admin")
    alice = security.permissions_for("user-alice")
    assert subjects.PROGRESS_ALL in agent.publish_allow and subjects.PROGRESS_ALL not in agent.subscribe_allow
    assert subjects.PROGRESS_ALL in admin.subscribe_allow
    assert "revenant.progress.alice.>" in alice.subscribe_allow
    assert not any(s.startswith(subjects.PROGRESS_PREFIX) for s in alice.publish_allow + admin.publish_allow)


# ---------------------------------------------------------------------- the agent's reports


def test_dir_bytes_counts_files_below_not_links(tmp_path):
    (tmp_path / "pages-1.img").write_bytes(b"x" * 5000)
    (tmp_path / "predump").mkdir()
    (tmp_path / "predump" / "pages-1.img").write_bytes(b"y" * 300)
    (tmp_path / "parent").symlink_to("predump")
    assert progress.dir_bytes(tmp_path) == 5300
    assert progress.dir_bytes(tmp_path / "gone") == 0


def test_tree_rss_of_a_process_and_of_none():
    assert resident_bytes(os.getpid()) > 0  # the storage guard's reading, which a dump's progress uses
    assert resident_bytes(2**22 + 1) == 0  # above any pid_max: no such process


async def test_the_reporter_publishes_until_stopped_and_never_fails_the_operation():
    sent: list[tuple[str, Progress]] = []
    state = {"bytes": 0, "fail_publish": False, "fail_measure": False}

    async def publish(subject: str, data: bytes) -> None:
        if state["fail_publish"]:
            raise ConnectionError("no bus")
        sent.append((subject, decode_as(data, Progress)))

    def measure() -> int:
        if state["fail_measure"]:
            raise OSError("vanished")
        state["bytes"] += MiB
        return state["bytes"]

    reporter = progress.Reporter("node-1", publish, interval_s=0.005)
    watch = reporter.watch("7", "alice", "dump", measure, lambda: 64 * MiB)
    while len(sent) < 3:
        await asyncio.sleep(0.005)
    watch.op = "commit"
    state.update(fail_publish=True, fail_measure=True)
    await asyncio.sleep(0.03)
    state.update(fail_publish=False, fail_measure=False)
    count = len(sent)
    while len(sent) < count + 2:
        await asyncio.sleep(0.005)
    watch.stop()
    await asyncio.sleep(0.02)
    stopped = len(sent)
    await asyncio.sleep(0.03)
    assert len(sent) == stopped
    assert {subject for subject, _ in sent} == {"revenant.progress.alice.7"}
    msgs = [m for _, m in sent]
    assert [m.op for m in msgs[:3]] == ["dump"] * 3 and msgs[-1].op == "commit"
    assert all(m.job == "7" and m.node == "node-1" and m.total_bytes == 64 * MiB for m in msgs)
    assert [m.bytes for m in msgs] == sorted(m.bytes for m in msgs) and msgs[0].bytes == MiB
    assert [m.elapsed_s for m in msgs] == sorted(m.elapsed_s for m in msgs)


async def test_without_a_bus_or_a_usable_subject_nothing_is_started():
    idle = progress.Reporter("node-1").watch("7", "alice", "dump", lambda: 1)
    assert idle.task is None
    idle.stop()

    async def publish(subject: str, data: bytes) -> None:
        raise AssertionError("nothing to publish")

    odd = progress.Reporter("node-1", publish).watch("7", "not a name", "dump", lambda: 1)
    assert odd.task is None
