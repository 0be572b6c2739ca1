"""The partition history checker (tests/netcluster/checker.py) on histories made by hand: a clean
one passes, and each kind of violation is named."""

from __future__ import annotations

import pytest

from netcluster.checker import Job, check, heal_times, slow_heals, strip_addresses
from netcluster.history import Copy, History, Placement, Step
from netcluster.run import reference

pytestmark = pytest.mark.unit

A, B = "10.0.0.101", "10.0.0.102"
NODES = {A, B}


def out(steps: range, address: str = A) -> bytes:
    ref = reference(steps.stop).splitlines(keepends=True)
    return b"".join(ref[n].rstrip(b"\n") + f" {address}\n".encode() for n in steps)


def clean() -> tuple[History, Job]:
    """Job 1 on node-1, moved to node-2 (generation 2) at t=10 from epoch 1; healed at 12."""
    h = History()
    h.table = [Placement(0.0, "1", "node-1", 1, "running", []), Placement(4.0, "1", "node-1", 1, "running", [1]),
               Placement(10.0, "1", "node-2", 2, "restoring", [1]), Placement(11.0, "1", "node-2", 2, "running", [1])]
    h.steps = [Step(float(t), "1", t, "node-1") for t in range(8)] + [Step(11.2, "1", 4, "node-2")]
    h.samples = [(float(t), [Copy("1", 50, "node-1", t >= 8)] + ([Copy("1", 60, "node-2", False)] if t >= 11 else []))
                 for t in range(12)] + [(13.0, [Copy("1", 60, "node-2", False)])]
    h.heals = [12.0]
    return h, Job("1", reference(100), out(range(4)) + out(range(4, 6), B), {1}, 3)


def test_a_clean_history_passes():
    h, job = clean()
    assert check(h, [job], NODES) == []


def test_two_running_copies_are_named():
    h, job = clean()
    h.samples[9] = (9.0, [Copy("1", 50, "node-1", False), Copy("1", 60, "node-2", False)])
    found = check(h, [job], NODES)
    assert len(found) == 1 and found[0].startswith("two copies: job 1 ran on node-1 pid 50, node-2 pid 60")


def test_output_that_is_not_a_prefix_is_named():
    h, job = clean()
    job.output = out(range(4)) + out(range(3, 6), B)  # step 3 written twice: no rollback
    assert check(h, [job], NODES) == ["output: job 1 is not a prefix of the uninterrupted run from line 4"]


def test_output_from_no_nodes_address_is_named():
    h, job = clean()
    job.output = out(range(4), "127.0.0.1")
    assert check(h, [job], NODES) == ["output: job 1 has lines from 127.0.0.1, no node's address"]


def test_a_step_from_a_superseded_generation_is_named():
    h, job = clean()
    h.steps.append(Step(10.8, "1", 8, "node-1"))  # the old copy took a step after the move
    found = check(h, [job], NODES)
    assert found == ["superseded: job 1 step 8 came from node-1 (generation 1) at 10.80, after the table moved "
                     "it to generation 2"]


def test_a_step_moments_after_the_move_is_named_and_one_just_before_is_not():
    """Both clocks are this host's: only the moment between reading the clock and acting is let go."""
    h, job = clean()
    h.steps.append(Step(9.95, "1", 8, "node-1"))  # within moved_slack_s of the move at 10.0
    assert check(h, [job], NODES) == []
    h.steps.append(Step(10.2, "1", 9, "node-1"))
    assert check(h, [job], NODES) == ["superseded: job 1 step 9 came from node-1 (generation 1) at 10.20, after "
                                      "the table moved it to generation 2"]


def test_a_completed_job_must_have_written_its_whole_run():
    h, job = clean()
    h.table.append(Placement(30.0, "1", "node-2", 2, "completed", [1]))
    h.samples.append((31.0, []))
    assert check(h, [job], NODES) == ["output: job 1 completed with 6 of the uninterrupted run's 100 lines"]
    job.output = out(range(4)) + out(range(4, 100), B)
    assert check(h, [job], NODES) == []


def test_a_failed_job_is_lost_unless_failure_is_allowed():
    h, job = clean()
    h.table.append(Placement(30.0, "1", "", 2, "failed", [1], reason="node node-2 died and the restore failed"))
    assert check(h, [job], NODES) == ["unexplained: job 1 failed: node node-2 died and the restore failed"]
    assert check(h, [job], NODES, failed_ok=True) == []


