"""Keeping a local cluster up: what ``revenant up`` started is restarted when it dies.

The supervisor is ``revenant up`` itself in the foreground, or with ``--detach`` a
detached ``revenant supervise DIR`` that ``up`` leaves behind.  Either way it is the
parent of nats-server, the coordinator and the agents, so it sees each exit and its
status, and it is recorded in ``cluster.json`` (``supervisor``) for ``revenant down``,
which stops it first (SIGUSR1: it exits at once and restarts nothing more) before it
stops the rest.

A process that *fails* (a non-zero exit, or death by a signal other than SIGTERM and
SIGINT: a ``kill -9``, the OOM killer, an uncaught error) is restarted with the
argv recorded in ``cluster.json``, which names the ports it had: nats-server comes back
on the same port with the same JetStream store, the coordinator and the agents on the
same HTTP port.  A clean exit (status 0, or a stop by SIGTERM or SIGINT, such as an
agent's drain) is an operator's decision and is left alone, as systemd's
``Restart=on-failure`` does.

Restarts back off (0.5 s, doubling while a process fails before it ran 10 s, at most
10 s) and are capped: a process that failed more than ``max_restarts`` (5) times within
``window_s`` (60 s) is crash-looping; that is logged and marked ``given_up`` in
``cluster.json``, and the process stays down.

Two holds make a restart one that can work and that changes nothing else:

* the coordinator and the agents wait until NATS accepts connections: they cannot start
  without it, and a restart during an outage would only fail and count towards the cap;
* an agent waits until the coordinator has declared its node dead, and ``DEAD_FOR_S``
  more (``AGENT_HOLD_MAX_S`` at most): a new agent does not adopt its predecessor's jobs,
  so for the cluster an agent's death is its node's, and the node is seen and handled as
  one that died (a ``dead`` event, its jobs restored elsewhere) before it joins again, empty.

Every exit, hold, restart and crash loop is a line in ``DIR/logs/supervisor.log`` (and on
stderr in the foreground).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from revenant.cli.cluster import netns
from revenant.cli.cluster.processes import (INSECURE_WARNING, STOP_ORDER, check_nats_servers, describe_exit, nodes,
                                    refuse_running, spawn, start_cluster, stop_processes, Shape)
from revenant.common.errors import RevenantError
from revenant.common.settings.cluster import ClusterFile, ProcessInfo, cluster_file, write_cluster
from revenant.messages import MessageError

log = logging.getLogger(__name__)

# How long an agent's restart waits at most for its node to be declared dead (no coordinator
# answering, say): beyond any detection time, so that it never waits on a coordinator for ever.
AGENT_HOLD_MAX_S = 30.0
# How long an agent's node stays declared dead before the agent is restarted: long enough for
# the death to be seen (``revenant nodes``) and its jobs' failover to have begun elsewhere.
DEAD_FOR_S = 2.0
# How often a held agent's node is looked up (each look-up is a NATS round trip).
NODE_CHECK_EVERY_S = 1.0
POLL_S = 0.1
CLEAN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# ------------------------------------------------------------------ the rules (pure)

@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # A process that ran this long came up fine: its next failure backs off from the start.
    stable_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 60.0

    def decide(self, failures: list[float], now: float, *, ran_s: float, streak: int) -> tuple[float | None, int]:
        """For a process that failed at ``now`` after running ``ran_s``: the seconds to wait
        before restarting it, or None when it already failed ``max_restarts`` times within
        ``window_s`` before this (a crash loop: give up on it); and the new ``streak`` (how
        many failures in a row came before it had run ``stable_s``), which doubles the wait."""
        if sum(1 for t in failures if now - t < self.window_s) >= self.max_restarts:
            return None, streak
        streak = 0 if ran_s >= self.stable_s else streak
        return min(self.max_backoff_s, self.backoff_s * 2 ** streak), streak + 1


def failed(returncode: int) -> bool:
    """Whether an exit calls for a restart: anything but 0 or a stop by SIGTERM/SIGINT."""
    return returncode != 0 and -returncode not in CLEAN_SIGNALS


def restart_hold(role: str, *, bus_up: bool, node_state: str, state_for_s: float, waited_s: float) -> str | None:
    """Why a due restart must wait, or None.  ``node_state`` is the coordinator's word on an
    agent's node (alive, suspect, dead, left, absent: not in its table, or unknown: no answer),
    in that state for ``state_for_s``; ``waited_s`` since the process died."""
    if role != "nats-server" and not bus_up:
        return "until NATS accepts connections"
    if role != "agent" or waited_s >= AGENT_HOLD_MAX_S or node_state in ("left", "absent"):
        return None
    if node_state != "dead" or state_for_s < DEAD_FOR_S:
        return f"until the coordinator has declared the node dead (at most {AGENT_HOLD_MAX_S:g} s)"
    return None


# ------------------------------------------------------------------ the loop

def _what(info: ProcessInfo) -> str:
    return info.name if info.name == info.role else f"{info.role} {info.name}"


@dataclass
class Child:
    info: ProcessInfo
    proc: subprocess.Popen[bytes] | None
    started_at: float = 0.0
    failures: list[float] = field(default_factory=list)
    streak: int = 0
    exited_at: float = 0.0
    due_at: float | None = None  # when a restart is due; None while running or left down
    held: str = ""  # the hold last logged, so that each is logged once


class Supervisor:
    def __init__(self, root: Path, cluster: ClusterFile, procs: dict[str, subprocess.Popen[bytes]], *,
                 policy: RestartPolicy = RestartPolicy()) -> None:
        self.root = root
        self.cluster = cluster
        self.policy = policy
        now = time.monotonic()
        self.children = [Child(info, procs[info.name], started_at=now) for info in cluster.processes
                         if info.name in procs]
        self.request: str | None = None  # "stop" (SIGTERM, SIGINT) or "release" (SIGUSR1: revenant down)
        self._node_states: dict[str, tuple[str, float]] = {}  # name -> (state, since when, monotonic)
        self._nodes_checked_at = -NODE_CHECK_EVERY_S

    def install_signals(self) -> None:
        def stop(signum: int, frame: object) -> None:
            self.request = self.request or "stop"

        def release(signum: int, frame: object) -> None:
            self.request = "release"

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGUSR1, release)

    def run(self) -> str:
        """Supervise until a stop or a release is asked for; returns which."""
        while self.request is None:
            try:
                self.tick(time.monotonic())
            except Exception:  # a full disk, a bug: keep supervising what still runs
                log.exception("supervisor: a check failed; going on")
            time.sleep(POLL_S)
        return self.request

    def tick(self, now: float) -> None:
        changed = False
        bus_up: bool | None = None
        for child in self.children:
            if self.request is not None:
                break  # a signal landed: act on it, restart nothing more
            if child.proc is not None:
                rc = child.proc.poll()
                if rc is not None:
                    child.proc = None
                    changed |= self._exited(child, rc, now)
            elif child.due_at is not None and now >= child.due_at:
                bus_up = self._bus_up() if bus_up is None else bus_up
                state, state_for_s = self._node_state(child.info.name, now) if child.info.role == "agent" \
                    else ("absent", 0.0)
                hold = restart_hold(child.info.role, bus_up=bus_up, node_state=state, state_for_s=state_for_s,
                                    waited_s=now - child.exited_at)
                if hold is not None:
                    if hold != child.held:
                        log.info("%s: restart held %s", _what(child.info), hold)
                        child.held = hold
                    continue
                changed |= self._restart(child, now)
        if changed:
            write_cluster(self.root, self.cluster)

    def _exited(self, child: Child, rc: int, now: float) -> bool:
        info = child.info
        if not failed(rc):
            log.warning("%s (pid %d) stopped (%s); it was stopped, not crashed: not restarting it",
                        _what(info), info.pid, describe_exit(rc))
            return False
        delay, child.streak = self.policy.decide(child.failures, now, ran_s=now - child.started_at,
                                                 streak=child.streak)
        child.failures.append(now)
        if delay is None:
            info.given_up = True
            log.error("%s (pid %d) died (%s): crash loop, %d failures within %g s; not restarting it "
                      "(see %s; 'revenant down' then 'revenant up' starts it again)", _what(info), info.pid,
                      describe_exit(rc), len(child.failures), self.policy.window_s, info.log)
            return True
        child.exited_at, child.due_at, child.held = now, now + delay, ""
        log.warning("%s (pid %d) died (%s); restart %d in %.1f s", _what(info), info.pid, describe_exit(rc),
                    info.restarts + 1, delay)
        return False

    def _restart(self, child: Child, now: float) -> bool:
        info = child.info
        child.due_at, child.started_at = None, now
        try:
            proc, fresh = spawn(info.role, info.name, info.argv, Path(info.log))
        except OSError as exc:
            log.error("%s: cannot start it again: %s", _what(info), exc)
            return self._exited(child, 127, now)
        child.proc = proc
        info.pid, info.create_time = fresh.pid, fresh.create_time
        info.restarts += 1
        log.warning("%s restarted: pid %d (restart %d)", _what(info), info.pid, info.restarts)
        return True

    def _bus_up(self) -> bool:
        """Whether NATS accepts TCP connections (the URL's first server that does)."""
        for server in self.cluster.nats_url.split(","):
            parts = urlsplit(server.strip() if "://" in server else f"nats://{server.strip()}")
            try:
                with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=0.5):
                    return True
            except OSError:
                continue
        return False

    def _node_state(self, name: str, now: float) -> tuple[str, float]:
        """The coordinator's word on node ``name``: its state, and for how long (seconds)."""
        if now - self._nodes_checked_at >= NODE_CHECK_EVERY_S:
            self._nodes_checked_at = now
            try:
                reply = asyncio.run(nodes(self.cluster.nats_url, self.cluster.creds, 1.0))
                self._node_states = {n.name: (n.state, now - n.state_since_age_s) for n in reply.nodes}
            except (RevenantError, MessageError, OSError):
                self._node_states = {child.info.name: ("unknown", now) for child in self.children}
        state, since = self._node_states.get(name, ("absent", now))
        return state, now - since


