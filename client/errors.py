"""The one exception the client raises."""

from __future__ import annotations

from revenant.common.errors import RevenantError


class ClientError(RevenantError):
    """What the cluster (or the bus) answered instead: ``code`` is the protocol's
    (``unknown_job``, ``bad_state``, ``busy``, ``forbidden``, ``timeout``...; docs/protocol.md),
    ``retriable`` whether asking again later may succeed.  Its ``str()`` is one line."""

    @classmethod
    def of(cls, exc: RevenantError) -> "ClientError":
        return exc if isinstance(exc, ClientError) else cls(str(exc), code=exc.code, retriable=exc.retriable)
