"""Batch jobs of real programs on a 2-node `revenant up` with real criu, each through `checkpoint
create`, a vacate and restart on the other node, and a failover, then checked against an
uninterrupted run: a JVM program (its output byte-exact), a parallel `make -j2` build (every
object file identical to those of a build that was never interrupted), and ffmpeg transcoding a
generated video (every frame identical by its decoded checksum, and the file byte for byte)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads]

APPS = REPO / "tests" / "workloads" / "apps"


def show(cluster, job: str) -> dict:
    out = cluster.cli("show", "job", job, "--json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def state(cluster, job: str, want: str, node: str | None = None, timeout: float = 120) -> dict:
    info = wait_until(lambda: (j := show(cluster, job)) and j["state"] == want and (node is None or j["node"] == node)
                      and j, timeout=timeout, interval=0.2)
    assert info, f"job {job} not {want}: {show(cluster, job)}"
    return info


def through_everything(cluster, job: str, progress) -> None:
    """create, vacate + restart on node-2, create, failover back to node-1: each once
    ``progress()`` has moved on since the step before."""
    state(cluster, job, "running", "node-1")
    for step in ("create", "vacate"):
        mark = progress()
        assert wait_until(lambda: progress() > mark, timeout=60), f"no progress before {step}"
        cluster.cli("checkpoint", step, job)
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    state(cluster, job, "running", "node-2")
    mark = progress()
    assert wait_until(lambda: progress() > mark, timeout=60)
    cluster.cli("checkpoint", "create", job)
    mark = progress()
    assert wait_until(lambda: progress() > mark, timeout=60)
    pid = show(cluster, job)["pid"]
    assert pid > 0, "the job ended before its failover: make it longer"  # os.kill(0) would hit us
    os.kill(cluster.pids()["node-2"], signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    state(cluster, job, "running", "node-1")


@pytest.mark.timeout(300)
def test_a_jvm_programs_output_is_byte_exact(make_cluster, tmp_path):
    javac, java = shutil.which("javac"), shutil.which("java")
    assert javac and java, "a JDK is missing: make setup installs it (Debian package default-jdk-headless)"
    build = tmp_path / "classes"
    subprocess.run([javac, "-d", str(build), str(APPS / "Counter.java")], check=True, timeout=120)
    n, interval = 500, "40"
    reference = subprocess.run([java, "-cp", str(build), "Counter", str(n), "0"], capture_output=True,
                               check=True, timeout=120).stdout
    cluster = make_cluster(2)
    job = cluster.cli("submit", "--node", "node-1", "--", java, "-Xmx64m", "-XX:+UseSerialGC", "-cp", str(build),
                      "Counter", str(n), interval).stdout.strip()
    out = cluster.storage / "jobs" / job / "output.log"
    through_everything(cluster, job, lambda: out.read_bytes().count(b"\n") if out.exists() else 0)
    state(cluster, job, "completed", timeout=120)
    assert out.read_bytes() == reference


MAKEFILE = """\
DELAY ?= 0.3
SRCS := $(wildcard src/*.c)
OBJS := $(SRCS:src/%.c=obj/%.o)
all: $(OBJS)
obj/%.o: src/%.c
\t@mkdir -p obj
\t@sleep $(DELAY)
\t@$(CC) -O1 -c $< -o $@
\t@echo built $@
"""


def _tree(d: Path, n: int) -> None:
    (d / "src").mkdir(parents=True)
    (d / "Makefile").write_text(MAKEFILE)
    for i in range(n):
        (d / "src" / f"f{i:03d}.c").write_text(
            f"int f{i}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += k * {i + 1}; return s; }}\n")


def _objects(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((d / "obj").glob("*.o"))}


@pytest.mark.timeout(300)
def test_a_parallel_make_builds_every_object_identically(make_cluster, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is missing: make setup installs gcc"
    n = 100
    reference = tmp_path / "reference"
    _tree(reference, n)
    subprocess.run(["make", "-j2", "-s", "DELAY=0"], cwd=reference, check=True, timeout=300, capture_output=True)
    cluster = make_cluster(2)
    work = tmp_path / "build"
    _tree(work, n)
    # The compiler's temporaries (cc1 writes /tmp/cc*.s, closes it, then `as` reads it) go in the
    # workdir, which every epoch holds as at its dump.  In the host's /tmp (the job's own /tmp is
    # the host's here: its workdir lies in /tmp) a closed temporary is in no epoch, and a failover
    # landing between cc1 and `as` finds it gone (docs/cli.md, "A job's own files").
    (work / "tmp").mkdir()
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(work), "--env", f"TMPDIR={work / 'tmp'}",
                      "--", shutil.which("make"), "-j2", f"CC={cc}").stdout.strip()
    through_everything(cluster, job, lambda: len(list((work / "obj").glob("*.o"))) if (work / "obj").exists() else 0)
    state(cluster, job, "completed", timeout=300)
    assert _objects(work) == _objects(reference) and len(_objects(work)) == n


# A generated video (ffmpeg's testsrc2), encoded with one thread (a deterministic encoder) into
# MPEG-TS written as it goes; -re reads the source at its own frame rate, so the job lasts as
# long as the video does.
VIDEO_IN = ["-f", "lavfi", "-i", "testsrc2=size=320x240:rate=25:duration=30"]
VIDEO_OUT = ["-c:v", "mpeg4", "-q:v", "5", "-threads", "1", "-f", "mpegts", "-flush_packets", "1", "-y"]


def _frames(ffmpeg: str, video: Path) -> list[str]:
    """Each decoded frame's checksum (ffmpeg's framemd5), in order."""
    out = subprocess.run([ffmpeg, "-nostdin", "-v", "error", "-i", str(video), "-f", "framemd5", "-"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [line.split(",")[-1].strip() for line in out.splitlines() if line and not line.startswith("#")]


@pytest.mark.timeout(300)
def test_ffmpeg_transcodes_a_generated_video_frame_exact(make_cluster, tmp_path):
    ffmpeg, ffprobe = shutil.which("ffmpeg"), shutil.which("ffprobe")
    assert ffmpeg and ffprobe, "ffmpeg is missing: make setup installs it (Debian package ffmpeg)"
    reference = tmp_path / "reference.ts"
    subprocess.run([ffmpeg, "-nostdin", "-v", "error", *VIDEO_IN, *VIDEO_OUT, str(reference)], check=True,
                   timeout=120)
    cluster = make_cluster(2)
    work = tmp_path / "transcode"
    work.mkdir()
    video = work / "out.ts"
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(work), "--", ffmpeg, "-nostdin", "-v", "error",
                      "-re", *VIDEO_IN, *VIDEO_OUT, "out.ts").stdout.strip()
    through_everything(cluster, job, lambda: video.stat().st_size if video.exists() else 0)
    state(cluster, job, "completed", timeout=120)
    count = subprocess.run([ffprobe, "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
                            "stream=nb_read_frames", "-of", "csv=p=0", str(video)],
                           capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert count and set(count) == {"750"}, count  # 30 s at 25 frames a second (once per TS program listing)
    assert _frames(ffmpeg, video) == _frames(ffmpeg, reference)
    assert video.read_bytes() == reference.read_bytes()
