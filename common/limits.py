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

import msgspec

from revenant.common.errors import RevenantError
from revenant.messages import MAX_MESSAGE_BYTES, JobSpec, SubmitRequest

# The job's spec (command line, environment, name, working directory) as stored, encoded.
MAX_SPEC_BYTES = 128 * 1024
# Checkpoints kept per job (--max-epochs): each is a full image on storage and a row in the record.
MAX_EPOCHS = 100
# --checkpoint: at least a second, at most a year (longer is "never": leave --checkpoint out).
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 365 * 86400.0
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
                   env=req.env, checkpoint_interval_s=req.checkpoint_interval_s, max_epochs=req.max_epochs,
                   requeue=req.requeue)
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


def check_submit(req: SubmitRequest) -> None:
    """Raise :class:`BadRequest` (one line, naming the limit) unless ``req`` can become a job
    whose record can be stored and replied to."""
    if not req.argv:
        raise BadRequest("nothing to run: give a command after --")
    if not isinstance(req.max_epochs, int) or isinstance(req.max_epochs, bool):
        raise BadRequest(f"--max-epochs must be a whole number, got {req.max_epochs!r}")
    check_range("--max-epochs", req.max_epochs, 1, MAX_EPOCHS)
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

