"""deploy/: every metric the dashboard and the alerts query is one revenant exports, the probes hit real
routes, and deploy/systemd/'s units and example config agree with revenant's settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from revenant.common.serving.metrics import AgentMetrics, CoordinatorMetrics, health_routes
from revenant.common.settings.config import AgentConfig, CoordinatorConfig, load_config
from revenant.messages import GpuHealth, GpuProcess, HealthSummary, NodeEvent, NodeStatus

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
METRIC = re.compile(r"\b(revenant_[a-zA-Z0-9_]+)")
# Series Prometheus makes itself; alerts may use them.
BUILTIN = {"up"}


def exported_series() -> set[str]:
    """Every series name agent and coordinator expose, with each label set in use."""
    agent = AgentMetrics()
    agent.update_health(HealthSummary(gpus=[GpuHealth(index=0, xids=[79], processes=[GpuProcess(pid=1)])]))
    agent.observe_checkpoint(ok=True, duration_s=1.0, freeze_s=0.1, size_bytes=1)
    agent.set_jobs({"running": 1})
    agent.count_anomaly("loop_lag_s")
    coord = CoordinatorMetrics()
    coord.update_nodes([NodeStatus(name="n", state="alive")])
    coord.count_node_event(NodeEvent(node="n", kind="dead", at=0.0, silence_s=2.5))
    coord.count_proactive("checkpoint", "memory")  # labelled on use only
    names = set()
    for text in (agent.render(), coord.render()):
        for family in text_string_to_metric_families(text.decode()):
            names.update(s.name for s in family.samples)
    return names


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "revenant-dashboard.json").read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_queries(dash: dict) -> list[str]:
    queries = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    queries += [v["definition"] for v in dash.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return queries


def test_every_metric_the_dashboard_queries_is_exported():
    exported = exported_series()
    queries = dashboard_queries(dashboard())
    assert len(queries) >= 20
    used = {m for q in queries for m in METRIC.findall(q)}
    assert used - exported == set(), f"queried but not exported: {sorted(used - exported)}"
    # The panels the issue asks for are there.
    for needed in ("revenant_node_health_state", "revenant_checkpoint_duration_seconds_bucket",
                   "revenant_checkpoint_freeze_seconds_bucket", "revenant_failovers_total",
                   "revenant_gpu_temperature_celsius", "revenant_failure_detection_seconds_bucket",
                   "revenant_proactive_actions_total", "revenant_proactive_paused"):
        assert needed in used


def test_dashboard_is_importable():
    dash = dashboard()
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    assert dash["uid"] and dash["title"] and dash["__inputs"][0]["name"] == "DS_PROMETHEUS"
    for p in panels(dash):
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            for t in p["targets"]:
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    health = next(p for p in panels(dash) if "revenant_node_health_state" in str(p.get("targets")))
    assert "node" in health["targets"][0]["expr"] and health["type"] == "status-history"


def test_every_metric_the_alerts_query_is_exported():
    rules = (DEPLOY / "prometheus" / "revenant-alerts.yml").read_text()
    exprs = re.findall(r"^\s+expr: (.+)$", rules, re.M)
    assert len(exprs) >= 5
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used - exported_series() == set()
    bare = {m for e in exprs for m in re.findall(r"\b([a-z_]+)\{", e)} - used
    assert bare <= BUILTIN


def test_scrape_config_names_the_rules_and_the_target_files():
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    for job in ("revenant-agent", "revenant-coordinator"):
        assert f"job_name: {job}\n" in config
    assert "revenant-alerts.yml" in config
    targets = json.loads((DEPLOY / "prometheus" / "targets" / "agents.json").read_text())
    assert all(t["labels"]["node"] and t["targets"] for t in targets)


# ------------------------------------------------------------------ deploy/kubernetes
# (No YAML parser among revenant's dependencies: the manifests are read with patterns, which
# their one-line flow mappings keep simple.)

KUBE = DEPLOY / "kubernetes"


def kube_doc(manifest: str, kind: str) -> str:
    """The one document of ``kind`` in ``manifest``."""
    docs = [d for d in re.split(r"^---$", (KUBE / manifest).read_text(), flags=re.M)
            if re.search(rf"^kind: {kind}$", d, re.M)]
    assert len(docs) == 1, f"{manifest}: {len(docs)} documents of kind {kind}"
    return docs[0]


def probes(doc: str) -> dict[str, tuple[str, str]]:
    """Each probe of a manifest's container: kind -> (path, port)."""
    found = re.findall(r"^\s+(\w+Probe):.*\n\s+httpGet: \{path: (\S+), port: ([\w-]+)\}", doc, re.M)
    assert len({kind for kind, _, _ in found}) == len(found)
    return {kind: (path, port) for kind, path, port in found}


