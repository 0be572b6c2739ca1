"""What a client that speaks the NATS protocol itself needs: which URLs it can reach without TLS,
and its CONNECT, with the server's nonce signed by the credential (the heartbeat subscriber,
rawsub.py; one-shot requests, oneshot.py)."""

from __future__ import annotations

import base64
import urllib.parse

from revenant.common.errors import BusError


def plain_urls(url: str) -> bool:
    """Whether every server of ``url`` is reached without TLS (what :class:`RawSubscriber` speaks)."""
    return all(urllib.parse.urlsplit(u.strip() if "://" in u else f"nats://{u.strip()}").scheme == "nats"
               for u in url.split(",") if u.strip())


def _credential(path: str) -> tuple[str | None, bytes]:
    """(a JWT or None, the seed) from a seed file or a JWT ``.creds`` file."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise BusError(f"cannot read the NATS credential {path}: {exc.strerror or exc}") from None
    jwt, seed = None, b""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if b"BEGIN NATS USER JWT" in line and i + 1 < len(lines):
            jwt = lines[i + 1].decode()
        elif line.startswith(b"SU") and not seed:
            seed = line
    if not seed:
        raise BusError(f"the NATS credential {path} holds no user seed")
    return jwt, seed


def signed_connect(info: dict, name: str, creds: str | None, *, headers: bool = False) -> dict:
    """The CONNECT of a client that is not nats-py: ``creds`` (a seed or a JWT .creds file; None:
    none) signs the server's nonce from its INFO.  ``headers``: it reads header frames (a
    no-responders status comes as one)."""
    connect = {"verbose": False, "pedantic": False, "protocol": 1, "lang": "python", "version": "revenant",
               "name": name, "headers": headers, "no_responders": headers, "echo": False}
    if creds:
        jwt, seed = _credential(creds)
        import nkeys  # a signing library: only where a credential is given

        try:
            kp = nkeys.from_seed(bytearray(seed))
            sig = kp.sign(info.get("nonce", "").encode())
            public = kp.public_key.decode()
        except (nkeys.NkeysError, ValueError) as exc:
            raise BusError(f"the NATS credential {creds} is not a valid seed: {exc}") from None
        connect["sig"] = base64.urlsafe_b64encode(sig).rstrip(b"=").decode()
        if jwt:
            connect["jwt"] = jwt
        else:
            connect["nkey"] = public
    return connect


def refused(url: str, creds: str | None, said: str) -> BusError:
    """The one-line error for a server that refused the connection (``said``: its words): a wrong
    or unknown key stays wrong, so it is not retriable."""
    why = f"the key {creds} is not one it knows" if creds else "it wants a credential"
    return BusError(f"NATS at {url} refused the connection ({said}): {why}", code="refused", retriable=False)
