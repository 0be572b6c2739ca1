"""``revenant logs``: what of a job's output is printed next, as the output grows, is cut back
by a restore (a marker line, then on from the epoch's end), or starts afresh; pure, on a file."""

from __future__ import annotations

import pytest

from revenant.cli.jobcontrol import Follower, tail_start
from revenant.messages import EpochInfo, JobRecord, JobSpec

pytestmark = pytest.mark.unit


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def rec(generation: int = 1, state: str = "running", restored_from: int = 0, epochs=()) -> JobRecord:
    return JobRecord(spec=JobSpec(id="7", argv=["x"]), state=state, generation=generation,
                     restored_from=restored_from, epochs=list(epochs))


def lines(a: int, b: int) -> bytes:
    return b"".join(b"line %d\n" % i for i in range(a, b))


@pytest.fixture
def out(tmp_path):
    return tmp_path / "output.log"


@pytest.fixture
def reader(out):
    opened = []

    def make():
        opened.append(open(out, "rb"))
        return opened[-1]

    yield make
    for f in opened:
        f.close()


def printed(follower: Follower, record: JobRecord) -> bytes:
    return b"".join(follower.step(record))


def test_tail_starts_at_the_last_lines(out):
    out.write_bytes(lines(0, 10))
    with open(out, "rb") as f:
        assert f.read()[tail_start(f, 3):] == lines(7, 10)
        assert tail_start(f, 0) == len(lines(0, 10)) and tail_start(f, 100) == 0
    out.write_bytes(lines(0, 10) + b"partial")
    with open(out, "rb") as f:
        f.seek(tail_start(f, 2))
        assert f.read() == lines(9, 10) + b"partial"


def test_the_output_is_printed_as_it_grows_and_a_restore_marks_what_it_undid(out, reader):
    out.write_bytes(lines(0, 10))
    follower = Follower(reader(), rec(), tail=None)
    assert printed(follower, rec()) == lines(0, 10)
    with open(out, "ab") as w:
        w.write(lines(10, 20))
    assert printed(follower, rec()) == lines(10, 20)
    assert printed(follower, rec()) == b"" and follower.caught_up()
    # Epoch 2 was taken after line 14; the job died at line 19 and comes back from there,
    # writing the same lines again (a deterministic job) and more.
    at_epoch = len(lines(0, 15))
    with open(out, "r+b") as w:
        w.truncate(at_epoch)
    assert printed(follower, rec(1)) == b""  # cut back, the record not yet restored: wait
    with open(out, "ab") as w:
        w.write(lines(15, 25))
    restored = rec(2, restored_from=2, epochs=[EpochInfo(n=1, output_bytes=10), EpochInfo(n=2, output_bytes=at_epoch)])
    assert printed(follower, rec(2, state="restoring")) == b""  # not running yet: nothing decided
    text = printed(follower, restored)
    marker = (b"--- revenant: job 7's output rolled back to epoch 2, at byte %d (the last %d bytes above are "
              b"undone) ---\n" % (at_epoch, len(lines(15, 20))))
    assert text == marker + lines(15, 25)


def test_a_change_the_record_does_not_explain_is_marked_after_a_while(out, reader):
    out.write_bytes(lines(0, 10))
    clock = Clock()
    follower = Follower(reader(), rec(), tail=2, clock=clock)
    assert printed(follower, rec()) == lines(8, 10)
    out.write_bytes(lines(0, 9) + b"other\n")
    assert printed(follower, rec()) == b""
    clock.now = 10.0
    text = printed(follower, rec())
    assert text.startswith(b"--- revenant: job 7's output was rewritten, at byte %d" % len(lines(0, 9)))
    assert text.endswith(b" ---\nother\n")


def test_an_output_put_back_as_a_new_file_is_read_from_its_path(out, reader):
    out.write_bytes(lines(0, 10))
    follower = Follower(reader(), rec(), tail=None)
    printed(follower, rec())
    with open(out.with_suffix(".new"), "wb") as w:
        w.write(lines(0, 4) + lines(4, 12))
    out.with_suffix(".new").replace(out)
    epochs = [EpochInfo(n=1, output_bytes=len(lines(0, 4)))]
    text = printed(follower, rec(2, restored_from=1, epochs=epochs))
    assert text.endswith(b" ---\n" + lines(4, 12)) and b"rolled back to epoch 1" in text
    follower.f.close()


def test_a_requeue_starts_the_output_afresh(out, reader):
    out.write_bytes(lines(0, 5))
    follower = Follower(reader(), rec(), tail=None)
    printed(follower, rec())
    out.write_bytes(b"")
    with open(out, "ab") as w:
        w.write(lines(0, 2))
    text = printed(follower, rec(2))
    assert text.startswith(b"--- revenant: job 7's output started afresh (a requeue), at byte 0") and \
        text.endswith(lines(0, 2))


def test_a_cut_further_back_than_the_fence_is_printed_again_from_the_start(out, reader):
    out.write_bytes(lines(0, 2000))  # far more than the fence keeps
    clock = Clock()
    follower = Follower(reader(), rec(), tail=None, clock=clock)
    assert printed(follower, rec()) == lines(0, 2000)
    out.write_bytes(lines(0, 1000) + b"other\n" + lines(1000, 1500))  # an epoch that says nothing of its output
    assert printed(follower, rec()) == b""
    clock.now = 10.0
    text = printed(follower, rec())
    assert text.startswith(b"--- revenant: job 7's output was rewritten before the last bytes this kept; printed "
                           b"again from its start, at byte 0 (the last %d bytes above are undone) ---\n"
                           % len(lines(0, 2000)))
    assert text.endswith(b" ---\n" + lines(0, 1000) + b"other\n" + lines(1000, 1500))


def test_a_follower_started_during_a_restore_marks_what_it_undid(out, reader):
    out.write_bytes(lines(0, 20))
    follower = Follower(reader(), rec(3, state="restoring"), tail=5)
    assert printed(follower, rec(3, state="restoring")) == b""  # nothing decided while it comes up
    at_epoch = len(lines(0, 12))  # before where its tail began: those lines are gone
    out.write_bytes(lines(0, 12) + b"restored on\n")
    text = printed(follower, rec(3, restored_from=4, epochs=[EpochInfo(n=4, output_bytes=at_epoch)]))
    assert text == (b"--- revenant: job 7's output rolled back to epoch 4, at byte %d (the last %d bytes above are "
                    b"undone) ---\nrestored on\n" % (at_epoch, len(lines(12, 15))))


def test_a_requeue_that_has_already_written_more_is_marked_too(out, reader):
    out.write_bytes(lines(0, 3))
    follower = Follower(reader(), rec(), tail=None)
    printed(follower, rec())
    out.write_bytes(lines(0, 8))  # the fresh run wrote the same lines and more before the follower looked
    text = printed(follower, rec(2))
    assert text.startswith(b"--- revenant: job 7's output started afresh (a requeue), at byte 0") and \
        text.endswith(b" ---\n" + lines(0, 8))
