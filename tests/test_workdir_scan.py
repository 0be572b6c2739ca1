"""agent/files/workdir_scan.py: the working directory listed before the freeze and looked at again
while frozen at the cost of its directories: the result is the full listing's, whatever changed
in between (issue 44: a freeze that grew with a project directory)."""

from __future__ import annotations

import os
import time

import pytest

from revenant.agent.files import workdir_scan

pytestmark = pytest.mark.unit


def _tree(top) -> None:
    for d in ("a", "a/b", "a/b/c", "keep", "gone", ".venv/lib"):
        (top / d).mkdir(parents=True)
    for f in ("x", "a/y", "a/b/z", "a/b/c/w", "keep/k", "gone/g", ".venv/lib/m.py", "written"):
        (top / f).write_text(f)


def _full(top, skip=frozenset()):
    found = workdir_scan.scan(str(top), 10_000, skip)
    return found.listing, found.stats


def test_a_rescan_lists_what_a_full_scan_lists_whatever_changed_since_the_split(tmp_path):
    top = tmp_path / "wd"
    _tree(top)
    pre = workdir_scan.scan(str(top), 10_000)
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
    again = workdir_scan.rescan(pre, 10_000, frozenset({str(top / "x")}), lambda rel, st: False)
    listing, stats = _full(top, frozenset({str(top / "x")}))
    assert again.listing == listing
    assert {rel: (st.st_ino, st.st_size, st.st_ctime_ns) for rel, st in again.stats.items()} == \
        {rel: (st.st_ino, st.st_size, st.st_ctime_ns) for rel, st in stats.items()}
    assert again.changed == {"", "a", "a/b", "keep", "a/b/c2"}  # the rest taken as it was
    assert again.stats[".venv/lib/m.py"] is pre.stats[".venv/lib/m.py"]


def test_a_directory_swapped_for_a_link_is_never_entered_and_descriptors_stay_few(tmp_path):
    top = tmp_path / "wd"
    _tree(top)
    for i in range(300):  # more directories than the walk keeps open
        (top / "many" / f"d{i}").mkdir(parents=True)
        (top / "many" / f"d{i}" / "f").write_text("f")
    pre = workdir_scan.split(workdir_scan.scan(str(top), 10_000), lambda rel, st: False)
    os.rename(top / "a", tmp_path / "a-moved")
    os.symlink(tmp_path / "a-moved", top / "a")
    before = len(os.listdir("/proc/self/fd"))
    again = workdir_scan.rescan(pre, 10_000, frozenset(), lambda rel, st: False)
    assert "a" in again.listing and not any(rel.startswith("a/") for rel in again.listing)
    assert len(os.listdir("/proc/self/fd")) == before
    assert len([rel for rel in again.listing if rel.startswith("many/")]) == 600
    assert workdir_scan.rescan(pre, 100, frozenset(), lambda rel, st: False) is None  # over max_entries