def container_env(doc: str) -> dict[str, str]:
    """A container's environment variables that have a literal value."""
    return dict(re.findall(r"^\s+- name: (\w+)[^\n]*\n\s+value: \"([^\"]*)\"", doc, re.M))


def field(doc: str, name: str) -> str:
    m = re.search(rf"^\s*{name}: ([^#\n]*?)\s*(?:#.*)?$", doc, re.M)
    assert m, f"no {name}"
    return m.group(1)


def nats_urls() -> list[str]:
    """The client URLs of the servers nats-statefulset.yaml starts: one per pod of the StatefulSet,
    by its name in the headless Service."""
    sts = kube_doc("nats-statefulset.yaml", "StatefulSet")
    name = re.search(r"^metadata:\n  name: (\S+)$", sts, re.M).group(1)
    port = re.search(r"\{name: client, containerPort: (\d+)\}", sts).group(1)
    return [f"nats://{name}-{i}.{field(sts, 'serviceName')}:{port}" for i in range(int(field(sts, "replicas")))]


REVENANT_MANIFESTS = [("agent-daemonset.yaml", "DaemonSet", AgentConfig, "agent"),
                      ("coordinator-deployment.yaml", "Deployment", CoordinatorConfig, "coordinator")]


@pytest.mark.parametrize("manifest,kind,section", [(m, k, s) for m, k, _, s in REVENANT_MANIFESTS])
def test_kubernetes_probes_use_real_routes(manifest, kind, section):
    doc = kube_doc(manifest, kind)
    routes = set(health_routes(render_metrics=bytes, summary=HealthSummary, stuck_for=float))
    found = probes(doc)
    assert {"livenessProbe", "readinessProbe"} <= set(found)
    assert {path for path, _ in found.values()} <= routes
    # /health answers 200 whatever the state: a probe on it would check nothing but the port.
    assert "/health" not in {path for path, _ in found.values()}
    # Liveness never looks at health (a RED node needs a person, not a restart loop).
    assert found["livenessProbe"][0] == "/live"
    port = re.search(r"\{name: (\w+), containerPort: (\d+)\}", doc)
    assert {p for _, p in found.values()} == {port.group(1)}
    assert container_env(doc)[f"REVENANT_{section.upper()}_HTTP_PORT"] == port.group(2)


def test_the_agent_is_ready_when_its_node_may_take_work():
    found = probes(kube_doc("agent-daemonset.yaml", "DaemonSet"))
    assert found["readinessProbe"][0] == "/ready"  # 503 while starting, RED or cut off from NATS
    assert found["startupProbe"][0] == "/live"  # criu check may take up to 30 s


