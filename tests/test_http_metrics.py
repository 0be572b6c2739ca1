"""The HTTP server, the Prometheus metrics and the health endpoints, over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from revenant.common.serving.httpserver import HttpServer, HttpServerError, parse_request_line
from revenant.common.serving.metrics import (
    CONTENT_TYPE,
    AgentMetrics,
    CoordinatorMetrics,
    health_routes,
    live_response,
    ready_response,
)
from revenant.messages import GpuHealth, GpuProcess, HealthSummary, NodeEvent, NodeStatus

pytestmark = pytest.mark.unit


async def request(server: HttpServer, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # the server closes after one response
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


async def get(server: HttpServer, path: str, method: str = "GET"):
    return await request(server, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Node:
    """What an agent would wire up: metrics, a summary, a loop monitor's verdict."""

    def __init__(self) -> None:
        self.metrics = AgentMetrics()
        self.summary = HealthSummary()
        self.stuck_s = 0.0

    def routes(self):
        return health_routes(render_metrics=self.metrics.render, summary=lambda: self.summary,
                             stuck_for=lambda: self.stuck_s, stuck_after_s=5.0,
                             extra=lambda: {"node": "n1"})


@pytest.fixture
async def node():
    n = Node()
    async with HttpServer(n.routes()) as server:
        n.server = server
        yield n


# ------------------------------------------------------------------ endpoints


async def test_port_zero_binds_loopback_and_reports_its_url(node):
    assert node.server.host == "127.0.0.1" and node.server.port > 0
    assert node.server.url == f"http://127.0.0.1:{node.server.port}"


async def test_metrics_endpoint_serves_prometheus_text(node):
    node.metrics.update_health(HealthSummary(state="YELLOW", loop_lag_s=0.3, loop_stalls=2, memory_percent=86.0,
                                             storage_free_bytes=123, gpus=[GpuHealth(index=0, temperature_c=61)]))
    status, headers, body = await get(node.server, "/metrics?name[]=x")
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE
    got = samples(body)
    assert got[("revenant_node_health_state", ())] == 1
    assert got[("revenant_event_loop_lag_seconds", ())] == 0.3
    assert got[("revenant_event_loop_stalls_total", ())] == 2
    assert got[("revenant_memory_usage_ratio", ())] == 0.86
    assert got[("revenant_gpu_temperature_celsius", (("gpu", "0"),))] == 61
    assert int(headers["Content-Length"]) == len(body)


async def test_health_is_json_with_every_probe(node):
    node.summary = HealthSummary(state="RED", reasons=["criu unusable: x"], criu_ok=False, pending_ops=3,
                                 gpus=[GpuHealth(index=0, temperature_c=50)])
    status, headers, body = await get(node.server, "/health")
    doc = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert (doc["state"], doc["reasons"], doc["node"]) == ("RED", ["criu unusable: x"], "n1")
    assert doc["probes"]["criu_ok"] is False and doc["probes"]["pending_ops"] == 3
    assert doc["probes"]["gpus"][0]["temperature_c"] == 50
    assert set(doc["probes"]) >= {"loop_lag_s", "loop_stalls", "memory_percent", "storage_free_bytes",
                                  "nats_connected", "checkpoint_failures"}


@pytest.mark.parametrize(
    "summary, code",
    [
        (HealthSummary(), 200),
        (HealthSummary(state="YELLOW", reasons=["memory 90% >= 85%"]), 200),
        (HealthSummary(state="RED", reasons=["storage free 1 MiB < 256 MiB"]), 503),
        (HealthSummary(state="YELLOW", reasons=["NATS disconnected"], nats_connected=False), 503),
    ],
)
async def test_ready_is_503_when_red_or_cut_off_from_nats(node, summary, code):
    node.summary = summary
    status, _, body = await get(node.server, "/ready")
    doc = json.loads(body)
    assert status == code and doc["ready"] is (code == 200)
    assert doc["reasons"] == list(summary.reasons)  # "NATS disconnected" listed once


