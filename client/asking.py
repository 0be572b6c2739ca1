"""Who a client asks the coordinator as, and so on which subject (docs/security.md)."""

from __future__ import annotations

import os
import pwd

from revenant.common.errors import RevenantError
from revenant.common.settings import security
from revenant.messages import subjects


def asking_user(creds: str) -> str | None:
    """The Unix user a client holding ``creds`` ("": none) asks as, or None for admin.

    With a credential, its identity decides: ``admin`` asks as admin, ``user-<name>`` as that
    user (the server lets only that identity publish on ``revenant.user.<name>.<verb>``).
    Without one (an --insecure bus), root asks as admin and anyone else as their login name,
    which nothing checks: the coordinator trusts it."""
    if creds:
        identity = security.identity_of(creds)
        if identity == security.ADMIN:
            return None
        if identity.startswith(security.USER_PREFIX):
            return subjects.check_name(identity[len(security.USER_PREFIX):], "user name")
        raise RevenantError(f"{creds} is {identity}'s credential: a client asks with admin's or a user's")
    if os.geteuid() == 0:
        return None
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        raise RevenantError(f"uid {os.geteuid()} has no user name: the coordinator knows users by name") from None
    return subjects.check_name(name, "user name")


def request_subject(verb: str, creds: str) -> str:
    """Where a client holding ``creds`` asks for ``verb``: admin's subject or its user's."""
    user = asking_user(creds)
    return subjects.coordinator(verb) if user is None else subjects.user_request(user, verb)
