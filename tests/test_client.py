"""The Python client (revenant.client) against a real cluster: every verb, idempotent submits,
errors with the protocol's code, the event stream resumed where it left off, the synchronous
facade; and docs/client.md's examples, run as they are."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import COUNTER, REPO, wait_until
from revenant.client import Client, ClientError, SyncClient
from revenant.messages import EpochEvent

pytestmark = [pytest.mark.cluster, pytest.mark.criu]


def counter(name: str) -> dict:
    return {"argv": [sys.executable, str(COUNTER), "100000", "0.02"], "name": name, "node": "node-1"}


def test_every_verb_through_the_client_and_its_errors_and_events(make_cluster, tmp_path):
    cluster = make_cluster(2)

    async def scenario() -> str:
        async with Client.connect(cluster_dir=str(cluster.dir)) as rv:
            assert sorted(n.name for n in await rv.nodes()) == ["node-1", "node-2"]
            rec = await rv.submit(**counter("low-counter"), workdir=str(tmp_path), request_id="r-1", max_epochs=2)
            assert (rec.state, rec.node, rec.spec.name) == ("running", "node-1", "low-counter") and rec.program_pid
            again = await rv.submit(**counter("low-counter"), workdir=str(tmp_path), request_id="r-1", max_epochs=2)
            assert again.spec.id == rec.spec.id  # the same request makes one job
            job = rec.spec.id
            assert [r.spec.id async for r in rv.jobs()] == [job]
            assert (await rv.job(job)).generation == 1
            first = await rv.checkpoint(job)
            assert [e.n for e in first.job.epochs] == [1] and first.stats
            seen = [ev async for ev in rv.events(jobs=[job], follow=False)]
            assert {"submitted", "started"} <= {ev.kind for ev in seen}
            created = [ev async for ev in rv.events(jobs=[job], kinds=["created"], follow=False)]
            assert [(type(ev.message), ev.message.n) for ev in created] == [(EpochEvent, 1)]
            # Resumed after the last event seen: only what came since.
            stream = rv.events(since=created[-1].seq + 1, jobs=[job], kinds=["created"], follow=False)
            assert [ev async for ev in stream] == []
            await rv.checkpoint(job)
            later = [ev.message.n async for ev in rv.events(since=created[-1].seq + 1, kinds=["created"],
                                                              follow=False)]
            assert later == [2]
            for call, code in ((rv.job("9999"), "unknown_job"), (rv.cancel(job, signal="NOPE"), "bad_request"),
                               (rv.restart(job), "bad_state")):
                with pytest.raises(ClientError) as failed:
                    await call
                assert failed.value.code == code and "\n" not in str(failed.value)
            assert not (await rv.failover.status()).paused
            assert (await rv.cancel(job, signal="KILL", grace=0)).job.state == "cancelled"
            return job

    job = asyncio.run(scenario())
    with SyncClient.connect(cluster_dir=str(cluster.dir)) as rv:
        assert rv.job(job).state == "cancelled" and [r.spec.id for r in rv.jobs()] == [job]
        assert rv.restart(job, node="node-2").job.state == "running"
        rv.cancel(job, grace=0, signal="KILL")
    with pytest.raises(ClientError) as refused:
        SyncClient.connect(nats="nats://127.0.0.1:1", creds="", timeout=1)
    assert refused.value.retriable


def examples() -> dict[str, str]:
    doc = (REPO / "docs" / "client.md").read_text()
    return dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", doc, re.S))


def run_example(cluster, name: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(examples()[name])
    doc = json.loads((cluster.dir / "cluster.json").read_text())
    env = {**os.environ, "REVENANT_NATS": doc["nats_url"], "REVENANT_CREDS": doc.get("creds", "")}
    out = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_the_documented_examples_run_against_a_real_cluster(make_cluster, tmp_path):
    assert sorted(examples()) == ["epochs_csv.py", "vacate_low.py"]
    cluster = make_cluster(2)
    low = cluster.cli("submit", "--name", "low-batch", "--node", "node-1", "--", sys.executable, str(COUNTER),
                      "100000", "0.02").stdout.strip()
    keep = cluster.cli("submit", "--name", "urgent", "--node", "node-2", "--", sys.executable, str(COUNTER),
                       "100000", "0.02").stdout.strip()
    assert wait_until(lambda: cluster.job(low)["state"] == "running" and cluster.job(keep)["state"] == "running",
                      timeout=30)
    said = run_example(cluster, "vacate_low.py", tmp_path).stdout
    assert said == f"job {low} (low-batch) vacated at epoch 1\n"
    assert (cluster.job(low)["state"], cluster.job(keep)["state"]) == ("vacated", "running")

    def rows() -> list[list[str]]:
        with open(tmp_path / "epochs.csv", newline="") as f:
            return list(csv.reader(f))

    run_example(cluster, "epochs_csv.py", tmp_path)
    assert [(r[1], r[2], r[3]) for r in rows()] == [(low, "1", "node-1")]
    run_example(cluster, "epochs_csv.py", tmp_path)  # from where it stopped: nothing twice
    assert len(rows()) == 1
    cluster.cli("checkpoint", "create", keep)
    run_example(cluster, "epochs_csv.py", tmp_path)
    assert [(r[1], r[2]) for r in rows()] == [(low, "1"), (keep, "1")]