async def test_live_is_503_only_when_the_loop_was_stuck(node):
    node.summary = HealthSummary(state="RED", nats_connected=False)
    assert (await get(node.server, "/live"))[0] == 200  # RED and cut off, but alive
    node.stuck_s = 6.0
    status, _, body = await get(node.server, "/live")
    assert status == 503 and json.loads(body) == {"live": False, "loop_stuck_s": 6.0}


async def test_ready_is_503_while_starting():
    started = False
    routes = health_routes(render_metrics=bytes, summary=HealthSummary, stuck_for=lambda: 0.0,
                           started=lambda: started)
    async with HttpServer(routes) as server:
        status, _, body = await get(server, "/ready")
        assert status == 503 and json.loads(body)["reasons"] == ["starting"]
        assert (await get(server, "/live"))[0] == 200
        started = True
        assert (await get(server, "/ready"))[0] == 200


def test_response_helpers_without_a_server():
    assert ready_response(HealthSummary(nats_connected=False))[0] == 503
    assert live_response(4.99, 5.0)[0] == 200 and live_response(5.0, 5.0)[0] == 503


# ------------------------------------------------------------------ HTTP edges


async def test_unknown_path_and_method(node):
    status, _, body = await get(node.server, "/nope")
    assert status == 404 and b"/metrics" in body
    status, headers, _ = await get(node.server, "/metrics", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


async def test_head_has_headers_and_no_body(node):
    status, headers, body = await get(node.server, "/health", method="HEAD")
    assert status == 200 and int(headers["Content-Length"]) > 0 and body == b""


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET /x\r\n\r\n", b"GET x HTTP/1.1\r\n\r\n",
                                 b"\xff\xfe / HTTP/1.1\r\n\r\n", b"GET /health SPDY/3\r\n\r\n"])
async def test_malformed_requests_get_400(node, raw):
    assert (await request(node.server, raw))[0] == 400


async def test_an_oversized_request_head_gets_431(node):
    raw = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    assert (await request(node.server, raw))[0] == 431


async def test_a_silent_client_blocks_nobody_and_is_dropped():
    n = Node()
    async with HttpServer(n.routes(), timeout_s=0.3) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET /health HTTP/1.1\r\n")  # and never finishes
        assert (await get(server, "/live"))[0] == 200  # others are served meanwhile
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then it is closed
        writer.close()


async def test_a_failing_or_slow_handler_is_answered_and_the_server_goes_on():
    async def boom():
        raise RuntimeError("bug")

    async def slow():
        await asyncio.sleep(30)
        return 200, "text/plain", b"late"

    async def ok():
        return 200, "text/plain", b"fine"

    async with HttpServer({"/boom": boom, "/slow": slow, "/ok": ok}, timeout_s=0.2) as server:
        assert (await get(server, "/boom"))[0] == 500
        assert (await get(server, "/slow"))[0] == 503
        assert await get(server, "/ok") == (200, {"Content-Type": "text/plain", "Content-Length": "4",
                                                  "Cache-Control": "no-store", "Connection": "close"}, b"fine")


async def test_connections_are_bounded():
    async def ok():
        return 200, "text/plain", b"ok"

    async with HttpServer({"/ok": ok}, max_connections=2) as server:
        idle = [await asyncio.open_connection(server.host, server.port) for _ in range(2)]
        await asyncio.sleep(0)  # let the server accept them
        for _ in range(50):
            if len(server._clients) == 2:
                break
            await asyncio.sleep(0.01)
        assert (await get(server, "/ok"))[0] == 503
        for _, w in idle:
            w.close()


async def test_lifecycle_is_idempotent_and_stop_drops_open_connections(caplog):
    async def ok():
        return 200, "text/plain", b"ok"

    server = HttpServer({"/ok": ok})
    await server.stop()  # before start: harmless, and the server stays stopped
    await server.start()
    assert server._server is None
    server = HttpServer({"/ok": ok})
    await server.start()
    await server.start()
    reader, writer = await asyncio.open_connection(server.host, server.port)
    await asyncio.wait_for(server.stop(), 10)
    await server.stop()
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", server.port)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # a dropped client is no crash


