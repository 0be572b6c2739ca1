"""The lazy-pages daemon's tether: a small process between the agent and ``criu lazy-pages``, so that
the daemon never outlives a restore that will not come (agent/lazyrestore/lazy.py).

The daemon serves a lazily restored job its pages, and must outlive the agent once that job runs:
an agent that dies leaves its job running (until its dead man's switch freezes it), and a job
whose pages stop coming reads nothing it should.  But before the restore has the job running, a
daemon whose agent died serves no one and would wait for a connection for ever (one was found
15 minutes after its cluster and work directory were gone).  So the agent starts this, which
starts the daemon as its child, killed with it (``PR_SET_PDEATHSIG``), and holds a pipe from the
agent:

* the agent writes one byte once the restored job runs (handed over): from then on the tether
  only waits for the daemon, which ends by itself once every page is in or the job is gone;
* the pipe closes first (the agent died, or gave up the restore): the daemon is killed at once;
* the daemon exits: the tether exits the same way (its status, or its signal), so the agent
  reads the daemon's end as its own child's.

Killing the tether kills the daemon.  Standard library only, run with ``python -I -S``.

Usage: tether.py PIPE_FD -- ARGV...
"""

import ctypes
import os
import select
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _die_with_tether(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the tether died before the prctl took
        os._exit(137)


def _exit_as(status: int) -> None:
    """Exit as the daemon did: with its status, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def tether(pipe: int, argv: list[str]) -> None:
    os.set_inheritable(pipe, False)
    me = os.getpid()
    child = subprocess.Popen(argv, close_fds=False, preexec_fn=lambda: _die_with_tether(me))
    pidfd = os.pidfd_open(child.pid)
    poller = select.poll()
    poller.register(pipe, select.POLLIN | select.POLLHUP)
    poller.register(pidfd, select.POLLIN)
    watching = True
    while True:
        ready = dict(poller.poll())
        if pidfd in ready:
            _, status = os.waitpid(child.pid, 0)
            _exit_as(status)
        if watching and pipe in ready:
            try:
                said = os.read(pipe, 1)
            except OSError:
                said = b""
            if said:  # handed over: the daemon is the job's now
                poller.unregister(pipe)
                os.close(pipe)
                watching = False
            else:  # the agent is gone before the job ran: nobody will ever connect
                child.kill()
                _, status = os.waitpid(child.pid, 0)
                _exit_as(status)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.stderr.write("usage: tether.py PIPE_FD -- ARGV...\n")
        sys.exit(2)
    tether(int(sys.argv[1]), sys.argv[3:])
