"""The wire protocol: round trips, plain-msgpack readability, and decoders that never crash."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.messages.codec import HeartbeatViewV1

from revenant.messages import (
    MAX_MESSAGE_BYTES,
    AgentJobReply,
    AnomalyEvent,
    CheckpointJob,
    CheckpointPolicy,
    ClusterEvent,
    LocalJob,
    ReconcileReply,
    ReconcileRequest,
    StaleJob,
    EpochEvent,
    EpochInfo,
    JobEvent,
    JobGpu,
    JobRecord,
    JobReply,
    JobRequest,
    JobsReply,
    JobsRequest,
    FailoverReply,
    FailoverRequest,
    JobSpec,
    KillJob,
    SignalJob,
    NodesRequest,
    Progress,
    PurgeJob,
    CheckJob,
    RestoreJob,
    StartJob,
    SubmitRequest,
    MESSAGE_TYPES,
    Capabilities,
    CriuInfo,
    ErrorReply,
    GpuInfo,
    HealthSummary,
    Heartbeat,
    HeartbeatRequest,
    HeartbeatV1,
    HeartbeatView,
    MalformedMessage,
    MessageError,
    NodeEvent,
    NodesReply,
    NodeStatus,
    OversizedMessage,
    Probe,
    ProbeReply,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
    decode,
    decode_as,
    decode_capabilities,
    decode_heartbeat,
    encode,
    subjects,
)
from revenant.messages.codec import tag_of

pytestmark = pytest.mark.unit

CAPS = Capabilities(
    hostname="h", kernel="6.18", cpus=2, memory_total_bytes=1 << 34, revenant_version="0.1.0",
    criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True, features={"mem_dirty_track": False}),
    gpu="nvml", gpus=[GpuInfo(index=0, name="H200", uuid="GPU-1", memory_total_bytes=1 << 37, driver_version="580")],
    gpu_checkpoint="driver_api", gpu_checkpoint_why="cuCheckpointProcess* in libcuda.so.1", cuda_version=13000,
    gpu_remap=True,
)
GPUS = [JobGpu(index=0, uuid="GPU-1", name="H200", memory_bytes=1 << 33)]
HEALTH = HealthSummary(state="YELLOW", reasons=["memory 90% >= 85%"], loop_lag_s=0.01, loop_stalls=3,
                       memory_percent=90.0, storage_free_bytes=123)

SPEC = JobSpec(id="17", argv=["python3", "job.py"], name="job", workdir="/w", env={"A": "1"},
               checkpoint_interval_s=30.0, max_epochs=2, requeue=True,
               policy=CheckpointPolicy(incremental=True, full_every=5, pre_dump=True, pre_dump_delay_s=2.5,
                                       load_aware=True, load_threshold_cpu=0.9, load_threshold_io=0.6,
                                       load_threshold_memory=0.8))
JOB = JobRecord(spec=SPEC, state="running", node="node-1", pid=42, generation=2,
                epochs=[EpochInfo(n=1, bytes=4096, created_at=1.0, own_bytes=512, incremental=True),
                        EpochInfo(n=2, bytes=4096, created_at=2.0, own_bytes=4096)],
                output="/s/jobs/17/output.log", storage_bytes=4608, gpus=GPUS, gpu_driver="580.65.06")

SAMPLES = [
    Heartbeat(node="node-1", seq=7, sent_at=1.5, incarnation="abc", pid=42, capabilities=CAPS, health=HEALTH),
    HeartbeatV1(node="node-1", seq=7, sent_at=1.5, incarnation="abc", pid=42, capabilities=CAPS, health=HEALTH),
    HeartbeatRequest(sender="coordinator-1", sent_at=1.5),
    Probe(sent_at=2.0, sender="coord"),
    ProbeReply(node="node-1", incarnation="abc", seq=7, sent_at=2.1, health=HEALTH),
    NodeEvent(node="node-1", kind="dead", at=3.0, incarnation="abc", silence_s=2.5, reason="silent"),
    NodesReply(nodes=[NodeStatus(name="node-1", state="alive", capabilities=CAPS)], coordinator="c"),
    ErrorReply(code="unknown_job", message="no job 'x'", retriable=False),
    SubmitRequest(argv=["python3", "x.py"], name="x", node="node-1", checkpoint_interval_s=1800.0, max_epochs=3,
                  incremental=True, full_every=4, pre_dump=False, pre_dump_delay_s=1.5, load_aware=True),
    JobRequest(job="17", node="node-2", epoch=3),
    JobsRequest(),
    FailoverRequest(action="resume"),
    FailoverReply(paused=True, held=False, storm_acknowledged=False, silent=4, total=10, recovering=2,
                  reason="4 of 10 nodes silent at once"),
    JobReply(job=JOB, notes=["epoch 2 failed verification"], stats={"restore_time_s": 0.31}),
    JobsReply(jobs=[JOB]),
    StartJob(spec=SPEC, generation=1),
    CheckpointJob(job="17", generation=2, stop=True, scheduled=True, force=True),
    RestoreJob(spec=SPEC, generation=3, epoch=2),
    KillJob(job="17", generation=2),
    KillJob(job="17", generation=2, reason="cancelled by admin", signal=15, grace_s=10.0),
    SignalJob(job="17", generation=2, signal=10, all=True),
    PurgeJob(job="17"),
    CheckJob(job="17", generation=2),
    AgentJobReply(job="17", generation=2, node="node-1", pid=99, output="/s/jobs/17/output.log",
                  epoch=EpochInfo(n=4, bytes=10), notes=["rolled back"], storage_bytes=14,
                  epochs=[EpochInfo(n=3, bytes=10, own_bytes=4, incremental=True), EpochInfo(n=4, bytes=10)],
                  stats={"frozen_time_s": 0.41, "memory_pages_written": 51300.0}),
    Progress(job="17", op="dump", node="node-1", bytes=1 << 30, total_bytes=4 << 30, elapsed_s=3.5),
    JobEvent(job="17", kind="restored", at=5.0, node="node-2", generation=3, pid=7, epoch=4),
    EpochEvent(job="17", kind="failed", at=6.0, node="node-1", error="Error (criu/cr-dump.c:1): x"),
    EpochEvent(job="17", kind="created", at=6.2, n=3, node="node-1", gpus=GPUS, gpu_driver="580.65.06"),
    EpochEvent(job="17", kind="skipped", at=6.5, node="node-1", reason="cpu 0.97 over its threshold 0.95"),
    AnomalyEvent(node="node-1", metric="memory_percent", value=99.0, mean=40.0, std=2.0, at=7.0),
    NodesRequest(),
    ClusterEvent(kind="failover_paused", at=8.0, silent=4, total=10, reason="4 of 10 nodes silent"),
    ReconcileRequest(node="node-1", incarnation="ab12", jobs=[LocalJob(job="7", generation=2)]),
    ReconcileReply(stale=[StaleJob(job="7", generation=2, reason="superseded by generation 3 on node-2")]),
]


def test_every_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: tag_of(type(m)))
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: tag_of(type(m)))
def test_plain_msgpack_reads_every_message(msg):
    plain = msgpack.unpackb(encode(msg), raw=False)
    assert plain == msgspec.to_builtins(msg)
    assert plain["type"] == tag_of(type(msg))
    assert "." in plain["type"] and plain["type"].rsplit(".", 1)[1].startswith("v")


def test_message_written_by_plain_msgpack_decodes():
    data = msgpack.packb({"type": "heartbeat.v1", "node": "n", "seq": 1, "sent_at": 0.5, "incarnation": "i"})
    hb = decode_as(data, HeartbeatV1)
    assert hb.node == "n" and hb.health.state == "GREEN" and hb.capabilities.gpu == "none"
    slim = decode_as(msgpack.packb({"type": "heartbeat.v2", "node": "n", "seq": 2, "sent_at": 0.5,
                                    "incarnation": "i"}), Heartbeat)
    assert slim.health is None and slim.capabilities is None


def test_heartbeat_views_keep_in_step_with_the_heartbeats():
    """The coordinator's view of a heartbeat has the heartbeat's fields, only capabilities raw."""
    for view, full in ((HeartbeatView, Heartbeat), (HeartbeatViewV1, HeartbeatV1)):
        assert view.__struct_fields__ == full.__struct_fields__
        assert view.__struct_config__.tag == full.__struct_config__.tag


@pytest.mark.parametrize("hb", [
    Heartbeat(node="n", seq=3, sent_at=1.0, incarnation="i", capabilities=CAPS, health=HEALTH, leaving=True),
    Heartbeat(node="n", seq=4, sent_at=1.0, incarnation="i"),
    HeartbeatV1(node="n", seq=5, sent_at=1.0, incarnation="i", capabilities=CAPS, health=HEALTH),
])
def test_heartbeat_view_reads_what_the_full_decoder_reads(hb):
    view = decode_heartbeat(encode(hb))
    assert (view.node, view.seq, view.sent_at, view.incarnation, view.leaving) == \
        (hb.node, hb.seq, hb.sent_at, hb.incarnation, hb.leaving)
    assert view.health == hb.health
    assert decode_capabilities(view.capabilities) == hb.capabilities


def test_heartbeat_view_refuses_what_is_not_a_heartbeat():
    with pytest.raises(UnexpectedMessage, match="expected heartbeat.v2, got probe.v1"):
        decode_heartbeat(encode(Probe(sent_at=1.0)))
    with pytest.raises(MalformedMessage):
        decode_heartbeat(b"\x93\x01\x02")
    with pytest.raises(MalformedMessage, match="capabilities"):
        decode_capabilities(msgpack.packb([1, 2]))
    with pytest.raises(UnsupportedVersion, match="upgrade revenant"):
        decode_heartbeat(msgpack.packb({"type": "heartbeat.v9", "node": "n", "seq": 1, "sent_at": 0.5,
                                        "incarnation": "i"}))


def test_records_and_messages_from_before_checkpoint_policies_still_decode():
    """A job record stored, or a message sent, before policies and the new fields: every new
    field takes its default."""
    old_spec = {"id": "5", "argv": ["true"], "max_epochs": 2}
    old_epoch = {"n": 1, "bytes": 10}
    rec = msgspec.msgpack.decode(msgpack.packb({"spec": old_spec, "state": "vacated", "epochs": [old_epoch]}),
                                 type=JobRecord)
    assert rec.spec.policy == CheckpointPolicy() and rec.storage_bytes == 0
    assert (rec.epochs[0].own_bytes, rec.epochs[0].incremental) == (0, False)
    reply = decode(msgpack.packb({"type": "agent_job_reply.v1", "job": "5", "generation": 1, "node": "n",
                                  "epoch": old_epoch}))
    assert isinstance(reply, AgentJobReply) and (reply.epochs, reply.storage_bytes) == ([], 0)
    assert decode(msgpack.packb({"type": "checkpoint_job.v1", "job": "5", "generation": 1})) == \
        CheckpointJob(job="5", generation=1, stop=False, scheduled=False, force=False)
    assert decode(msgpack.packb({"type": "restore_job.v1", "spec": old_spec, "generation": 2})).epoch == 0
    assert decode(msgpack.packb({"type": "job_request.v1", "job": "5"})).epoch == 0
    old_submit = decode(msgpack.packb({"type": "submit.v1", "argv": ["true"], "max_epochs": 1}))
    assert old_submit.max_epochs == 1 and old_submit.incremental is None and old_submit.full_every is None
    assert decode(msgpack.packb({"type": "epoch_event.v1", "job": "5", "kind": "created", "at": 1.0})).reason == ""


def test_records_and_messages_from_before_gpu_checkpoints_still_decode():
    """No GPU fields: a job that holds no GPU, a node that cannot checkpoint one."""
    rec = msgspec.msgpack.decode(msgpack.packb({"spec": {"id": "5", "argv": ["true"]}}), type=JobRecord)
    assert (rec.gpus, rec.gpu_driver) == ([], "")
    ev = decode(msgpack.packb({"type": "epoch_event.v1", "job": "5", "kind": "created", "at": 1.0, "n": 2}))
    assert (ev.gpus, ev.gpu_driver) == ([], "")
    hb = decode(msgpack.packb({"type": "heartbeat.v1", "node": "n", "seq": 1, "sent_at": 0.5, "incarnation": "i",
                               "capabilities": {"gpu": "nvml", "gpus": [{"index": 0, "uuid": "GPU-1"}]}}))
    caps = hb.capabilities
    assert (caps.gpu_checkpoint, caps.gpu_checkpoint_why, caps.cuda_version, caps.gpu_remap) == ("none", "", 0, False)
    # A JobGpu's memory is optional; its model and UUID are not.
    assert msgspec.msgpack.decode(msgpack.packb({"index": 1, "uuid": "GPU-2", "name": "H200"}),
                                  type=JobGpu).memory_bytes == 0
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgpack.packb({"index": 1}), type=JobGpu)


@pytest.mark.parametrize("kind", ["created", "failed", "pruned", "skipped", "degraded", "forced", "converted"])
def test_every_epoch_event_kind_round_trips(kind):
    ev = EpochEvent(job="5", kind=kind, at=1.0, n=2, bytes=7, reason="why")
    assert decode(encode(ev)) == ev


def test_unknown_fields_from_a_newer_sender_are_ignored():
    data = msgpack.packb({"type": "probe.v1", "sent_at": 1.0, "future_field": [1, 2]})
    assert decode(data) == Probe(sent_at=1.0)


@pytest.mark.parametrize(
    "data, error",
    [
        (b"", MalformedMessage),
        (b"\xc1", MalformedMessage),
        (msgpack.packb([1, 2]), MalformedMessage),
        (msgpack.packb({"node": "x"}), MalformedMessage),
        (msgpack.packb({"type": 5}), MalformedMessage),
        (msgpack.packb({"type": "launch_missiles.v1"}), UnknownMessageType),
        (msgpack.packb({"type": "heartbeat.v9"}), UnsupportedVersion),
        (msgpack.packb({"type": "heartbeat.v1", "node": "n", "seq": "seven", "sent_at": 0.0, "incarnation": "i"}),
         MalformedMessage),
        (msgpack.packb({"type": "heartbeat.v1"}), MalformedMessage),
    ],
)
def test_bad_messages_raise_typed_errors(data, error):
    with pytest.raises(error) as info:
        decode(data)
    assert str(info.value)
    assert "\n" not in str(info.value)


def test_newer_version_error_says_to_upgrade():
    with pytest.raises(UnsupportedVersion, match="upgrade revenant"):
        decode(msgpack.packb({"type": "heartbeat.v3"}))


def test_oversized_is_refused_both_ways():
    with pytest.raises(OversizedMessage):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    huge = ErrorReply(code="x", message="y" * MAX_MESSAGE_BYTES)
    with pytest.raises(OversizedMessage):
        encode(huge)


def test_decode_as_rejects_the_wrong_type():
    with pytest.raises(UnexpectedMessage, match="expected heartbeat.v2, got probe.v1"):
        decode_as(encode(Probe(sent_at=1.0)), Heartbeat)


# ------------------------------------------------------------------------ fuzzing

def _decodes_or_typed_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except MessageError:
        return
    assert type(msg) in MESSAGE_TYPES


@settings(max_examples=examples(400), deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    _decodes_or_typed_error(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
known_tags = st.sampled_from([tag_of(t) for t in MESSAGE_TYPES] + ["heartbeat.v2", "x.v1", "", "heartbeat"])


@settings(max_examples=examples(400), deadline=None)
@given(known_tags, st.dictionaries(st.text(max_size=15), msgpack_values, max_size=8))
def test_fuzz_maps_with_real_tags(tag, fields):
    _decodes_or_typed_error(msgpack.packb({**fields, "type": tag}, use_bin_type=True))


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_mutated_valid_messages(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _decodes_or_typed_error(bytes(raw))


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_truncated_valid_messages(msg, data):
    raw = encode(msg)
    _decodes_or_typed_error(raw[: data.draw(st.integers(0, len(raw) - 1))])


# ------------------------------------------------------------------------ subjects

def test_subjects_put_the_node_in_one_token():
    assert subjects.heartbeat("node-1") == "revenant.hb.node-1"
    assert subjects.probe("node-1") == "revenant.node.node-1.probe"
    assert subjects.node_event("node-1", "dead") == "revenant.evt.node.node-1.dead"
    assert subjects.node_from_heartbeat("revenant.hb.node-1") == "node-1"
    assert subjects.node_from_heartbeat("revenant.hb.a.b") is None
    assert subjects.node_event("n", "dead").startswith(subjects.EVENTS_PREFIX + ".")


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "-x", "x" * 64, "nöde"])
def test_bad_node_names_are_refused(bad):
    with pytest.raises(subjects.InvalidName):
        subjects.heartbeat(bad)


def test_messages_package_is_pure():
    import ast
    import pathlib

    import revenant.messages as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                root = name.split(".")[0]
                assert root not in {"nats", "asyncio", "socket", "subprocess", "os", "psutil"}, (path.name, name)
