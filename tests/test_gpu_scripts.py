"""tests/gpu/ (the real-hardware GPU check) and deploy/scripts/gpu-bundle.sh: their syntax, the
counter's PTX and protocol, and, on a machine with an NVIDIA GPU, an in-place checkpoint."""

from __future__ import annotations

import ctypes
import json
import os
import py_compile
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.criu

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "tests" / "gpu"
SCRIPTS = [GPU / "device-check.sh", REPO / "deploy" / "scripts" / "gpu-bundle.sh"]


def _has_gpu() -> bool:
    if not os.path.exists("/dev/nvidia0"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("source", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_python_files_compile(source, tmp_path):
    py_compile.compile(str(source), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_checkpoint_structs_are_64_bytes():
    proc = subprocess.run([sys.executable, "-c", "import cudrv as c, ctypes; print([ctypes.sizeof(s) for s in "
                           "(c.LockArgs, c.CheckpointArgs, c.UnlockArgs, c.RestoreArgs)], ctypes.sizeof(c.GpuPair))"],
                          capture_output=True, text=True, timeout=30, cwd=GPU)
    assert proc.stdout.split() == ["[64,", "64,", "64,", "64]", "32"], proc.stderr


def test_counter_ptx_is_well_formed():
    text = (GPU / "counter_driver.py").read_text()
    ptx = re.search(r'PTX = """\\\n(.*?)"""', text, re.S).group(1)
    lines = [line.strip() for line in ptx.splitlines() if line.strip()]
    assert lines[:3] == [".version 6.0", ".target sm_50", ".address_size 64"]
    assert ".visible .global .align 4 .u32 counter = 100;" in lines
    assert ".visible .entry increment()" in lines
    assert ptx.count("{") == ptx.count("}") == 1
    body = ptx[ptx.index("{") + 1:ptx.index("}")]
    statements = [s.strip() for s in body.split(";") if s.strip()]
    assert statements[-1] == "ret"
    assert all(s.split()[0] in {".reg", "ld.global.u32", "add.u32", "st.global.u32", "ret"} for s in statements)
    # The counter's memory is addressed by name, through registers the kernel declares.
    assert "[counter]" in body and "%r<2>" in body


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_counter_protocol_without_a_gpu():
    port = _free_udp_port()
    proc = subprocess.Popen([sys.executable, str(GPU / "counter_driver.py"), str(port), "--cpu"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(10)
            answers = []
            for _ in range(2):
                s.sendto(b"hi", ("127.0.0.1", port))
                answers.append(s.recv(64))
        assert answers == [b"101\n", b"102\n"]
        assert [proc.stdout.readline(), proc.stdout.readline()] == ["101\n", "102\n"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_counter_poll_mode_without_a_gpu(tmp_path):
    requests = tmp_path / "requests"
    proc = subprocess.Popen([sys.executable, str(GPU / "counter_driver.py"), "--poll", str(requests), "--cpu"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        requests.write_bytes(b"x")
        assert proc.stdout.readline() == "101\n"
        with requests.open("ab") as f:
            f.write(b"xx")
        assert [proc.stdout.readline(), proc.stdout.readline()] == ["102\n", "103\n"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_counter_driver_without_libcuda_says_so():
    proc = subprocess.run([sys.executable, str(GPU / "counter_driver.py"), str(_free_udp_port()),
                           "--libcuda", "/nonexistent/libcuda.so.1"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.startswith("counter_driver: /nonexistent/libcuda.so.1:") and "Traceback" not in proc.stderr


def test_inplace_without_libcuda_reports_it(tmp_path):
    out = tmp_path / "inplace.json"
    proc = subprocess.run([sys.executable, str(GPU / "inplace.py"), "--libcuda", "/nonexistent/libcuda.so.1",
                           "--json", str(out)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["error"].startswith("no usable CUDA driver: /nonexistent/libcuda.so.1") and doc["runs"] == []


@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
def test_inplace_checkpoint_of_one_gib_on_the_gpu(tmp_path):
    out = tmp_path / "inplace.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(GPU / "inplace.py"), "--sizes", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert run["verified"], (run["errors"], proc.stdout, proc.stderr)
    assert run["states"]["after_checkpoint"] == "checkpointed" and run["states"]["after_unlock"] == "running"
    assert proc.returncode == 0 and time.monotonic() - started < 110
