"""A job's checkpoint options through the whole cluster, with real criu: incremental epochs that
become deltas (restored from any kept epoch, and falling back past a corrupt page), the storage
guard, pre-dump without dirty tracking, and load-aware skipping of periodic checkpoints.

The job is tests/jobs/memdirty.py: its memory is a function of its step, checked at every step (a
page from the wrong epoch prints a BAD line), and its output is one "step N ok" line per step, so
an output that counts 1, 2, 3 ... with no gap and no repeat shows the memory and the output were
both restored from the same epoch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_until

pytestmark = pytest.mark.cluster

MEMDIRTY = REPO / "tests" / "jobs" / "memdirty.py"
MIB = 1024**2


# ------------------------------------------------------------------ helpers

def submit(cluster, wd: Path, size_mib: int, *options: str, fraction: float = 0.02, interval: float = 0.3) -> str:
    wd.mkdir(exist_ok=True)
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(wd), *options, "--", sys.executable,
                      str(MEMDIRTY), str(size_mib), str(fraction), "0", str(interval)).stdout.strip()
    assert job.isdigit(), job
    return job


def output(cluster, job: str) -> bytes:
    try:
        return (cluster.storage / "jobs" / job / "output.log").read_bytes()
    except FileNotFoundError:
        return b""


def steps_done(cluster, job: str) -> int:
    return output(cluster, job).count(b"\n")


def assert_exact(data: bytes) -> int:
    """``data`` is "step 1 ok" .. "step N ok", each once, in order, and no BAD line: returns N."""
    lines = data.decode().splitlines()
    assert not [line for line in lines if not line.startswith("step ")], data[-400:]
    want = [f"step {i} ok" for i in range(1, len(lines) + 1)]
    bad = next((i for i, (a, b) in enumerate(zip(lines, want)) if a != b), None)
    assert bad is None, f"line {bad + 1} is {lines[bad]!r}, expected {want[bad]!r}: {lines[max(0, bad - 3):bad + 3]}"
    return len(lines)


def wait_steps(cluster, job: str, n: int, timeout: float = 60) -> None:
    assert wait_until(lambda: steps_done(cluster, job) >= n, timeout=timeout, interval=0.1), \
        f"job {job} did not reach step {n}: {output(cluster, job)[-300:]!r}"


def epoch_events(cluster, job: str, kind: str | None = None) -> list[dict]:
    return [e for e in cluster.events() if e.get("type") == "epoch_event.v1" and e["job"] == job
            and (kind is None or e["kind"] == kind)]


def job_events(cluster, job: str, kind: str) -> list[dict]:
    return [e for e in cluster.events() if e.get("type") == "job_event.v1" and e["job"] == job and e["kind"] == kind]


def wait_event(cluster, job: str, kind: str, timeout: float = 60, **match) -> dict:
    def found():
        return next((e for e in epoch_events(cluster, job, kind) if all(e.get(k) == v for k, v in match.items())),
                    None)

    event = wait_until(found, timeout=timeout, interval=0.3)
    assert event, f"no {kind} event {match} for job {job}: {epoch_events(cluster, job)}"
    return event


def epoch_steps(cluster, job: str, n: int) -> int:
    """The step the job had printed when epoch ``n`` was dumped (its output's size in the manifest)."""
    d = cluster.storage / "jobs" / job
    manifest = json.loads((d / "epochs" / str(n) / "manifest.json").read_bytes())
    log = str(d / "output.log")
    size = manifest["job_files"][log]["size"] if log in manifest.get("job_files", {}) else manifest["outputs"][log]
    return output(cluster, job)[:size].count(b"\n")


def restart(cluster, job: str, *extra: str) -> subprocess.CompletedProcess:
    return cluster.cli("checkpoint", "restart", job, *extra, check=False)


def restored_event(cluster, job: str, generation: int) -> dict:
    event = wait_until(lambda: next((e for e in job_events(cluster, job, "restored")
                                     if e["generation"] == generation), None), timeout=30, interval=0.3)
    assert event, f"no restored event for generation {generation}: {job_events(cluster, job, 'restored')}"
    return event


def checkpoints(cluster, job: str, first: int, last: int) -> None:
    """``checkpoint create`` epochs ``first`` .. ``last``, each after a few more steps (no two hold the
    same step), and each time until the epoch before it became a delta."""
    for n in range(first, last + 1):
        wait_steps(cluster, job, steps_done(cluster, job) + 4)
        cluster.cli("checkpoint", "create", job)
        if n > 1:
            wait_event(cluster, job, "converted", n=n - 1)


def stored(cluster, job: str, n: int) -> str:
    """How epoch ``n`` lies on disk: "delta" (its pages' digest lists, found in newer images and the
    packs) or "plain" (criu's images, with their digest lists once a conversion took them)."""
    names = os.listdir(cluster.storage / "jobs" / job / "epochs" / str(n))
    images = [x for x in names if x.startswith("pages-") and x.endswith(".img")]
    recipes = files_of(cluster, job).read_manifest(n).recipes
    assert bool(images) != bool(recipes), names
    return "delta" if recipes else "plain"


def files_of(cluster, job: str):
    """The job's files as the cluster's agents see them: with its image keys (revenant up's)."""
    from revenant.agent.storage import imagekeys
    from revenant.agent.storage.epochs import JobFiles

    return JobFiles(cluster.storage, job, imagekeys.load(cluster.dir / "keys" / "image.keys"))


# ------------------------------------------------------------------ 1. the chain


def test_show_job_lists_converted_epochs_with_their_own_bytes_and_the_shared_storage(make_cluster, tmp_path):
    cluster = make_cluster(1)
    job = submit(cluster, tmp_path / "wd", 32, "--incremental", "--max-epochs", "4", "--full-every", "10")
    checkpoints(cluster, job, 1, 4)
    listed = cluster.job(job)
    assert listed["policy"]["incremental"] is True and listed["policy"]["full_every"] == 10
    epochs = listed["epochs"]
    assert [e["n"] for e in epochs] == [1, 2, 3, 4]
    assert [stored(cluster, job, n) for n in (1, 2, 3, 4)] == ["delta", "delta", "delta", "plain"]
    full = epochs[-1]["bytes"]
    assert full > 32 * MIB
    # Epoch 3 became a delta after epoch 4's checkpoint replied: the listing says so now.
    assert [e["incremental"] for e in epochs] == [True, True, True, False], \
        [(e["n"], e["own_bytes"], e["incremental"]) for e in epochs]
    # The plain newest and three small deltas (what each epoch changed since): about one full image.
    assert listed["storage_bytes"] < 1.4 * full, (listed["storage_bytes"], full)
    for e in epochs[0:3]:  # a few steps of 2 % each: a small part of a full image
        assert 0 < e["own_bytes"] < 0.3 * full, (e["n"], e["own_bytes"], full)
    assert epochs[-1]["own_bytes"] >= full
    # Where each epoch's pages are: the deltas' mostly in the newest's plain images, a few in packs.
    table = json.loads(cluster.cli("job", "storage", job, "--json").stdout)
    assert table["storage_bytes"] == listed["storage_bytes"] and [e["n"] for e in table["epochs"]] == [1, 2, 3, 4]
    for e in table["epochs"][:3]:
        assert e["plain_bytes"] == 0 and 0 < e["packed_bytes"] < e["newer_bytes"], e
    newest = table["epochs"][-1]
    assert newest["plain_bytes"] > 32 * MIB and newest["packed_bytes"] == newest["newer_bytes"] == 0, newest
    text = cluster.cli("job", "storage", job).stdout
    assert "IN NEWER EPOCHS" in text and "delta" in text and "storage:" in text


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_an_older_incremental_epoch_restores_exactly_then_the_newest(make_cluster, tmp_path, compression):
    from revenant.agent.storage.chain import read_layout

    cluster = make_cluster(1)
    job = submit(cluster, tmp_path / "wd", 32, "--incremental", "--max-epochs", "4", "--full-every", "10",
                 "--pack-compression", compression)
    checkpoints(cluster, job, 1, 4)
    wait_steps(cluster, job, steps_done(cluster, job) + 4)
    cluster.cli("checkpoint", "vacate", job)  # epoch 5; epoch 1 goes (four kept)
    wait_event(cluster, job, "converted", n=4)
    vacated = cluster.job(job)
    assert vacated["state"] == "vacated" and [e["n"] for e in vacated["epochs"]] == [2, 3, 4, 5]
    assert [stored(cluster, job, n) for n in (2, 3, 4, 5)] == ["delta", "delta", "delta", "plain"]
    assert vacated["policy"]["pack_compression"] == compression
    files = files_of(cluster, job)
    assert {read_layout(files, ref).codec or "none" for ref in files.read_manifest(2).packs} == {compression}
    at_2, at_vacate = epoch_steps(cluster, job, 2), steps_done(cluster, job)
    assert at_2 + 10 < at_vacate

    # The oldest kept epoch: rebuilt from the packs, restored; its output cut back to its size.
    done = restart(cluster, job, "--epoch", "2")
    assert done.returncode == 0, done.stderr
    running = cluster.job(job)
    assert running["state"] == "running"
    assert restored_event(cluster, job, running["generation"])["epoch"] == 2
    wait_steps(cluster, job, at_2 + 8)
    assert assert_exact(output(cluster, job)) >= at_2 + 8
    assert not list((cluster.storage / "jobs" / job / "epochs").glob(".tmp-*"))  # the rebuilt images went

    # The middle ones too: each vacate adds an epoch and retention drops the oldest (3 and 4 stay).
    for n in (3, 4):
        wait_steps(cluster, job, steps_done(cluster, job) + 2)
        cluster.cli("checkpoint", "vacate", job)
        assert n in [e["n"] for e in cluster.job(job)["epochs"]]
        at_n = epoch_steps(cluster, job, n)
        done = restart(cluster, job, "--epoch", str(n))
        assert done.returncode == 0, done.stderr
        assert restored_event(cluster, job, cluster.job(job)["generation"])["epoch"] == n
        wait_steps(cluster, job, at_n + 4)
        assert assert_exact(output(cluster, job)) >= at_n + 4

    # Then the newest restorable epoch: the one the next vacate writes.
    wait_steps(cluster, job, steps_done(cluster, job) + 4)
    cluster.cli("checkpoint", "vacate", job)
    newest = cluster.job(job)["epochs"][-1]["n"]
    at_newest = epoch_steps(cluster, job, newest)
    done = restart(cluster, job)
    assert done.returncode == 0, done.stderr
    running = cluster.job(job)
    assert restored_event(cluster, job, running["generation"])["epoch"] == newest
    wait_steps(cluster, job, at_newest + 8)
    assert assert_exact(output(cluster, job)) >= at_newest + 8
    assert cluster.job(job)["state"] == "running"


# ------------------------------------------------------------------ 2. corruption


def pages_needed(cluster, job: str, n: int) -> set[tuple[str, int]]:
    """(pack, page) of every page converted epoch ``n`` reads (from its recipes)."""
    from revenant.agent.storage.chain import read_recipe, runs_of

    files = files_of(cluster, job)
    m = files.read_manifest(n)
    assert m.recipes, f"epoch {n} is not a delta"
    return {(ref, page) for name in m.recipes for ref, first, count in runs_of(read_recipe(files, m, name))
            for page in range(first, first + count)}


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_pack_page_or_newest_image_makes_restart_fall_back(make_cluster, tmp_path):
    # Eager: the corrupt newest image is refused before criu runs, so the restart itself says so
    # (a lazy restore finds it as the pages are served: tests/test_checkpoint.py, test_lazy_restore.py).
    cluster = make_cluster(1, env={"REVENANT_AGENT_RESTORE_MODE": "eager"})
    job = submit(cluster, tmp_path / "wd", 32, "--incremental", "--max-epochs", "4", "--full-every", "10")
    checkpoints(cluster, job, 1, 3)
    wait_steps(cluster, job, steps_done(cluster, job) + 4)
    cluster.cli("checkpoint", "vacate", job)  # epoch 4, plain; epoch 3 becomes a delta
    wait_event(cluster, job, "converted", n=3)
    assert [stored(cluster, job, n) for n in (1, 2, 3, 4)] == ["delta", "delta", "delta", "plain"]

    # A page of epoch 1's pack that only epoch 1 reads (the job rewrote it before epoch 2).
    needs = {n: pages_needed(cluster, job, n) for n in (1, 2, 3)}
    only_1 = sorted(p for p in needs[1] if p not in needs[2] | needs[3] and p[0].split("/")[1].startswith("1-"))
    assert only_1, "epoch 1 reads no page of its own pack that no later epoch reads"
    ref, page = only_1[len(only_1) // 2]
    seg, stem = ref.split("/")
    flip_byte(cluster.storage / "jobs" / job / "packs" / seg / f"{stem}.pack", page * 4096 + 1000)

    refused = restart(cluster, job, "--epoch", "1")
    assert refused.returncode != 0
    error = refused.stderr.strip()
    assert len(error.splitlines()) == 1, error
    assert f"page {page} of pack {ref} is corrupt" in error and "epoch 1" in error, error
    assert cluster.job(job)["state"] == "vacated"

    # A plain restart takes the newest epoch, which reads no pack.
    at_4 = epoch_steps(cluster, job, 4)
    done = restart(cluster, job)
    assert done.returncode == 0, done.stderr
    running = cluster.job(job)
    assert restored_event(cluster, job, running["generation"])["epoch"] == 4
    wait_steps(cluster, job, at_4 + 6)
    assert_exact(output(cluster, job))

    # A page of the newest epoch's image that the older ones do not read (the job changed it since
    # epoch 4) corrupt: restart falls back to the newest delta, and says why.  (A page they do
    # read takes them with it, named: tests/test_packs.py.)
    wait_steps(cluster, job, steps_done(cluster, job) + 4)
    cluster.cli("checkpoint", "vacate", job)  # epoch 5, plain; epoch 4 becomes a delta; epoch 1 goes
    wait_event(cluster, job, "converted", n=4)
    assert [e["n"] for e in cluster.job(job)["epochs"]] == [2, 3, 4, 5]
    assert stored(cluster, job, 4) == "delta" and stored(cluster, job, 5) == "plain"
    image = max((cluster.storage / "jobs" / job / "epochs" / "5").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    shared = {p for n in (2, 3, 4) for r, p in pages_needed(cluster, job, n) if r == f"@5/{image.name}"}
    own = [p for p in range(image.stat().st_size // 4096) if p not in shared]
    assert own and len(shared) > 2 * len(own), (len(own), len(shared))  # most of it is shared
    flip_byte(image, own[len(own) // 2] * 4096 + 100)
    at_4 = epoch_steps(cluster, job, 4)
    done = restart(cluster, job)
    assert done.returncode == 0, done.stderr
    assert f"epoch 5: {image.name} fails its checksum" in done.stderr, done.stderr
    running = cluster.job(job)
    restored = restored_event(cluster, job, running["generation"])
    assert restored["epoch"] == 4, restored
    assert f"epoch 5: {image.name} fails its checksum" in restored["reason"], restored
    wait_steps(cluster, job, at_4 + 8)
    assert assert_exact(output(cluster, job)) >= at_4 + 8


# ------------------------------------------------------------------ 3. storage guard


@pytest.fixture
def small_storage(tmp_path, monkeypatch):
    """The storage of the cluster make_cluster(name="cluster") starts: a 160 MiB tmpfs (request it
    before make_cluster, so it is unmounted after the cluster is down).  The nodes' health
    thresholds on free storage are lowered so the small storage does not make the node red."""
    storage = tmp_path / "cluster" / "storage"
    storage.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m,mode=0755", "tmpfs", str(storage)], check=True,
                   timeout=30)
    monkeypatch.setenv("REVENANT_AGENT_STORAGE_YELLOW_FREE_BYTES", str(2 * MIB))
    monkeypatch.setenv("REVENANT_AGENT_STORAGE_RED_FREE_BYTES", str(1 * MIB))
    yield storage
    if subprocess.run(["umount", str(storage)], capture_output=True, timeout=30).returncode != 0:
        subprocess.run(["umount", "-l", str(storage)], check=True, timeout=30)


def test_the_storage_guard_refuses_a_dump_the_storage_cannot_hold(small_storage, make_cluster, tmp_path):
    cluster = make_cluster(1)
    assert cluster.storage == small_storage
    # 48 MiB of pages and the interpreter: the first epoch fits in 160 MiB with the guard's margin
    # (64 MiB at least), a second one no longer does.
    job = submit(cluster, tmp_path / "wd", 48, "--max-epochs", "2")
    wait_steps(cluster, job, 3)
    cluster.cli("checkpoint", "create", job)
    first = cluster.job(job)["epochs"]
    assert [e["n"] for e in first] == [1]
    epoch_1 = cluster.storage / "jobs" / job / "epochs" / "1"
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in epoch_1.iterdir()}

    wait_steps(cluster, job, steps_done(cluster, job) + 2)
    refused = cluster.cli("checkpoint", "create", job, check=False)
    assert refused.returncode != 0
    error = refused.stderr.strip()
    assert len(error.splitlines()) == 1, error
    free = os.statvfs(small_storage).f_bavail * os.statvfs(small_storage).f_frsize
    assert "not enough space" in error and "bytes" in error and "free" in error and "needs" in error, error
    numbers = [int(w) for w in error.replace("(", " ").split() if w.isdigit()]
    assert any(abs(n - free) < 8 * MIB for n in numbers), (numbers, free)  # the free bytes
    assert any(n > free for n in numbers), (numbers, free)  # the needed bytes
    failed = wait_event(cluster, job, "failed")
    assert "not enough space" in failed["error"] + failed.get("reason", ""), failed

    # The job runs on, its epoch 1 untouched, nothing half written left behind.
    at = steps_done(cluster, job)
    wait_steps(cluster, job, at + 5)
    after = cluster.job(job)
    assert after["state"] == "running" and [e["n"] for e in after["epochs"]] == [1]
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in epoch_1.iterdir()} == before
    assert files_of(cluster, job).verify(1).epoch == 1
    assert sorted(os.listdir(epoch_1.parent)) == [".lock", "1"]  # nothing half-written (the job's lock file)
    assert_exact(output(cluster, job))


# ------------------------------------------------------------------ 4. pre-dump


def test_pre_dump_without_dirty_tracking_takes_full_dumps_and_says_so_once(make_cluster, tmp_path):
    cluster = make_cluster(1)
    job = submit(cluster, tmp_path / "wd", 16, "--pre-dump", "--pre-dump-delay", "0.5", "--max-epochs", "2")
    assert cluster.job(job)["policy"]["pre_dump"] is True
    for _ in range(2):
        wait_steps(cluster, job, steps_done(cluster, job) + 3)
        cluster.cli("checkpoint", "create", job)
    epochs = cluster.job(job)["epochs"]
    assert [e["n"] for e in epochs] == [1, 2]
    for n in (1, 2):  # full dumps: every page in the epoch itself, no pre-dump images, no parent
        names = os.listdir(cluster.storage / "jobs" / job / "epochs" / str(n))
        assert "pages-1.img" in names and "predump" not in names and "parent" not in names, names
    assert all(e["bytes"] > 16 * MIB for e in epochs)
    degraded = epoch_events(cluster, job, "degraded")
    assert len(degraded) == 1, degraded
    assert "mem_dirty_track" in degraded[0]["reason"], degraded
    assert len(epoch_events(cluster, job, "created")) == 2
    assert_exact(output(cluster, job))


# ------------------------------------------------------------------ 5. load-aware


# "memory 0.05 > 0.00", alone or in a list of the metrics over their thresholds ("cpu 0.97 > 0.95, memory ...").
MEMORY_OVER = re.compile(r"(^|\(|, )memory 0\.[0-9]+ > 0\.0+(,|\)|$)")


def test_load_aware_skips_periodic_checkpoints_forces_one_and_never_a_manual_one(make_cluster, tmp_path,
                                                                                monkeypatch):
    # Any memory in use is over a threshold of 0: every node is always "loaded".
    monkeypatch.setenv("REVENANT_CHECKPOINT_LOAD_THRESHOLD_MEMORY", "0")
    cluster = make_cluster(1)
    job = submit(cluster, tmp_path / "wd", 16, "--load-aware", "--checkpoint", "0:01")
    policy = cluster.job(job)["policy"]
    assert policy["load_aware"] is True and policy["load_threshold_memory"] == 0

    forced = wait_event(cluster, job, "forced", timeout=60)
    events = epoch_events(cluster, job)
    kinds = [e["kind"] for e in events]
    at = kinds.index("forced")
    assert kinds[at - 4:at] == ["skipped"] * 4, kinds
    for e in events[at - 4:at]:  # each names the metric, its value and the threshold (and any other over its own)
        assert MEMORY_OVER.search(e["reason"]), e
    assert MEMORY_OVER.search(forced["reason"]) and "4 scheduled checkpoints were skipped in a row" in \
        forced["reason"], forced
    # The forced checkpoint committed an epoch.
    created = wait_until(lambda: [e for e in epoch_events(cluster, job, "created") if e["at"] >= forced["at"]],
                         timeout=30, interval=0.3)
    assert created, epoch_events(cluster, job)
    assert cluster.job(job)["epochs"][-1]["n"] >= created[0]["n"]

    # A manual checkpoint is never skipped; its CLI warns on stderr.
    manual = manual_checkpoint(cluster, job)
    assert manual.returncode == 0, manual.stderr
    assert "warning" in manual.stderr and "over a load threshold" in manual.stderr and "memory" in manual.stderr, \
        manual.stderr
    assert re.fullmatch(r"job [0-9]+: epoch [0-9]+ committed .*\n", manual.stdout), manual.stdout


def manual_checkpoint(cluster, job: str) -> subprocess.CompletedProcess:
    """``checkpoint create``, again while a periodic one of the job is under way."""
    def once():
        done = cluster.cli("checkpoint", "create", job, check=False)
        return None if "already has a checkpoint in progress" in done.stderr else done

    done = wait_until(once, timeout=30, interval=0.1)
    assert done is not None, "the job's periodic checkpoints never left room for a manual one"
    return done
