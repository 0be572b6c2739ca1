"""The command line's parser and checks, fuzzed: whatever the arguments, `revenant` either
accepts them or exits with one line on stderr, never a traceback.  In-process, and stopping
before anything connects (the command itself is replaced by a stub)."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.cli import main as cli
from revenant.cli.client import submit_request
from revenant.messages import SubmitRequest

pytestmark = pytest.mark.unit

COMMANDS = ["agent", "coordinator", "up", "down", "nodes", "submit", "checkpoint", "create", "vacate", "restart",
            "show", "job", "jobs", "purge", "failover", "status", "pause", "resume", "events", "--"]
OPTIONS = ["--max-epochs", "--checkpoint", "--timeout", "--interval", "--nodes", "--node", "--name", "--workdir",
           "--requeue", "--json", "--watch", "--follow", "--dir", "--nats", "--http-port", "--heartbeat-interval",
           "--node-timeout", "--suspect-timeout", "--config", "--log-level", "-h", "-", "-w", "-f",
           "--incremental", "--no-incremental", "--full-every", "--pre-dump", "--no-pre-dump", "--pre-dump-delay",
           "--load-aware", "--no-load-aware", "--epoch"]
NUMBERS = ["0", "-1", "1", "100", "101", "1e999", "-1e999", "nan", "inf", "-inf", "1e308", "0.0001",
           "99999999999999999999", "-99999999999999999999", "18446744073709551616", "9" * 5000, "0x10", "1_000",
           "30:00", "1-0", "999999999-23:59:59", "99:99", ""]
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
TOKEN = st.one_of(st.sampled_from(COMMANDS), st.sampled_from(OPTIONS), st.sampled_from(NUMBERS), TEXT,
                  st.integers().map(str), st.floats().map(str))
ARGV = st.one_of(
    st.lists(TOKEN, max_size=8),
    # A real command first, so that the fuzz gets past the first choice most of the time.
    st.tuples(st.sampled_from(["submit", "nodes", "jobs", "events", "up", "down", "failover", "agent",
                               "coordinator", "show job", "job purge", "checkpoint create", "checkpoint restart"]),
              st.lists(TOKEN, max_size=8)).map(lambda t: t[0].split() + t[1]),
)


def run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with the command replaced by a stub: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name in dir(cli):
            if name.startswith("_cmd_"):
                mp.setattr(cli, name, lambda args: 0)
        try:
            status = cli.main(argv)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
    return status, out.getvalue(), err.getvalue()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ARGV)
def test_no_argv_gives_a_traceback(argv):
    status, out, err = run(argv)
    assert "Traceback" not in out + err
    if status == 0:
        assert err == ""
    else:
        assert status == 2, (argv, status, err)
        assert len(err.splitlines()) == 1 and err.startswith("revenant: "), (argv, err)


@pytest.mark.parametrize("argv, message", [
    (["submit", "--max-epochs", "99999999999999999999", "--", "true"],
     "revenant: --max-epochs must be at most 100, got 99999999999999999999"),
    (["submit", "--max-epochs", "0", "--", "true"], "--max-epochs must be at least 1, got 0"),
    (["submit", "--checkpoint", "999999999-0", "--", "true"], "checkpoint interval must be from 1 s to 365 days"),
    (["submit", "--", "true", *["x" * 100_000] * 2], "the limit is 131,072 bytes (128 KiB"),
    (["submit", "--node", "a\nb", "--", "true"], "invalid node name 'a\\nb'"),
    (["submit"], "nothing to run"),
    (["jobs", "--timeout", "nan"], "--timeout must be a finite number, got nan"),
    (["jobs", "--timeout", "0"], "--timeout must be at least 0.001, got 0.0"),
    (["nodes", "--watch", "--interval", "1e999"], "--interval must be a finite number"),
    (["up", "--dir", "/x", "--nodes", "0"], "--nodes must be at least 1"),
    (["agent", "--heartbeat-interval", "inf"], "--heartbeat-interval must be a finite number"),
    (["submit", "--max-epochs", "x"], "argument --max-epochs: invalid int value: 'x'"),
    (["submit", "--full-every", "0", "--", "true"], "--full-every must be a whole number from 1 to 1000, got 0"),
    (["submit", "--incremental", "--full-every", "1001", "--", "true"], "--full-every must be a whole number from 1 "
                                                                       "to 1000, got 1001"),
    (["submit", "--pre-dump", "--pre-dump-delay", "-1", "--", "true"],
     "--pre-dump-delay must be a number from 0 to 3600, got -1.0"),
    (["submit", "--pre-dump-delay", "nan", "--", "true"], "--pre-dump-delay must be a number from 0 to 3600, got nan"),
    (["submit", "--full-every", "2.5", "--", "true"], "argument --full-every: invalid int value: '2.5'"),
    (["submit", "--incremental=yes", "--", "true"], "ignored explicit argument 'yes'"),
    (["checkpoint", "restart", "7", "--epoch", "0"], "--epoch must be at least 1, got 0"),
    (["checkpoint", "restart", "7", "--epoch", "99999999999999999999"], "--epoch must be at most"),
    (["checkpoint", "create", "7", "--epoch", "2"], "unrecognized arguments: --epoch 2"),
    (["nodes", "extra\nline"], "unrecognized arguments: extra\\nline"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_argument_errors_are_one_line_naming_the_problem(argv, message):
    status, _, err = run(argv)
    assert status == 2 and len(err.splitlines()) == 1 and message in err, err


def _submitted(argv: list[str]) -> SubmitRequest:
    return submit_request(cli.build_parser().parse_args(["submit", *argv, "--", "true"]))


def test_submit_carries_each_policy_override_and_leaves_the_rest_to_the_cluster():
    plain = _submitted([])
    assert (plain.max_epochs, plain.incremental, plain.full_every, plain.pre_dump, plain.pre_dump_delay_s,
            plain.load_aware) == (None,) * 6
    every = _submitted(["--max-epochs", "3", "--incremental", "--full-every", "4", "--pre-dump",
                        "--pre-dump-delay", "2.5", "--load-aware"])
    assert (every.max_epochs, every.incremental, every.full_every, every.pre_dump, every.pre_dump_delay_s,
            every.load_aware) == (3, True, 4, True, 2.5, True)
    off = _submitted(["--no-incremental", "--no-pre-dump", "--no-load-aware"])
    assert (off.incremental, off.pre_dump, off.load_aware) == (False, False, False)


def test_restart_takes_an_epoch():
    args = cli.parse_args(["checkpoint", "restart", "7", "--epoch", "3"])
    assert (args.verb, args.job, args.epoch) == ("restart", "7", 3)
    assert cli.parse_args(["checkpoint", "restart", "7"]).epoch is None


def test_good_arguments_reach_the_command():
    assert run(["submit", "--max-epochs", "100", "--checkpoint", "30:00", "--", "python3", "train.py"])[0] == 0
    assert run(["jobs", "--json", "--timeout", "604800"])[0] == 0
    assert run(["submit", "--incremental", "--full-every", "1000", "--pre-dump", "--pre-dump-delay", "0",
                "--load-aware", "--", "true"])[0] == 0
    assert run(["checkpoint", "restart", "7", "--epoch", "2", "--node", "node-1"])[0] == 0
    assert run(["nodes", "--help"])[0] == 0
