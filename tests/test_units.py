"""Pure pieces: config loading, health rules, criu discovery and parsing, GPU discovery."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

import pytest

from revenant.agent.criu import inspect_criu, last_error_line, locate_criu, parse_version
from revenant.agent.gpu import discover_gpus
from revenant.agent.health import HealthSample, HealthThresholds, evaluate
from revenant.common.loopmonitor import LoopMonitor
from revenant.common.config import AgentConfig, CoordinatorConfig, load_config
from revenant.common.errors import ConfigError, CriuError

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ config

def test_config_file_env_and_overrides_layer(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[coordinator]\nnode_timeout_s = 4.0\nsuspect_timeout_s = 2.0\n[agent]\nnode = "a"\n')
    cfg = load_config(CoordinatorConfig, "coordinator", f, {"probe_timeout_s": 0.3},
                      environ={"REVENANT_COORDINATOR_SUSPECT_TIMEOUT_S": "3"})
    assert (cfg.node_timeout_s, cfg.suspect_timeout_s, cfg.probe_timeout_s) == (4.0, 3.0, 0.3)
    assert load_config(AgentConfig, "agent", f, environ={}).node == "a"


@pytest.mark.parametrize(
    "toml, env, message",
    [
        ("[coordinator]\nnode_timout_s = 4\n", {}, "node_timout_s"),
        ("[coordinator]\nnode_timeout_s = 'soon'\n", {}, "node_timeout_s"),
        ("[coordinator]\nnode_timeout_s = 1.0\n", {}, "at least suspect_timeout_s"),
        ("", {"REVENANT_COORDINATOR_NODE_TIMEOUTS": "1"}, "REVENANT_COORDINATOR_NODE_TIMEOUTS"),
        ("[coordinator\n", {}, "r.toml"),
        ("coordinator = 3\n", {}, "must be a table"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, toml, env, message):
    f = tmp_path / "r.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(CoordinatorConfig, "coordinator", f, environ=env)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(AgentConfig, "agent", tmp_path / "nope.toml", environ={})


@pytest.mark.parametrize("cls, section", [(AgentConfig, "agent"), (CoordinatorConfig, "coordinator")])
def test_configuration_reference_lists_every_key_with_its_default(cls, section):
    doc = (REPO / "docs" / "configuration.md").read_text()
    table = doc.split(f"## [{section}]", 1)[1].split("\n## ", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M))
    defaults = cls()
    assert set(documented) == set(cls.__struct_fields__)
    for name, shown in documented.items():
        value = getattr(defaults, name)
        assert shown == (repr(value) if isinstance(value, str) else str(value)), name


# ------------------------------------------------------------------ health

T = HealthThresholds()


@pytest.mark.parametrize(
    "sample, state, reason",
    [
        (HealthSample(memory_percent=50, storage_free_bytes=10 * 2**30), "GREEN", None),
        (HealthSample(memory_percent=85, storage_free_bytes=10 * 2**30), "YELLOW", "memory"),
        (HealthSample(memory_percent=96, storage_free_bytes=10 * 2**30), "RED", "memory"),
        (HealthSample(storage_free_bytes=2**30), "YELLOW", "storage"),
        (HealthSample(storage_free_bytes=2**20), "RED", "storage"),
        (HealthSample(storage_free_bytes=10 * 2**30, recent_stalls=1, loop_lag_s=0.3), "YELLOW", "event loop"),
        (HealthSample(storage_free_bytes=10 * 2**30, loop_lag_s=3.0), "RED", "event loop"),
        (HealthSample(storage_free_bytes=10 * 2**30, criu_ok=False, criu_error="criu not found"), "RED", "criu"),
        (HealthSample(storage_free_bytes=10 * 2**30, nats_connected=False), "YELLOW", "NATS"),
    ],
)
def test_health_rules(sample, state, reason):
    summary = evaluate(sample, T)
    assert summary.state == state
    if reason is None:
        assert summary.reasons == []
    else:
        assert any(reason in r for r in summary.reasons), summary.reasons


def test_worst_probe_wins_and_every_reason_is_listed():
    s = evaluate(HealthSample(memory_percent=90, storage_free_bytes=1, nats_connected=False), T)
    assert s.state == "RED" and len(s.reasons) == 3


def test_loop_monitor_counts_stalls_per_window():
    m = LoopMonitor(stall_threshold_s=0.25)
    for lag in (0.001, 0.3, 0.002, 1.0):
        m.record(lag)
    assert m.take_window() == (1.0, 2)
    m.record(0.01)
    assert m.take_window() == (1.0, 0)  # worst of the window includes the lag carried over
    assert m.take_window() == (0.01, 0)
    assert m.stalls == 2


async def test_loop_monitor_sees_a_blocked_loop():
    import time

    m = LoopMonitor(period_s=0.02, stall_threshold_s=0.1)
    task = asyncio.create_task(m.run())
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # block the loop
    await asyncio.sleep(0.05)
    task.cancel()
    worst, stalls = m.take_window()
    assert stalls >= 1 and worst >= 0.2


# ------------------------------------------------------------------ criu

def test_last_error_line_skips_the_harmless_rlimit_error():
    out = ("(00.001) Error (criu/util.c:123): rlimit: Can't setup RLIMIT_NOFILE\n"
           "(00.200) Error (criu/cr-dump.c:99): Dumping FAILED.\n"
           "(00.201) Error (criu/util.c:123): rlimit: Can't setup RLIMIT_NOFILE\n")
    assert last_error_line(out) == "(00.200) Error (criu/cr-dump.c:99): Dumping FAILED."
    assert last_error_line("Looks good.\n") == "Looks good."
    assert parse_version("Version: 4.1.1\nGitID: x\n") == "4.1.1"


def test_locate_criu_order(tmp_path):
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert locate_criu(str(fake), environ={}) == str(fake)
    assert locate_criu("", environ={"REVENANT_CRIU": str(fake)}) == str(fake)
    with pytest.raises(CriuError, match="criu_path=/nope"):
        locate_criu("/nope", environ={})
    with pytest.raises(CriuError, match="REVENANT_CRIU=/nope"):
        locate_criu("", environ={"REVENANT_CRIU": "/nope"})


async def test_real_criu_passes_check_and_reports_features():
    info = await inspect_criu()
    assert info.ok, info.error
    assert tuple(int(x) for x in info.version.split(".")[:2]) >= (4, 1)
    assert set(info.features) >= {"mem_dirty_track"}
    assert all(isinstance(v, bool) for v in info.features.values())


async def test_too_old_or_failing_criu_is_reported_with_its_own_line(tmp_path):
    old = tmp_path / "old-criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    info = await inspect_criu(str(old))
    assert not info.ok and "3.17.1 is too old" in info.error
    broken = tmp_path / "broken-criu"
    broken.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "Version: 4.1.1"; exit 0; fi\n'
                      'echo "Error (criu/util.c:1): rlimit: Can\'t setup RLIMIT_NOFILE"\n'
                      'echo "Error (criu/vdso.c:2): vdso: Unexpected rt vDSO area bounds"\nexit 1\n')
    broken.chmod(0o755)
    info = await inspect_criu(str(broken))
    assert not info.ok
    assert info.error == "criu check failed: Error (criu/vdso.c:2): vdso: Unexpected rt vDSO area bounds"


# ------------------------------------------------------------------ GPU discovery

class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict] | None, init_error: bool = False):
    """A stand-in with pynvml's shape, for the code path real NVML drives."""
    m = types.SimpleNamespace()

    def init():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: b"580.65"
    m.nvmlDeviceGetCount = lambda: len(devices or [])
    m.nvmlDeviceGetHandleByIndex = lambda i: devices[i]
    m.nvmlDeviceGetName = lambda h: h["name"]
    m.nvmlDeviceGetUUID = lambda h: h["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["mem"], used=0, free=h["mem"])
    return m


def test_gpu_discovery_lists_devices():
    kind, gpus = discover_gpus(fake_nvml([{"name": "NVIDIA H200", "uuid": "GPU-a", "mem": 141 * 2**30}]))
    assert kind == "nvml"
    assert gpus[0].name == "NVIDIA H200" and gpus[0].driver_version == "580.65"


def test_no_driver_or_no_device_is_gpu_none():
    assert discover_gpus(fake_nvml(None, init_error=True)) == ("none", [])
    assert discover_gpus(fake_nvml([])) == ("none", [])


def test_real_nvml_on_this_machine_is_not_an_error():
    kind, gpus = discover_gpus()
    assert kind in ("none", "nvml")