def test_the_coordinators_are_a_leader_and_a_standby():
    doc = kube_doc("coordinator-deployment.yaml", "Deployment")
    assert field(doc, "replicas") == "2"
    # A standby's /ready is 503 until it leads: as readiness, no new pod could become ready while
    # the old leader runs, and a rolling update would wait for one forever.
    assert probes(doc)["readinessProbe"][0] != "/ready"
    assert field(doc, "type") == "RollingUpdate"
    assert field(doc, "rollingUpdate") == "{maxSurge: 0, maxUnavailable: 1}"
    assert field(kube_doc("coordinator-deployment.yaml", "PodDisruptionBudget"), "maxUnavailable") == "1"
    text = (KUBE / "coordinator-deployment.yaml").read_text()
    assert "single" not in text and "Recreate" not in text and "never two" not in text


@pytest.mark.parametrize("manifest,kind,cls,section", REVENANT_MANIFESTS)
def test_revenant_uses_all_three_nats_servers(manifest, kind, cls, section):
    doc = kube_doc(manifest, kind)
    assert "--nats" not in field(doc, "command")  # the environment says where the bus is
    config = load_config(cls, section, None, {"node": "n"} if cls is AgentConfig else None,
                         environ=container_env(doc))
    assert config.nats_url.split(",") == nats_urls() and len(nats_urls()) == 3
    assert config.nats_replicas == 3


def test_the_nats_statefulset_is_a_three_server_jetstream_cluster():
    sts = kube_doc("nats-statefulset.yaml", "StatefulSet")
    service = kube_doc("nats-statefulset.yaml", "Service")
    assert field(service, "name") == field(sts, "serviceName")
    assert field(service, "clusterIP") == "None" and field(service, "publishNotReadyAddresses") == "true"
    conf = kube_doc("nats-statefulset.yaml", "ConfigMap")
    routes = re.findall(r"nats-route://(\S+)", re.search(r"^\s+cluster \{(.*?)^\s+\}", conf, re.M | re.S).group(1))
    assert routes == [u.removeprefix("nats://").replace(":4222", ":6222") for u in nats_urls()]
    store = re.search(r"^\s+jetstream \{.*?store_dir: (\S+)", conf, re.M | re.S).group(1)
    # ... on a volume of each server's own.
    assert re.search(rf"\{{name: data, mountPath: {store}\}}", sts)
    assert re.search(r"^  volumeClaimTemplates:\n    - metadata:\n        name: data$", sts, re.M)
    # Each server is named after its pod, from the StatefulSet's environment.
    assert re.search(r"^\s+server_name: \$POD_NAME$", conf, re.M)
    assert re.search(r"- name: POD_NAME\n\s+valueFrom: \{fieldRef: \{fieldPath: metadata.name\}\}", sts)
    # Lame duck mode on the way out, with the time to finish it.
    lame = sum(int(re.search(rf"^\s+{key}: \"(\d+)s\"$", conf, re.M).group(1))
               for key in ("lame_duck_duration", "lame_duck_grace_period"))
    assert int(field(sts, "terminationGracePeriodSeconds")) > lame
    pid = re.search(r"^\s+pid_file: (\S+)$", conf, re.M).group(1)
    assert f"-sl=ldm={pid}" in sts
    found = probes(sts)
    assert set(found) == {"startupProbe", "readinessProbe", "livenessProbe"}
    assert all(path.startswith("/healthz") and port == "monitor" for path, port in found.values())
    assert "{name: monitor, containerPort: 8222}" in sts and re.search(r"^\s+http: 0.0.0.0:8222$", conf, re.M)
    assert field(kube_doc("nats-statefulset.yaml", "PodDisruptionBudget"), "maxUnavailable") == "1"


# ------------------------------------------------------------------ deploy/systemd
# (tests/test_packaging.py runs systemd-analyze verify and nats-server -t on the same files.)

SYSTEMD = DEPLOY / "systemd"


def unit_settings(unit: str) -> dict[str, list[str]]:
    """Each key of a systemd unit with its values, in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def agent_stop_bound_s(cfg: AgentConfig) -> float:
    """The longest an agent's SIGTERM can take (docs/configuration.md, "Stopping an agent"): the
    drain, then 10 s for SIGKILLed jobs to go, the conversions (shutdown_grace_s), the events (3 s,
    then 1 s), the last heartbeat (shutdown_grace_s + 2 s), the NATS drain (shutdown_grace_s) and the
    GPU monitor's thread (3 s)."""
    return cfg.drain_timeout_s + 3 * cfg.shutdown_grace_s + 10 + 4 + 2 + 3


