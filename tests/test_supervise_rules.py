"""The supervisor's rules (cli/cluster/supervise.py), without processes: which exits are restarted, the
backoff and the crash-loop cap, the holds, and the argv that pins a port."""

from __future__ import annotations

import signal

import pytest

from revenant.cli.cluster.processes import describe_exit
from revenant.cli.cluster.supervise import AGENT_HOLD_MAX_S, DEAD_FOR_S, RestartPolicy, failed, restart_hold
from revenant.common.messaging.natsserver import pin_option

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rc, restart", [
    (0, False),                   # a clean exit: an agent's drain, a coordinator's stop
    (-signal.SIGTERM, False),     # stopped by an operator (nats-server dies of SIGTERM)
    (-signal.SIGINT, False),
    (1, True),                    # a coordinator that lost its lease, a crash with a traceback
    (-signal.SIGKILL, True),      # kill -9, the OOM killer
    (-signal.SIGSEGV, True),
    (143, True),                  # an exit status, not a signal
])
def test_only_failures_are_restarted(rc, restart):
    assert failed(rc) is restart


def test_exits_are_described_as_an_operator_reads_them():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit status 1"
    assert describe_exit(-200) == "killed by signal 200"


def test_restarts_back_off_then_a_crash_loop_is_given_up():
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=10.0, stable_s=10.0, max_restarts=5, window_s=60.0)
    failures: list[float] = []
    delays = []
    now, streak = 100.0, 0
    for _ in range(5):
        delay, streak = policy.decide(failures, now, ran_s=1.0, streak=streak)
        delays.append(delay)
        failures.append(now)
        now += delay + 1.0  # it ran for a second, then failed again
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert policy.decide(failures, now, ran_s=1.0, streak=streak)[0] is None  # a sixth within a minute
    assert RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, max_restarts=10).decide([], 0.0, ran_s=0.0,
                                                                                    streak=6) == (3.0, 7)


def test_a_process_that_ran_a_while_backs_off_from_the_start_again():
    policy = RestartPolicy(backoff_s=0.5, stable_s=10.0, max_restarts=5, window_s=60.0)
    assert policy.decide([0.0, 20.0], 40.0, ran_s=15.0, streak=2) == (0.5, 1)
    assert policy.decide([0.0, 20.0], 40.0, ran_s=5.0, streak=2) == (2.0, 3)


def test_old_failures_age_out_of_the_window():
    policy = RestartPolicy(max_restarts=5, window_s=60.0)
    failures = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert policy.decide(failures, 30.0, ran_s=26.0, streak=0)[0] is None  # ran long, yet a sixth failure
    # A process that then ran for a minute is not crash-looping.
    assert policy.decide(failures, 64.5, ran_s=60.0, streak=5) == (policy.backoff_s, 1)


def test_nothing_but_nats_server_restarts_while_nats_is_down():
    for role in ("coordinator", "agent"):
        assert restart_hold(role, bus_up=False, node_state="dead", state_for_s=60.0, waited_s=1000.0)
    assert restart_hold("nats-server", bus_up=False, node_state="absent", state_for_s=0.0, waited_s=0.0) is None
    assert restart_hold("coordinator", bus_up=True, node_state="absent", state_for_s=0.0, waited_s=0.0) is None


@pytest.mark.parametrize("state, state_for_s, waited_s, held", [
    ("alive", 5.0, 1.0, True),        # not noticed yet: its death must be seen as one
    ("suspect", 1.0, 2.0, True),
    ("unknown", 0.0, 2.0, True),      # no coordinator answers (it may be restarting too)
    ("dead", 0.1, 3.0, True),         # just declared: let the death be seen a moment
    ("dead", DEAD_FOR_S, 5.0, False),
    ("left", 0.0, 0.5, False),
    ("absent", 0.0, 0.5, False),      # a new coordinator that never heard of the node
    ("alive", 5.0, AGENT_HOLD_MAX_S, False),  # never held for ever
    ("unknown", 0.0, AGENT_HOLD_MAX_S + 1, False),
])
def test_an_agent_waits_for_its_node_to_be_declared_dead(state, state_for_s, waited_s, held):
    hold = restart_hold("agent", bus_up=True, node_state=state, state_for_s=state_for_s, waited_s=waited_s)
    assert (hold is not None) is held


def test_pin_option_names_the_port_that_was_chosen():
    argv = ["nats-server", "--addr", "127.0.0.1", "--port", "-1", "--jetstream"]
    assert pin_option(argv, "--port", "41234") == ["nats-server", "--addr", "127.0.0.1", "--port", "41234",
                                                   "--jetstream"]
    assert argv[4] == "-1"  # the original is left alone
    assert pin_option(["agent", "--node", "n1"], "--http-port", "9") == ["agent", "--node", "n1", "--http-port", "9"]
