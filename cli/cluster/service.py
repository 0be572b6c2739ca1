"""Running a long-lived service (agent or coordinator) in the foreground."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uvloop

from revenant.common.serving import gcpause
from revenant.common.serving.service import Service


def setup_logging(role: str, name: str = "", level: str = "INFO") -> None:
    tag = f"{role} {name}".strip()
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # nats-py logs every reconnect attempt at ERROR; our callbacks already say it once.
    logging.getLogger("nats").setLevel(logging.CRITICAL)


def run_service(service: Service) -> int:
    """Run until SIGTERM or SIGINT, then stop the service gracefully."""
    gcpause.install(freeze=True)  # full collections walk what is new, not the whole heap

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    uvloop.run(main())
    return 0
