"""The address an agent advertises by default: its own, on its route to the first NATS server."""

from __future__ import annotations

import pytest

from revenant.common.messaging.bus import route_address

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("url, want", [
    ("nats://127.0.0.1:4222", "127.0.0.1"),
    ("nats://127.0.0.1:4222,nats://10.9.9.9:4222", "127.0.0.1"),  # the first server's route
    ("127.0.0.1", "127.0.0.1"),  # no scheme, no port
    ("nats://no-such-host.invalid:4222", ""),  # unknown: nothing advertised rather than a guess
])
def test_the_route_address_is_this_hosts_own_toward_the_first_server(url, want):
    assert route_address(url) == want