def test_a_step_from_a_node_the_job_never_had_is_named():
    h, job = clean()
    h.steps.append(Step(5.0, "1", 5, "?"))
    assert check(h, [job], NODES) == ["superseded: job 1 step 5 came from ?, where the table never placed it"]


def test_an_acknowledged_epoch_that_is_gone_is_named():
    h, job = clean()
    job.on_disk = set()
    assert check(h, [job], NODES) == ["lost epoch: job 1 epoch 1 was acknowledged and is gone (0 newer on the "
                                      "storage, 3 kept)"]


def test_an_epoch_pruned_by_retention_is_not_lost():
    h, job = clean()
    h.table.append(Placement(20.0, "1", "node-2", 2, "running", [2, 3, 4]))
    job.on_disk = {2, 3, 4}
    assert check(h, [job], NODES) == []


def test_a_job_left_frozen_is_named():
    h, job = clean()
    h.samples += [(t, [Copy("1", 60, "node-2", True)]) for t in (14.0, 14.5, 15.0)]  # frozen its last second
    found = check(h, [job], NODES)
    assert found == ["unexplained: job 1 is running on node-2 in the table, its copies: node-2 pid 60 frozen"]


def test_a_job_left_restoring_is_named():
    h, job = clean()
    h.table.append(Placement(15.0, "1", "node-1", 3, "restoring", [1]))
    assert "unexplained: job 1 left restoring on node-1" in check(h, [job], NODES)


def test_a_copy_still_frozen_long_after_the_heal_is_named():
    h, job = clean()
    assert [took for _, _, took in heal_times(h)] == [1.0] and slow_heals(h) == []  # killed, job on node-2
    h.samples = [s for s in h.samples if s[0] <= 12.0] + [
        (12.0 + t, [Copy("1", 50, "node-1", True), Copy("1", 60, "node-2", False)]) for t in (1, 3, 5)]
    h.samples.append((20.0, [Copy("1", 60, "node-2", False)]))
    assert check(h, [job], NODES) == []  # slow, not unsafe
    assert slow_heals(h) == ["heal: job 1's copy on node-1 (pid 50) was neither thawed nor killed with its job "
                             "running elsewhere within 5 s of the heal at 12.00 (it took 8.0 s)"]


def test_a_heal_settles_with_a_new_copy_on_the_same_node_or_the_job_ended():
    h, job = clean()
    h.samples = [s for s in h.samples if s[0] <= 12.0] + [(13.5, [Copy("1", 70, "node-1", False)])]
    assert [took for _, _, took in heal_times(h)] == [1.5]  # restored back onto node-1: a new pid
    h.samples = [s for s in h.samples if s[0] <= 12.0] + [(14.0, [])]
    assert [took for _, _, took in heal_times(h)] == [None]  # gone, and the job nowhere
    h.table.append(Placement(13.0, "1", "node-2", 2, "completed", [1]))
    assert [took for _, _, took in heal_times(h)] == [2.0]  # gone, the job ended


def test_a_heal_can_be_counted_from_when_the_nodes_lease_was_back():
    h, job = clean()
    h.samples = [s for s in h.samples if s[0] <= 12.0] + [
        (12.0 + t, [Copy("1", 50, "node-1", True), Copy("1", 60, "node-2", False)]) for t in (1, 3, 5)]
    h.samples.append((20.0, [Copy("1", 60, "node-2", False)]))
    h.leases = {"node-1": [3.0, 16.0, 16.4]}  # the bus took its lease again 4 s after the heal
    assert [took for _, _, took in heal_times(h, from_lease=True)] == [4.0]
    assert slow_heals(h, 5.0, from_lease=True) == []


def test_addresses_are_taken_off_each_line():
    body, seen = strip_addresses(b"0 abc 10.0.0.1\n1 def 10.0.0.2\n")
    assert body == b"0 abc\n1 def\n" and seen == {"10.0.0.1", "10.0.0.2"}


def test_a_copy_dying_of_sigkill_is_not_running_and_a_live_one_is():
    """A stopped copy its agent kills shows as running for a moment on its way out (the kernel's
    exit path); the sampler must not count it.  A running or gone process reads as such."""
    import os
    import signal
    import subprocess

    from netcluster.history import dying

    assert not dying(os.getpid())
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not dying(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        assert not dying(proc.pid)  # stopped is frozen by its state, not dying
    finally:
        proc.kill()
        proc.wait()
    assert dying(proc.pid)  # reaped: gone
