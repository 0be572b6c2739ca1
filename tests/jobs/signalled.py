"""A job that answers signals as training scripts do: USR1 saves its state (says so), TERM ends
it cleanly (says so, exits 0), unless started with ``ignore-term``.  It forks one worker, which
says which signals reach it.  Output: a line per step, and a line per signal."""

import os
import signal
import sys
import time

ignore_term = "ignore-term" in sys.argv[1:]
step = 0


def say(text: str) -> None:
    print(text, flush=True)


def parent_usr1(signum, frame) -> None:
    say(f"program: saved at step {step}")


def parent_term(signum, frame) -> None:
    if ignore_term:
        say("program: TERM ignored")
        return
    say("program: bye")
    os.kill(worker, signal.SIGKILL)
    sys.exit(0)


worker = os.fork()
if worker == 0:
    signal.signal(signal.SIGUSR1, lambda *_: say("worker: USR1"))
    signal.signal(signal.SIGTERM, lambda *_: say("worker: TERM") if ignore_term else sys.exit(0))
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGUSR1, parent_usr1)
signal.signal(signal.SIGTERM, parent_term)
say(f"program: started, worker {worker}")
while True:
    step += 1
    time.sleep(0.02)
