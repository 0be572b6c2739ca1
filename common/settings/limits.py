"""What a job may carry, checked before anything happens: by the CLI, and again by the
coordinator (any client may speak the protocol).

A job's record is stored in the job table and sent whole in replies (``submit``, ``show job``,
a page of ``jobs``), and every message is at most ``MAX_MESSAGE_BYTES`` (256 KiB).  So a job
whose command line and environment could not fit is refused at submit, with one line naming
the limit, instead of being started and then being impossible to report.  What else grows
in a record is bounded too: at most ``MAX_EPOCHS`` epochs (about 170 bytes each), a path and
a reason; ``MAX_SPEC_BYTES`` leaves room for them.
"""

from __future__ import annotations

import math
import re

import msgspec

from revenant.common.errors import RevenantError
from revenant.messages import (CONNECTIONS, MAX_MESSAGE_BYTES, ON_SICK, PACK_COMPRESSION, CheckpointPolicy, JobSpec,
                               SubmitRequest)

# The job's spec (command line, environment, name, working directory) as stored, encoded.
MAX_SPEC_BYTES = 128 * 1024
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Checkpoints kept per job (--max-epochs): each is a full image on storage and a row in the record.
MAX_EPOCHS = 100
# --checkpoint: at least a second, at most a year (longer is "never": leave --checkpoint out).
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 365 * 86400.0
# --full-every: a segment of at most this many epochs; --pre-dump-delay: at most an hour.
MAX_FULL_EVERY = 1000
MAX_PRE_DUMP_DELAY_S = 3600.0
# A job's checkpoint options: name -> (lowest, highest, whole number).  The same bounds hold for
# the cluster's [checkpoint] section at start-up and for a submit's overrides.
POLICY_RANGES: dict[str, tuple[float, float, bool]] = {
    "max_epochs": (1, MAX_EPOCHS, True),
    "full_every": (1, MAX_FULL_EVERY, True),
    "pre_dump_delay_s": (0.0, MAX_PRE_DUMP_DELAY_S, False),
    "load_threshold_cpu": (0.0, 1.0, False),
    "load_threshold_io": (0.0, 1.0, False),
    "load_threshold_memory": (0.0, 1.0, False),
}
# The submit's flag for each option it may override (the thresholds are the cluster's).
POLICY_FLAGS = {"full_every": "--full-every", "pre_dump_delay_s": "--pre-dump-delay"}
# A job's environment variable: a shell identifier (agent/running/launcher.py writes them as `export` lines).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables that the dynamic loader, libc or a shell act on before (or besides) the job's own
# code: never passed to a job, whoever it runs as (``LD_*`` and exported shell functions by prefix).
REFUSED_ENV_PREFIXES = ("LD_", "BASH_FUNC_")
REFUSED_ENV = frozenset({
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "CDPATH", "GLOBIGNORE", "PROMPT_COMMAND",
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_CHECK_",
    "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR"})
# ... and, for a job that runs as root, what an interpreter or runtime acts on as it starts.
ROOT_REFUSED_ENV = frozenset({
    "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONBREAKPOINT",
    "PERL5LIB", "PERL5OPT", "PERLLIB", "PERL5DB", "RUBYLIB", "RUBYOPT", "NODE_OPTIONS", "NODE_PATH",
    "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "TCLLIBPATH", "LUA_INIT", "LUA_PATH", "LUA_CPATH",
    "GIT_CONFIG_GLOBAL", "GIT_EXEC_PATH", "PAGER", "EDITOR", "VISUAL"})
ROOT_USERS = ("", "root")
# The longest job id the spec is measured with (ids are decimal counters).
_ID_ROOM = "9" * 20

_encoder = msgspec.msgpack.Encoder()


class BadRequest(RevenantError):
    code = "bad_request"


class LimitExceeded(BadRequest):
    code = "too_large"


def default_name(argv: list[str]) -> str:
    return argv[0].rsplit("/", 1)[-1] if argv else ""