async def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HttpServerError, match=f"cannot listen on 127.0.0.1:{port}"):
            await HttpServer({}, port=port).start()


def test_bad_routes_and_ports_are_refused():
    with pytest.raises(ValueError, match="must start with '/'"):
        HttpServer({"metrics": None})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="65536"):
        HttpServer({}, port=65536)


def test_request_line_parsing():
    assert parse_request_line(b"get /metrics?x=1 HTTP/1.0\r\nHost: a\r\n\r\n") == ("GET", "/metrics")
    assert parse_request_line(b"GET  /metrics HTTP/1.1\r\n\r\n") is None


# ------------------------------------------------------------------ metrics


def test_gpu_series_follow_the_gpus_and_xids_are_counted_once():
    m = AgentMetrics()
    gpu = GpuHealth(index=1, temperature_c=70, utilization_percent=50, power_w=300, memory_used_bytes=5,
                    memory_total_bytes=10, xids=[79, 79, 13], processes=[GpuProcess(pid=1)])
    m.update_health(HealthSummary(gpus=[gpu]))
    got = samples(m.render())
    assert got[("revenant_gpu_utilization_ratio", (("gpu", "1"),))] == 0.5
    assert got[("revenant_gpu_power_watts", (("gpu", "1"),))] == 300
    assert got[("revenant_gpu_processes", (("gpu", "1"),))] == 1
    assert got[("revenant_gpu_xid_errors_total", (("gpu", "1"), ("xid", "79")))] == 2
    m.update_health(HealthSummary(gpus=[GpuHealth(index=1, temperature_c=71)]))
    assert samples(m.render())[("revenant_gpu_xid_errors_total", (("gpu", "1"), ("xid", "13")))] == 1
    m.update_health(HealthSummary())
    assert not any(name.startswith("revenant_gpu_temperature") for name, _ in samples(m.render()))


def test_loop_stalls_counter_follows_the_cumulative_count():
    m = AgentMetrics()
    for stalls in (1, 1, 4):
        m.update_health(HealthSummary(loop_stalls=stalls))
    assert samples(m.render())[("revenant_event_loop_stalls_total", ())] == 4


def test_checkpoints_jobs_and_anomalies():
    m = AgentMetrics()
    m.observe_checkpoint(ok=True, duration_s=3.0, freeze_s=0.2, size_bytes=3 * 2**30)
    m.observe_checkpoint(ok=False, duration_s=1.0)
    m.set_jobs({"running": 2, "checkpointing": 1})
    m.set_jobs({"running": 3})
    m.count_anomaly("loop_lag_s")
    got = samples(m.render())
    assert got[("revenant_checkpoints_total", (("result", "ok"),))] == 1
    assert got[("revenant_checkpoints_total", (("result", "failed"),))] == 1
    assert got[("revenant_checkpoint_duration_seconds_count", ())] == 1
    assert got[("revenant_checkpoint_freeze_seconds_sum", ())] == 0.2
    assert got[("revenant_checkpoint_bytes_bucket", (("le", "4.294967296e+09"),))] == 1
    assert got[("revenant_jobs", (("state", "running"),))] == 3
    assert got[("revenant_jobs", (("state", "checkpointing"),))] == 0
    assert got[("revenant_anomalies_total", (("metric", "loop_lag_s"),))] == 1
    with pytest.raises(ValueError, match="duration_s must be a finite number >= 0"):
        m.observe_checkpoint(ok=True, duration_s=-1)


