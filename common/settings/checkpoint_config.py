"""``[checkpoint]``: the cluster's defaults for every job's checkpoints, and the scheduler guide's
spellings of its options (``CRIU_Incremental = YES``), which a revenant.toml may use as well.

:mod:`revenant.common.settings.config` reads the file and re-exports :class:`CheckpointConfig` and
:data:`GUIDE_NAMES`; what is here is the section's own rules.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from revenant.common.errors import ConfigError
from revenant.common.settings.limits import POLICY_RANGES, policy_problem
from revenant.messages import CheckpointPolicy, SubmitRequest


class CheckpointConfig(CheckpointPolicy, kw_only=True, forbid_unknown_fields=True):
    """``[checkpoint]``: the cluster's defaults for every job's checkpoints (a job's policy, whose
    fields and defaults it takes, and ``max_epochs``), which a submit may override per job.  The
    scheduler guide's spellings (``CRIU_Incremental = YES``) are read as well (:data:`GUIDE_NAMES`)."""

    max_epochs: int = 1

    def __post_init__(self) -> None:
        for name in POLICY_RANGES:
            problem = policy_problem(name, getattr(self, name))
            if problem:
                raise ValueError(problem)

    def policy(self, req: SubmitRequest | None = None) -> CheckpointPolicy:
        """A job's effective policy: these defaults, with what ``req`` overrides (None: the default)."""
        values = {name: getattr(self, name) for name in CheckpointPolicy.__struct_fields__}
        for name in values:
            given = getattr(req, name, None)
            if given is not None:
                values[name] = given
        return CheckpointPolicy(**values)

    def max_epochs_for(self, req: SubmitRequest) -> int:
        return self.max_epochs if req.max_epochs is None else req.max_epochs


# The scheduler guide's spelling of each [checkpoint] option (matched without regard to case).
GUIDE_NAMES = {
    "CRIU_MaxEpochs": "max_epochs", "CRIU_Incremental": "incremental", "CRIU_FullEvery": "full_every",
    "CRIU_PreDump": "pre_dump", "CRIU_PreDumpDelay": "pre_dump_delay_s", "CRIU_LoadAware": "load_aware",
    "CRIU_LoadThresholdCPU": "load_threshold_cpu", "CRIU_LoadThresholdIO": "load_threshold_io",
    "CRIU_LoadThresholdMemory": "load_threshold_memory",
}
_GUIDE_KEYS = {k.lower(): v for k, v in GUIDE_NAMES.items()}
# The guide writes its switches YES and NO, bare; TOML would refuse them unquoted.
_BARE_YES_NO = re.compile(r"^(\s*CRIU_\w+\s*=\s*)(yes|no)(\s*(?:#.*)?)$", re.I | re.M)
# Its examples start with the plug-in's name, bare too: revenant is that plug-in, so the line is
# read and, naming criu, has nothing more to say.
_CHECKPOINT_TYPE = "checkpointtype"
_BARE_TYPE = re.compile(r"^(\s*CheckpointType\s*=\s*)([\w/.-]+)(\s*(?:#.*)?)$", re.I | re.M)


def bare_guide_values(text: str) -> str:
    """A TOML file's text with the guide's bare values (``CRIU_PreDump = YES``, ``CheckpointType =
    checkpoint/criu``) quoted, so that TOML reads them."""
    return _BARE_TYPE.sub(r'\1"\2"\3', _BARE_YES_NO.sub(r'\1"\2"\3', text))


def guide_spellings(section: str, values: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """[checkpoint]'s values with the guide's spellings read as revenant's keys; an option given
    both ways is an error, and so is a guide option outside the section."""
    stray = [k for k in doc if k.lower() in _GUIDE_KEYS or k.lower() == _CHECKPOINT_TYPE]
    if stray:
        raise ConfigError(f"{stray[0]} must be in the [{section}] section (put a [{section}] line above it)")
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        if key.lower() == _CHECKPOINT_TYPE:
            if value != "checkpoint/criu":
                raise ConfigError(f"[{section}] {key} = {value!r}: revenant checkpoints with criu only "
                                  "(checkpoint/criu)")
            continue
        name = _GUIDE_KEYS.get(key.lower(), key)
        if name in given:
            raise ConfigError(f"[{section}] {name} is given twice, as {given[name]} and as {key}: keep one")
        given[name] = key
        out[name] = value
    return out


def yes_no(cls: type[msgspec.Struct], values: dict[str, Any]) -> dict[str, Any]:
    """[checkpoint]'s switches may be written YES or NO (as the guide does), in the file or the environment."""
    switches = {f.name for f in msgspec.structs.fields(cls) if f.type is bool}
    return {k: (v.strip().lower() == "yes") if k in switches and isinstance(v, str)
            and v.strip().lower() in ("yes", "no") else v for k, v in values.items()}