def spec_bytes(req: SubmitRequest) -> int:
    """The size of the spec the coordinator would store for ``req``."""
    spec = JobSpec(id=_ID_ROOM, argv=req.argv, name=req.name or default_name(req.argv), workdir=req.workdir,
                   env=req.env, checkpoint_interval_s=req.checkpoint_interval_s, max_epochs=MAX_EPOCHS,
                   requeue=req.requeue, policy=CheckpointPolicy(), request_id=req.request_id)
    try:
        return len(_encoder.encode(spec))
    except (OverflowError, TypeError, ValueError) as exc:  # an integer past 64 bits, a bad value
        raise BadRequest(f"invalid submit request: {exc}") from None


def check_range(flag: str, value: float, lowest: float, highest: float) -> None:
    """One line naming the flag and its bounds unless ``lowest <= value <= highest``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{flag} must be a finite number, got {value}")
    if value < lowest:
        raise BadRequest(f"{flag} must be at least {lowest:g}, got {value}")
    if value > highest:
        raise BadRequest(f"{flag} must be at most {highest:g}, got {value}")


def policy_problem(name: str, value: object, shown: str | None = None) -> str | None:
    """One line naming the option (as ``shown``) and its accepted range, unless ``value`` is in
    the range :data:`POLICY_RANGES` gives ``name``."""
    lowest, highest, whole = POLICY_RANGES[name]
    kind = "a whole number" if whole else "a number"
    ok_type = isinstance(value, int) if whole else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool) or not lowest <= value <= highest:  # type: ignore[operator]
        return f"{shown or name} must be {kind} from {lowest:g} to {highest:g}, got {value!r}"
    return None


def env_problem(name: str, value: str, root: bool) -> str | None:
    """Why the variable ``name=value`` may not be in a job's environment (``root``: the job runs as
    root), or None."""
    shown = name[:80]
    if not ENV_NAME.fullmatch(name):
        return f"environment variable {shown!r}: a name is letters, digits and '_', not starting with a digit"
    if "\0" in value:
        return f"environment variable {shown}: its value holds a NUL byte"
    if name.startswith(REFUSED_ENV_PREFIXES) or name in REFUSED_ENV:
        return f"environment variable {shown} is refused: the dynamic loader or a shell acts on it"
    if root and name in ROOT_REFUSED_ENV:
        return f"environment variable {shown} is refused for a job that runs as root: an interpreter acts on it"
    return None


def check_env(env: dict[str, str], root: bool) -> None:
    """:class:`BadRequest` naming the first variable of ``env`` a job may not get (:func:`env_problem`)."""
    for name, value in env.items():
        if (problem := env_problem(name, value, root)) is not None:
            raise BadRequest(problem)


def check_submit(req: SubmitRequest, user: str | None = None) -> None:
    """Raise :class:`BadRequest` (one line, naming the limit) unless ``req`` can become a job
    whose record can be stored and replied to, and whose environment a job of ``user`` (default:
    ``req.user``; "" or "root": root's) may get."""
    if not req.argv:
        raise BadRequest("nothing to run: give a command after --")
    check_env(req.env, (req.user if user is None else user) in ROOT_USERS)
    for what, values in (("the command line", req.argv), ("the working directory", [req.workdir]),
                         ("the job's name", [req.name])):
        if any("\0" in v for v in values):
            raise BadRequest(f"{what} holds a NUL byte")
    if req.max_epochs is not None:  # None: the cluster's default
        if not isinstance(req.max_epochs, int) or isinstance(req.max_epochs, bool):
            raise BadRequest(f"--max-epochs must be a whole number, got {req.max_epochs!r}")
        check_range("--max-epochs", req.max_epochs, 1, MAX_EPOCHS)
    for name, flag in POLICY_FLAGS.items():
        value = getattr(req, name)
        if value is not None and (problem := policy_problem(name, value, flag)):
            raise BadRequest(problem)
    if req.request_id and not REQUEST_ID.fullmatch(req.request_id):
        raise BadRequest(f"a submit's request id is 1 to 64 letters, digits, '-' or '_', got {req.request_id[:80]!r}")
    if req.on_sick and req.on_sick not in ON_SICK:
        raise BadRequest(f"--on-sick must be one of {', '.join(ON_SICK)}, got {req.on_sick!r}")
    if req.connections is not None and req.connections not in CONNECTIONS:
        raise BadRequest(f"--connections must be one of {', '.join(CONNECTIONS)}, got {req.connections!r}")
    if req.pack_compression is not None and req.pack_compression not in PACK_COMPRESSION:
        raise BadRequest(f"--pack-compression must be one of {', '.join(PACK_COMPRESSION)}, got "
                         f"{req.pack_compression!r}")
    check_asked(req.cpus, req.memory_bytes, req.gpus)
    every = req.checkpoint_interval_s
    if every is not None and not (math.isfinite(every) and MIN_INTERVAL_S <= every <= MAX_INTERVAL_S):
        raise BadRequest(f"the checkpoint interval must be from {MIN_INTERVAL_S:g} s to "
                         f"{MAX_INTERVAL_S / 86400:g} days, got {every:g} s")
    size = spec_bytes(req)
    if size > MAX_SPEC_BYTES:
        raise LimitExceeded(
            f"the job's command line and environment take {size:,} bytes; the limit is {MAX_SPEC_BYTES:,} bytes "
            f"({MAX_SPEC_BYTES // 1024} KiB, so that its record fits one {MAX_MESSAGE_BYTES // 1024} KiB message): "
            "pass large inputs in a file")


# What a job may ask of its node: past these it is a typo, not a machine.
MAX_CPUS = 1 << 16
MAX_GPUS = 1024
MAX_MEMORY = 1 << 60
# The most processes a job limit may name (the kernel's own ceiling, PID_MAX_LIMIT).
MAX_PIDS = 1 << 22


def check_asked(cpus: float | None, memory_bytes: int | None, gpus: int | None) -> None:
    """Refuse (one line) an asked amount that is no amount (None: not asked)."""
    if cpus is not None and (isinstance(cpus, bool) or not (math.isfinite(cpus) and 0 <= cpus <= MAX_CPUS)):
        raise BadRequest(f"--cpus must be a number from 0 to {MAX_CPUS}, got {cpus!r}")
    if memory_bytes is not None and (isinstance(memory_bytes, bool) or not 0 <= memory_bytes <= MAX_MEMORY):
        raise BadRequest(f"--mem must be from 0 bytes to 1 EiB, got {memory_bytes!r}")
    if gpus is not None and (isinstance(gpus, bool) or not 0 <= gpus <= MAX_GPUS):
        raise BadRequest(f"--gpus must be a whole number from 0 to {MAX_GPUS}, got {gpus!r}")


# The longest a cancel's signal may take to end a job before SIGKILL.
MAX_GRACE_S = 3600.0


def parse_signal(text: str) -> int:
    """A signal as kill(1) takes it: a name with or without SIG, any case (TERM, SIGUSR1, rtmin+2),
    or a number; anything else is a :class:`BadRequest` that names it."""
    import signal

    given = text.strip()
    if given.isdigit():
        if 1 <= int(given) <= signal.SIGRTMAX:
            return int(given)
    else:
        name = given.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        rt = re.fullmatch(r"SIGRT(MIN|MAX)([+-]\d+)?", name)
        if rt:
            n = (signal.SIGRTMIN if rt[1] == "MIN" else signal.SIGRTMAX) + int(rt[2] or 0)
            if signal.SIGRTMIN <= n <= signal.SIGRTMAX:
                return n
        elif name in signal.Signals.__members__:
            return int(signal.Signals[name])
    raise BadRequest(f"unknown signal {text!r}: give a name as kill -l lists them (TERM, USR1, SIGINT) or a "
                     f"number from 1 to {int(signal.SIGRTMAX)}")


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signum > signal.SIGRTMIN else f"signal {signum}"