def test_the_example_config_loads():
    path = SYSTEMD / "revenant.toml"
    agent = load_config(AgentConfig, "agent", path, {"node": "node-1"}, environ={})
    coordinator = load_config(CoordinatorConfig, "coordinator", path, environ={})
    assert agent.storage == "/shared/revenant" and agent.nats_url.count("nats://") == 3
    assert coordinator.nats_url == agent.nats_url and coordinator.nats_creds == "/etc/revenant/keys/coordinator.nk"
    assert coordinator.checkpoint.max_epochs == 2
    # Mounted before the agent starts.
    assert unit_settings("revenant-agent.service")["RequiresMountsFor"] == [agent.storage]


def test_stopping_an_agent_leaves_it_time_to_drain():
    unit = unit_settings("revenant-agent.service")
    assert unit["KillSignal"] == ["SIGTERM"] and unit["KillMode"] == ["mixed"]  # SIGTERM to the agent alone
    assert unit["Restart"][0] in ("on-failure", "always") and unit["OOMPolicy"] == ["continue"]
    timeout = float(unit["TimeoutStopSec"][0])
    example = load_config(AgentConfig, "agent", SYSTEMD / "revenant.toml", {"node": "n"}, environ={})
    assert agent_stop_bound_s(AgentConfig(node="n")) == 43.0
    assert timeout >= agent_stop_bound_s(example) + 10 and timeout >= agent_stop_bound_s(AgentConfig(node="n")) + 10
    start = unit["ExecStart"][0].split()
    assert start[:2] == ["/opt/revenant/venv/bin/revenant", "agent"] and "/etc/revenant/revenant.toml" in start
    assert start[start.index("--creds") + 1] == "/etc/revenant/keys/agent-%l.nk" and "%l" in start


def test_the_coordinator_and_nats_units():
    coordinator = unit_settings("revenant-coordinator.service")
    assert coordinator["KillSignal"] == ["SIGTERM"] and coordinator["Restart"][0] in ("on-failure", "always")
    assert float(coordinator["TimeoutStopSec"][0]) >= 4 + 3 + 10  # events, the NATS drain, a margin
    assert coordinator["ExecStart"][0].startswith("/opt/revenant/venv/bin/revenant coordinator --config ")
    nats = unit_settings("nats-server.service")
    assert nats["ExecStart"] == ["/opt/revenant/venv/bin/nats-server --config /etc/nats/nats-server.conf"]
    assert nats["KillSignal"] == ["SIGUSR2"]  # lame duck mode, over lame_duck_duration
    assert float(nats["TimeoutStopSec"][0]) > 30 + 10


def test_the_nats_config_is_a_three_server_jetstream_cluster():
    conf = (SYSTEMD / "nats-server.conf").read_text()
    assert re.search(r"^server_name: \$NATS_SERVER_NAME$", conf, re.M)
    assert unit_settings("nats-server.service")["Environment"] == ["NATS_SERVER_NAME=%l"]
    jetstream = re.search(r"^jetstream \{(.*?)^\}", conf, re.M | re.S).group(1)
    assert re.search(r"^\s+store_dir: /var/lib/nats$", jetstream, re.M)
    assert unit_settings("nats-server.service")["StateDirectory"] == ["nats"]
    cluster = re.search(r"^cluster \{(.*?)^\}", conf, re.M | re.S).group(1)
    routes = re.findall(r"nats-route://\S+@(\S+):6222", cluster)
    assert len(set(routes)) == 3 and "listen: 0.0.0.0:6222" in cluster
    assert "include ./authorization.conf" in conf