# ------------------------------------------------------------------ entry points

def log_to(root: Path, *, echo: bool) -> None:
    """Supervisor lines go to DIR/logs/supervisor.log, and with ``echo`` to stderr too."""
    log.setLevel(logging.INFO)
    log.propagate = False
    path = root / "logs" / "supervisor.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler: logging.Handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [supervisor] %(message)s"))
    log.handlers = [handler]
    if echo:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("revenant: %(message)s"))
        log.addHandler(stream)


def supervise_until_stopped(root: Path, cluster: ClusterFile, procs: dict[str, subprocess.Popen[bytes]]) -> int:
    """Restart what dies until SIGTERM/SIGINT (then stop everything, in STOP_ORDER) or
    SIGUSR1 (``revenant down``: exit at once, leaving the stopping to it)."""
    sup = Supervisor(root, cluster, procs)
    sup.install_signals()
    log.info("supervising %s (pid %d)", ", ".join(_what(c.info) for c in sup.children), os.getpid())
    if sup.run() == "release":
        log.info("'revenant down' is stopping the cluster; supervisor exiting")
        return 0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
    log.info("stopping the cluster (%s)", " -> ".join(STOP_ORDER))
    killed = stop_processes(cluster.processes, timeout_s=30.0)
    if cluster.netns is not None:
        netns.remove(cluster.netns)
    cluster_file(root).unlink(missing_ok=True)
    log.info("cluster stopped%s", f" (killed after 30 s: {', '.join(killed)})" if killed else "")
    return 0


def supervise(directory: str, shape: Shape, *, timeout_s: float, ready_fd: int | None) -> int:
    """``revenant supervise DIR`` (what ``up --detach`` leaves running): start the cluster,
    tell ``up`` through ``ready_fd`` how that went, then supervise it."""
    root = Path(directory).resolve()
    log_to(root, echo=False)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    report: dict[str, str] = {}
    try:
        refuse_running(root)
        check_nats_servers(root, shape.nats_servers, shape.external_nats)
        if shape.insecure:
            log.warning("%s", INSECURE_WARNING)
        cluster, procs = start_cluster(root, shape, timeout_s=timeout_s)
        report = {"nats_url": cluster.nats_url}
    except RevenantError as exc:
        report = {"error": str(exc)}
    except KeyboardInterrupt:  # up was interrupted, or 'revenant down' came during the start
        report = {"error": "interrupted while starting"}
    finally:
        if ready_fd is not None:
            try:
                os.write(ready_fd, json.dumps(report).encode())
                os.close(ready_fd)
            except OSError:
                pass  # up is gone: nobody to tell
    if "error" in report:
        log.error("the cluster did not start: %s", report["error"])
        return 1
    return supervise_until_stopped(root, cluster, procs)
