"""Shared fixtures: a real nats-server on a free port, started per test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from revenant.common.natsserver import start_nats_server

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def nats_server(tmp_path):
    server = start_nats_server(tmp_path / "nats", log_file=tmp_path / "nats.log")
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


def revenant_cli(*args: str, timeout: float = 60, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed CLI as a subprocess, the way users and scripts do."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run([str(VENV_BIN / "revenant"), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"revenant {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc
