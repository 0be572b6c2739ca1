"""What the liveness connection's faster pings cost a nats-server.

Each agent's liveness connection pings its server every ``liveness_ping_interval_s`` (0.5 s;
2.0 s before), so that a server cut off without a reset is left within 1 to 1.5 s.  This opens
``--clients`` raw client connections to one nats-server (CONNECT, then PING every INTERVAL and
read the PONGs, as the NATS client does) and measures the server's CPU over ``--seconds`` for
each interval, alternating, in one run.  Prints a table and writes bench/results/ping_cost.json.

    .venv/bin/python bench/ping_cost.py --clients 2000 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import psutil

# bench/ is not a package: its modules import their siblings by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cpu_s, machine, text_table, write_json  # noqa: E402
from revenant.common.messaging.natsserver import start_nats_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ping_cost.json"


async def client(host: str, port: int, interval: float, stop: asyncio.Event, pongs: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    await reader.readline()  # INFO
    writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
    await asyncio.sleep(interval * (hash(id(writer)) % 1000) / 1000)  # spread over the interval
    while not stop.is_set():
        writer.write(b"PING\r\n")
        await writer.drain()
        line = await reader.readline()
        if line.startswith(b"PONG"):
            pongs[0] += 1
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    writer.close()


async def measure(url: str, server: psutil.Process, clients: int, interval: float, seconds: float) -> dict:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    stop, pongs = asyncio.Event(), [0]
    tasks = [asyncio.create_task(client(host, int(port), interval, stop, pongs)) for _ in range(clients)]
    await asyncio.sleep(interval + 1.0)  # all connected, pinging
    before, start, counted = cpu_s(server), time.monotonic(), pongs[0]
    await asyncio.sleep(seconds)
    used, took, answered = cpu_s(server) - before, time.monotonic() - start, pongs[0] - counted
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"interval_s": interval, "clients": clients, "server_cpu_pct": round(100 * used / took, 2),
            "pings_per_s": round(answered / took, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rv-ping-") as tmp:
        server = start_nats_server(Path(tmp) / "nats", log_file=Path(tmp) / "nats.log")
        try:
            proc = psutil.Process(server.pid)
            rows = []
            for _ in range(args.rounds):
                for interval in (2.0, 0.5):
                    rows.append(asyncio.run(measure(server.url, proc, args.clients, interval, args.seconds)))
        finally:
            server.stop()
    print(text_table(["ping every s", "clients", "pings/s", "server CPU %"],
                     [[f"{r['interval_s']:g}", str(r["clients"]), f"{r['pings_per_s']:.0f}",
                       f"{r['server_cpu_pct']:.2f}"] for r in rows]))
    write_json(RESULTS, {"machine": machine(), "runs": rows})
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
