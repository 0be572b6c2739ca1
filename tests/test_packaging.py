"""Packaging and deployment, checked by the tools that will read them: the wheel, installed into a
fresh venv, runs on its own; deploy/systemd/'s units pass ``systemd-analyze verify``; its NATS
cluster configuration passes ``nats-server -t``.

The nats tier: nats-server checks the cluster configuration, and the rest runs subprocesses too
(pip, venv, systemd-analyze), which the unit tier does not.  Nothing is downloaded: the wheel is
built with this venv's setuptools, and the fresh venv finds revenant's dependencies in this one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from revenant.cli.keys import make_keys
from revenant.common.messaging.natsserver import find_nats_server

pytestmark = pytest.mark.nats

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "deploy" / "systemd"
VENV_BIN = Path(sys.executable).parent
# Where the units expect revenant's venv (docs/deploy.md).
INSTALLED_BIN = "/opt/revenant/venv/bin/"
UNITS = ["revenant-agent.service", "revenant-coordinator.service", "nats-server.service"]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, **kwargs)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def purelib(python: Path) -> Path:
    proc = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True)
    return Path(proc.stdout.strip())


# ------------------------------------------------------------------ the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what pyproject.toml names (the checkout gets no build/)."""
    project = pyproject()
    # Built without isolation: this venv's setuptools must be what [build-system] asks for.
    (needed,) = [int(r.split(">=")[1]) for r in project["build-system"]["requires"] if r.startswith("setuptools>=")]
    have = metadata.version("setuptools")
    assert int(have.split(".")[0]) >= needed, f"setuptools {have} cannot build the wheel: run `make setup`"
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy2(REPO / name, src / name)
    for folder in project["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                "-w", str(tmp / "dist"), str(src)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    wheels = list((tmp / "dist").glob("revenant-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A venv of the base interpreter holding the wheel alone; a .pth line lends it this venv's
    site-packages for the dependencies (a plain path: this venv's editable install stays out)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    base = getattr(sys, "_base_executable", "") or sys.executable
    proc = run([base, "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr
    python = venv / "bin" / "python"
    lent = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib(python) / "revenant-test-dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(lent)))
    proc = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                str(wheel)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return venv


def clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    return env


def test_the_wheel_runs_from_a_fresh_venv(fresh_venv):
    env = clean_env(fresh_venv)
    version = run([str(fresh_venv / "bin" / "revenant"), "--version"], cwd="/", env=env)
    assert (version.returncode, version.stdout, version.stderr) == (0, f"revenant {pyproject()['project']['version']}\n", "")
    usage = run([str(fresh_venv / "bin" / "revenant"), "--help"], cwd="/", env=env)
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: revenant")
    for command in ("agent", "coordinator", "up", "keys", "submit", "checkpoint", "jobs", "events"):
        assert re.search(rf"^ +{command}\b", usage.stdout, re.M), command
    # Every subpackage comes from the fresh venv's site-packages, not from this checkout.
    where = run([str(fresh_venv / "bin" / "python"), "-c",
                 "import revenant, revenant.agent.node.agent, revenant.coordinator.coordinator, revenant.cli.main as m\n"
                 "print(*revenant.__path__, m.__file__, sep='\\n')"], cwd="/", env=env)
    assert where.returncode == 0, where.stderr
    site = purelib(fresh_venv / "bin" / "python")
    paths = [Path(p) for p in where.stdout.split()]
    assert paths == [site / "revenant", site / "revenant" / "cli" / "main.py"]


def test_the_dev_install_prints_the_same_version():
    proc = run([str(VENV_BIN / "revenant"), "--version"])
    assert proc.stdout == f"revenant {pyproject()['project']['version']}\n", (
        f"{proc.stdout!r}: the venv's install is older than pyproject.toml; run `make setup`")


# ------------------------------------------------------------------ deploy/systemd


def local_copy(unit: str, directory: Path) -> Path:
    """The unit with its ExecStart on this checkout's venv: systemd-analyze wants the binary to exist."""
    text = (SYSTEMD / unit).read_text()
    assert INSTALLED_BIN in text, unit
    copy = directory / unit
    copy.write_text(text.replace(INSTALLED_BIN, f"{VENV_BIN}/"))
    return copy


def complaints(unit: Path) -> str:
    """What systemd-analyze verify says of ``unit``: "" for none.  A bad value or an unknown key is
    only a warning (exit 0), so any output counts."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: `make setup` installs it (package systemd)"
    proc = run(["systemd-analyze", "verify", str(unit)])
    said = (proc.stdout + proc.stderr).strip()
    return said or ("" if proc.returncode == 0 else f"exit status {proc.returncode}")


@pytest.mark.parametrize("unit", UNITS)
def test_units_pass_systemd_analyze_verify(unit, tmp_path):
    assert complaints(local_copy(unit, tmp_path)) == ""


def test_a_broken_unit_fails_the_check(tmp_path):
    good = local_copy("revenant-agent.service", tmp_path).read_text()
    broken = tmp_path / "broken.service"
    for old, new in (("KillMode=mixed", "KillMode=gently"), ("TimeoutStopSec=", "TimeoutStopSecs="),
                     (f"{VENV_BIN}/revenant", "/nonexistent/revenant")):
        assert old in good
        broken.write_text(good.replace(old, new))
        assert complaints(broken) != "", new


def test_nats_cluster_config_passes_nats_servers_check(tmp_path):
    conf = tmp_path / "nats-server.conf"
    shutil.copy(SYSTEMD / "nats-server.conf", conf)
    # Its include: the authorization block `revenant keys` writes.
    keys = make_keys(tmp_path / "keys", ["node-1"], [])
    shutil.copy(keys.directory / "authorization.conf", tmp_path / "authorization.conf")
    env = {**os.environ, "NATS_SERVER_NAME": "nats-1"}
    proc = run([find_nats_server(), "-t", "-c", str(conf)], env=env)
    assert proc.returncode == 0, proc.stderr
    # The check can fail: without the name nats-server.service sets, the file does not load.
    del env["NATS_SERVER_NAME"]
    proc = run([find_nats_server(), "-t", "-c", str(conf)], env=env)
    assert proc.returncode != 0 and "NATS_SERVER_NAME" in proc.stderr
