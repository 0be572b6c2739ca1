"""The gate's keeper: a small process that answers the agent's fanotify permission events when
the agent cannot (agent/files/gate/cowgate.py).

The agent's gate makes any open of a file it must still copy wait for that copy.  fanotify has no
timeout: an event nobody answers makes the opener wait for ever, and a stopped agent (SIGSTOP,
a debugger, a hung thread) answers nothing.  The keeper holds the same fanotify group (a
descriptor inherited from the agent) and watches the agent's answering thread beat (a
monotonic time in a shared page): an event pending for ``STALE_S`` with no beat since is
answered here, FAN_ALLOW, and counted in the page, so the agent knows that an open went through
before its copy (agent/files/gate/cowgate.py then checks each copy against the file's ctime).

Pending means not read yet (the keeper reads and answers it), or read by the agent, which holds
it for its copy or was stopped before it could answer.  Such an event is no longer the group's
to read, and would wait until the agent died.  A response names an event by the number of the
descriptor its reader was given, and any holder of the group may give it (a number that is no
pending event's is refused, ENOENT, and nothing else happens): so, while the agent is stale with
files gated (the page says how many), the keeper answers every descriptor number the agent has
open.  The answering thread beats every ``BEAT_MS`` while files are gated, so a live agent is
never taken for a stopped one.

It exits when the agent's end of its pipe closes (the agent died, was killed, or let the gate
go): the group's last descriptor goes with it, and the kernel lets every pending open through.

Standard library only, run with ``python -I -S`` before anything is gated: it never opens a
file a gate could hold.
"""

import mmap
import os
import select
import struct
import sys
import time

STALE_S = 0.4  # an event pending this long, with no beat of the answering thread since: answered here
EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
RESPONSE = struct.Struct("=iI")  # struct fanotify_response
FAN_ALLOW = 0x1
# The shared page: the answering thread's last beat (CLOCK_MONOTONIC ns), the opens answered
# here, the files gated now.
BEAT = struct.Struct("=qqq")


def answer_all(fan: int) -> int:
    """Allow every event pending on ``fan``; how many."""
    n = 0
    while True:
        try:
            buf = os.read(fan, 256 * EVENT.size)
        except (BlockingIOError, InterruptedError):
            return n
        if not buf:
            return n
        i = 0
        while i + EVENT.size <= len(buf):
            length, _, _, _, _, fd, _ = EVENT.unpack_from(buf, i)
            i += max(length, EVENT.size)
            if fd < 0:
                continue
            try:
                os.write(fan, RESPONSE.pack(fd, FAN_ALLOW))
            except OSError:
                pass
            os.close(fd)
            n += 1


def answer_held(fan: int, agent: int) -> int:
    """Allow every event the agent (pid ``agent``) read and has not answered: a response for each
    descriptor number it has open, which the kernel takes only for those that are events; how many."""
    try:
        numbers = os.listdir(f"/proc/{agent}/fd")
    except OSError:
        return 0
    n = 0
    for name in numbers:
        try:
            os.write(fan, RESPONSE.pack(int(name), FAN_ALLOW))
        except (OSError, ValueError):
            continue  # no event of the group's (ENOENT)
        n += 1
    return n


def keep(fan: int, shm: int, pipe: int, agent: int, stale_s: float = STALE_S) -> None:
    page = mmap.mmap(shm, BEAT.size)
    poller = select.poll()
    poller.register(pipe, select.POLLIN | select.POLLHUP)
    poller.register(fan, select.POLLIN)
    seen_ns = 0  # when unread events were first seen, no file being gated (0: none)
    while True:
        ready = dict(poller.poll(50))
        if pipe in ready:
            return  # the agent is gone, or let the gate go
        now = time.monotonic_ns()
        beat, answered, gated = BEAT.unpack_from(page, 0)
        if gated > 0:
            since = beat  # it beats every BEAT_MS while files are gated
        elif fan in ready:
            if seen_ns == 0 or beat > seen_ns:
                seen_ns = now  # it answers when woken: give it its time from here
            since = seen_ns
        else:
            seen_ns = 0
            continue
        if now - since >= stale_s * 1e9:
            n = answer_all(fan) + answer_held(fan, agent)
            if n:
                # Counted before any later beat: the agent reads it after its copies.
                struct.pack_into("=q", page, 8, answered + n)
            seen_ns = 0
            continue
        time.sleep(0.02)  # the events are the agent's to read while it beats


if __name__ == "__main__":
    keep(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
