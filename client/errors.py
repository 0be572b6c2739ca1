"""The one exception the client raises."""

from __future__ import annotations

from revenant.common.errors import RemoteError, RevenantError


class ClientError(RevenantError):
    """What the cluster (or the bus) answered instead: ``code`` is the protocol's
    (``unknown_job``, ``bad_state``, ``busy``, ``forbidden``, ``timeout``...; docs/protocol.md),
    ``retriable`` whether asking again later may succeed, ``remote`` whether the cluster said so
    (rather than the bus, or a check before sending).  Its ``str()`` is one line."""

    # Whether the cluster answered it (an ``error.v1``), rather than the bus or this side failing.
    remote = False

    @classmethod
    def of(cls, exc: RevenantError) -> "ClientError":
        if isinstance(exc, ClientError):
            return exc
        err = cls(str(exc), code=exc.code, retriable=exc.retriable)
        err.remote = isinstance(exc, RemoteError)
        return err
