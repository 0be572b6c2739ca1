"""agent/files/workdir_scan.py: the working directory listed before the freeze and looked at again
while frozen at the cost of its directories: the result is the full listing's, whatever changed
in between (issue 44: a freeze that grew with a project directory)."""

from __future__ import annotations

import os
import time

import pytest

from revenant.agent.files import dirwatch, workdir_scan

pytestmark = pytest.mark.unit


@pytest.fixture
def inotify():
    """A watch of the test's own (the agent's is shared by every listing)."""
    w = dirwatch.DirWatch()
    yield w
    os.close(w.fd)


@pytest.fixture(params=["stat", "inotify"])
def watch(request):
    """How the freeze knows which directories changed: each looked at, or told by the kernel."""
    yield None if request.param == "stat" else request.getfixturevalue("inotify")


def _tree(top) -> None:
    for d in ("a", "a/b", "a/b/c", "keep", "gone", ".venv/lib"):
        (top / d).mkdir(parents=True)
    for f in ("x", "a/y", "a/b/z", "a/b/c/w", "keep/k", "gone/g", ".venv/lib/m.py", "written"):
        (top / f).write_text(f)


def _full(top, skip=frozenset()):
    found = workdir_scan.scan(str(top), 10_000, skip)
    return found.listing, found.stats


def test_a_rescan_lists_what_a_full_scan_lists_whatever_changed_since_the_split(tmp_path, watch):
    top = tmp_path / "wd"
    _tree(top)
    pre = workdir_scan.scan(str(top), 10_000, watch=watch)
    assert (pre.since >= 0) == (watch is not None)
    written = {"written", "a/b/z"}
    workdir_scan.split(pre, lambda rel, st: rel in written)
    time.sleep(0.02)
    (top / "written").write_text("more")  # a file the freeze stats again
    (top / "a/b/z").write_text("changed")
    (top / "a/new").write_text("new")  # a changed directory: listed anew
    (top / "gone/g").unlink()
    os.rmdir(top / "gone")
    os.rename(top / "a/b/c", top / "a/b/c2")  # a renamed directory
    os.symlink("/etc", top / "keep/link")
    again = workdir_scan.rescan(pre, 10_000, frozenset({str(top / "x")}), lambda rel, st: False, watch=watch)
    listing, stats = _full(top, frozenset({str(top / "x")}))
    assert again.listing == listing
    assert {rel: (st.st_ino, st.st_size, st.st_ctime_ns) for rel, st in again.stats.items()} == \
        {rel: (st.st_ino, st.st_size, st.st_ctime_ns) for rel, st in stats.items()}
    assert again.changed == {"", "a", "a/b", "keep", "a/b/c2"}  # the rest taken as it was
    assert again.stats[".venv/lib/m.py"] is pre.stats[".venv/lib/m.py"]


def test_a_directory_swapped_for_a_link_is_never_entered_and_descriptors_stay_few(tmp_path, watch):
    top = tmp_path / "wd"
    _tree(top)
    for i in range(300):  # more directories than the walk keeps open
        (top / "many" / f"d{i}").mkdir(parents=True)
        (top / "many" / f"d{i}" / "f").write_text("f")
    pre = workdir_scan.split(workdir_scan.scan(str(top), 10_000, watch=watch), lambda rel, st: False)
    os.rename(top / "a", tmp_path / "a-moved")
    os.symlink(tmp_path / "a-moved", top / "a")
    before = len(os.listdir("/proc/self/fd"))
    again = workdir_scan.rescan(pre, 10_000, frozenset(), lambda rel, st: False, watch=watch)
    assert "a" in again.listing and not any(rel.startswith("a/") for rel in again.listing)
    assert len(os.listdir("/proc/self/fd")) == before
    assert len([rel for rel in again.listing if rel.startswith("many/")]) == 600
    assert workdir_scan.rescan(pre, 100, frozenset(), lambda rel, st: False) is None  # over max_entries


def _changed(top, pre, w) -> set[str]:
    return workdir_scan.rescan(pre, 10_000, frozenset(), lambda rel, st: False, watch=w).changed


def test_the_kernel_says_which_directories_changed_and_the_freeze_looks_at_no_other(tmp_path, inotify):
    """A directory whose times changed with no entry made, removed or renamed in it (utime) is
    listed anew when the freeze looks at each directory's times, and taken as it was when the
    kernel says nothing changed in it: the freeze made no system call for it."""
    top = tmp_path / "wd"
    _tree(top)
    w = inotify
    pre = workdir_scan.scan(str(top), 10_000, watch=w)
    os.utime(top / "keep", (1, 1))
    assert _changed(top, pre, w) == set()
    assert _changed(top, pre, None) == {"keep"}
    (top / "keep" / "new").write_text("n")  # an entry made in it: told
    assert _changed(top, pre, w) == {"keep"}


def test_one_jobs_reading_of_the_changes_never_hides_them_from_another(tmp_path, inotify):
    """Two listings of one directory (two jobs sharing it) on the agent's one watch: each sees a
    change made after it began, whichever reads the changes first; a change before a listing
    began is in that listing, not a change to it."""
    top = tmp_path / "wd"
    _tree(top)
    w = inotify
    first = workdir_scan.scan(str(top), 10_000, watch=w)
    (top / "a" / "early").write_text("e")
    second = workdir_scan.scan(str(top), 10_000, watch=w)
    (top / "keep" / "late").write_text("l")
    assert _changed(top, first, w) == {"a", "keep"}
    assert _changed(top, second, w) == {"keep"}
    assert _changed(top, first, w) == {"a", "keep"}  # read again: still there


def test_lost_events_make_the_freeze_look_at_every_directory(tmp_path, inotify):
    top = tmp_path / "wd"
    _tree(top)
    w = inotify
    pre = workdir_scan.scan(str(top), 10_000, watch=w)
    os.utime(top / "keep", (1, 1))
    w._overflow = w._seq + 1  # as an IN_Q_OVERFLOW read now would set it
    assert w.dirty(pre.since) is None
    assert _changed(top, pre, w) == {"keep"}  # looked at, as without the watch
