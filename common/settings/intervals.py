"""Checkpoint intervals in the scheduler's six time formats.

=========================  =========  ==============
format                     example    seconds
=========================  =========  ==============
minutes                    30         1800
minutes:seconds            30:00      1800
hours:minutes:seconds      2:30:00    9000
days-hours                 1-0        86400
days-hours:minutes         1-0:30     88200
days-hours:minutes:seconds 1-2:30:00  95400
=========================  =========  ==============
"""

from __future__ import annotations

import re

from revenant.common.errors import RevenantError

_NUM = r"(\d{1,9})"
_FORMATS = [
    (re.compile(rf"^{_NUM}$"), ("m",)),
    (re.compile(rf"^{_NUM}:{_NUM}$"), ("m", "s")),
    (re.compile(rf"^{_NUM}:{_NUM}:{_NUM}$"), ("h", "m", "s")),
    (re.compile(rf"^{_NUM}-{_NUM}$"), ("d", "h")),
    (re.compile(rf"^{_NUM}-{_NUM}:{_NUM}$"), ("d", "h", "m")),
    (re.compile(rf"^{_NUM}-{_NUM}:{_NUM}:{_NUM}$"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# Below this a checkpoint would barely finish before the next began.
MIN_INTERVAL_S = 1


class BadInterval(RevenantError):
    code = "bad_interval"


def parse_interval(text: str) -> int:
    """Seconds in ``text``; raises :class:`BadInterval` naming the accepted formats."""
    value = text.strip()
    for pattern, units in _FORMATS:
        m = pattern.match(value)
        if m:
            parts = [int(g) for g in m.groups()]
            for unit, part in zip(units[1:], parts[1:]):
                limit = 24 if unit == "h" else 60
                if part >= limit and len(units) > 1:
                    raise BadInterval(f"bad checkpoint interval {text!r}: {unit} field {part} must be below {limit}")
            seconds = sum(p * _SECONDS[u] for p, u in zip(parts, units))
            if seconds < MIN_INTERVAL_S:
                raise BadInterval(f"bad checkpoint interval {text!r}: must be at least {MIN_INTERVAL_S} s")
            return seconds
    raise BadInterval(
        f"bad checkpoint interval {text!r}: use minutes, minutes:seconds, hours:minutes:seconds, "
        "days-hours, days-hours:minutes or days-hours:minutes:seconds"
    )


def format_interval(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h}:{m:02d}:{s:02d}"