def test_coordinator_metrics():
    c = CoordinatorMetrics()
    c.update_nodes([NodeStatus(name="a", state="alive", health="YELLOW"), NodeStatus(name="b", state="suspect"),
                    NodeStatus(name="c", state="dead", health="GREEN")])
    got = samples(c.render())
    assert got[("revenant_nodes", (("state", "alive"),))] == 1
    assert got[("revenant_nodes", (("state", "dead"),))] == 1
    assert got[("revenant_node_health_state", (("node", "a"),))] == 1
    assert ("revenant_node_health_state", (("node", "c"),)) not in got  # a dead node's report is stale
    c.update_nodes([NodeStatus(name="a", state="dead")])
    assert not any(name == "revenant_node_health_state" for name, _ in samples(c.render()))
    c.count_node_event(NodeEvent(node="a", kind="dead", at=0.0, silence_s=2.6))
    c.count_failover(ok=True)
    c.count_failover(ok=True, cause="evicted")
    c.count_heartbeats(3, 1)
    got = samples(c.render())
    assert got[("revenant_failure_detection_seconds_bucket", (("le", "3.0"),))] == 1
    assert got[("revenant_node_events_total", (("kind", "dead"),))] == 1
    assert got[("revenant_failovers_total", (("cause", "dead"), ("result", "ok")))] == 1
    assert got[("revenant_failovers_total", (("cause", "evicted"), ("result", "ok")))] == 1
    assert got[("revenant_failovers_total", (("cause", "takeover"), ("result", "failed")))] == 0
    assert got[("revenant_heartbeats_received_total", (("result", "malformed"),))] == 1
    assert got[("revenant_heartbeats_received_total", (("result", "ok"),))] == 3


def test_proactive_actions_and_pause():
    c = CoordinatorMetrics()
    got = samples(c.render())
    assert got[("revenant_proactive_paused", ())] == 0
    assert not any(name == "revenant_proactive_actions_total" for name, _ in got)  # reasons are config: no presets
    c.count_proactive("checkpoint", "gpu_temperature")
    c.count_proactive("checkpoint", "gpu_temperature")
    c.count_proactive("checkpoint", "anomaly")
    c.count_proactive("migrate", "gpu_ecc")
    c.set_proactive_paused(True)
    got = samples(c.render())
    proactive = {labels: v for (name, labels), v in got.items() if name == "revenant_proactive_actions_total"}
    assert proactive == {(("action", "checkpoint"), ("reason", "gpu_temperature")): 2,
                         (("action", "checkpoint"), ("reason", "anomaly")): 1,
                         (("action", "migrate"), ("reason", "gpu_ecc")): 1}
    assert got[("revenant_proactive_paused", ())] == 1
    c.set_proactive_paused(False)
    assert samples(c.render())[("revenant_proactive_paused", ())] == 0
    with pytest.raises(ValueError, match="proactive action must be one of checkpoint, migrate, got 'drain'"):
        c.count_proactive("drain", "memory")


def test_each_instance_has_its_own_registry():
    a, b = AgentMetrics(), AgentMetrics()
    a.update_health(HealthSummary(state="RED"))
    assert samples(b.render())[("revenant_node_health_state", ())] == 0
    CoordinatorMetrics(), CoordinatorMetrics()  # no "Duplicated timeseries" from a shared registry


def test_nodes_by_health_and_per_node_series_that_can_be_turned_off():
    from revenant.common.serving.metrics import CoordinatorMetrics

    m = CoordinatorMetrics()
    nodes = [NodeStatus(name="a", state="alive", health="GREEN"), NodeStatus(name="b", state="suspect", health="RED"),
             NodeStatus(name="c", state="dead", health="YELLOW")]
    m.update_nodes(nodes)
    text = m.render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("revenant_nodes_by_health", (("health", "GREEN"),))] == 1
    assert samples[("revenant_nodes_by_health", (("health", "RED"),))] == 1
    assert samples[("revenant_nodes_by_health", (("health", "YELLOW"),))] == 0  # a dead node's is stale
    assert ("revenant_node_health_state", (("node", "b"),)) in samples
    m.update_nodes(nodes, per_node=False)
    assert "revenant_node_health_state{" not in m.render().decode()
