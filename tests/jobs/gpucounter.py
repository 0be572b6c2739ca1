"""A fake CUDA application for tests: a UDP counter whose value lives in fake GPU memory.

    python3 gpucounter.py --port P [--device-mib N] [--children K] [--cpu]

"cuInit" registers the process with the fake driver in $REVENANT_FAKEGPU_DIR (tests/fakegpu)
and puts the counter (100) and N MiB of payload in device memory on the first configured GPU:
the file <dir>/gpu-<uuid>/<ctx>.mem.  Each datagram on 127.0.0.1:P is a kernel: it increments
the counter, replies "<value>\\n" and prints the value.  "peek" replies the value unchanged,
"hang" starts a kernel that never finishes (a lock then times out), "unhang" ends it.
A datagram may carry a request id after the command ("inc 7f3a..."): a retried request (its
answer lost, or the request dropped from the socket's queue by a restore: criu keeps no UDP
queue) is answered again, never run twice (tests/fakegpu.counter_request retries so).
--children K starts K more CUDA processes (ports P+1..P+K), each its own context.  --cpu: the same counter in host memory, no GPU at all (a control).

The thread "cuda-restore" is the in-process half of the fake driver, as the real driver keeps
a process's CUDA state inside the process: it serves the fake libcuda's requests from
<dir>/ctx/<ctx>/ (req-<id> -> resp-<id>) and runs the state machine running -lock-> locked
-checkpoint-> checkpointed -restore-> locked -unlock-> running.  Checkpoint copies device memory
into this process and deletes the file (the GPU is released); restore writes it back, under the
remapped GPU UUID if asked.  So the state survives criu: a restored process comes back
checkpointed, with its device memory in its own pages.  Only Python's standard library is used.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid as uuidlib

SUCCESS, INVALID_VALUE, NO_DEVICE, ILLEGAL_STATE, TIMEOUT = 0, 1, 100, 401, 909
STATES = ("running", "locked", "checkpointed", "failed")
POLL_S = 0.005


def configured_gpus(state_dir: str) -> list[str]:
    """The UUIDs of the fake GPUs, in index order (lines "gpu <uuid> <bytes> <name>")."""
    try:
        with open(os.path.join(state_dir, "config")) as f:
            return [ln.split()[1] for ln in f if ln.startswith("gpu ") and len(ln.split()) > 1]
    except FileNotFoundError:
        return []


class FakeDriver:
    """This process's CUDA context: its state, its device memory, its kernels in flight."""

    def __init__(self, state_dir: str, ctx: str, device_mib: int) -> None:
        self.dir, self.ctx, self.device_mib = state_dir, ctx, device_mib
        self.cdir = os.path.join(state_dir, "ctx", ctx)
        self.cond = threading.Condition()
        self.state = "running"
        self.locking = False  # a lock waits for the kernels in flight: no new launches
        self.kernels = 0
        self.host_copy: bytes | None = None  # device memory while checkpointed
        self.uuid = ""

    def mem_path(self, uuid: str | None = None) -> str:
        return os.path.join(self.dir, f"gpu-{uuid or self.uuid}", f"{self.ctx}.mem")

    def cu_init(self) -> None:
        gpus = configured_gpus(self.dir)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:  # as the CUDA runtime reads it: the GPUs named (by UUID), in that order
            gpus = [u for u in (v.strip() for v in visible.split(",")) if u in gpus]
        if not gpus:
            sys.exit(f"gpucounter: cuInit failed: CUDA_ERROR_NO_DEVICE (no GPU configured in {self.dir})")
        self.uuid = gpus[0]
        os.makedirs(self.cdir, exist_ok=True)
        payload = bytes(range(256)) * (self.device_mib * 4096)
        self._write_mem(self.uuid, struct.pack("<q", 100) + payload)
        threading.Thread(target=self._serve, name="cuda-restore", daemon=True).start()

    def _write_mem(self, uuid: str, data: bytes) -> None:
        path = self.mem_path(uuid)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------ the application's side

    def launch(self, delta: int) -> int:
        """A kernel adding delta to the counter (0: a plain memcpy); waits while CUDA is locked."""
        with self.cond:
            while self.state != "running" or self.locking:
                self.cond.wait()
            self.kernels += 1
        try:
            with open(self.mem_path(), "r+b") as f:
                value = struct.unpack("<q", f.read(8))[0] + delta
                if delta:
                    f.seek(0)
                    f.write(struct.pack("<q", value))
            return value
        finally:
            with self.cond:
                self.kernels -= 1
                self.cond.notify_all()

    def hang(self, on: bool) -> None:
        """Start (or end) a kernel that never finishes by itself."""
        with self.cond:
            while on and (self.state != "running" or self.locking):
                self.cond.wait()
            self.kernels += 1 if on else -1
            self.cond.notify_all()

    # ------------------------------------------------------------ the driver's side

    def _serve(self) -> None:
        try:  # the name the fake libcuda looks for (cuCheckpointProcessGetRestoreThreadId); prctl, as
            # /proc/self/task/<tid> does not exist where /proc is not this PID namespace's
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(b"cuda-restore"), 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        while True:
            try:
                names = sorted(n for n in os.listdir(self.cdir) if n.startswith("req-"))
            except FileNotFoundError:  # restored where the state dir was not yet set up
                os.makedirs(self.cdir, exist_ok=True)
                names = []
            for name in names:
                self._answer(name[len("req-"):])
            time.sleep(POLL_S)

    def _answer(self, rid: str) -> None:
        claimed = os.path.join(self.cdir, f".claimed-{rid}")
        try:  # claim it: a caller that gave up has removed it, and must never see it acted on
            os.rename(os.path.join(self.cdir, f"req-{rid}"), claimed)
            with open(claimed) as f:
                words = f.read().split()
            os.unlink(claimed)
        except FileNotFoundError:
            return
        try:
            code = self.request(words)
        except Exception as exc:  # a bug in the fake: answer rather than leave the caller waiting
            print(f"gpucounter: fake driver failed on {words}: {exc!r}", file=sys.stderr, flush=True)
            code = 999
        tmp = os.path.join(self.cdir, f".resp-{rid}")
        with open(tmp, "w") as f:
            f.write(f"{code} {self.state}\n")
        os.rename(tmp, os.path.join(self.cdir, f"resp-{rid}"))

    def request(self, words: list[str]) -> int:
        op, args = (words[0], words[1:]) if words else ("", [])
        with self.cond:
            if op == "state":
                return SUCCESS
            if op == "lock":
                return self._lock(int(args[0]) if args else 0)
            if op == "checkpoint":
                return self._checkpoint() if self.state == "locked" else ILLEGAL_STATE
            if op == "restore":
                if self.state != "checkpointed":
                    return ILLEGAL_STATE
                return self._restore(dict(a.split("=", 1) for a in args if "=" in a))
            if op == "unlock":
                if self.state != "locked":
                    return ILLEGAL_STATE
                self.state = "running"
                self.cond.notify_all()
                return SUCCESS
            if op == "force" and args and args[0] in STATES:
                return self._force(args[0])
        return INVALID_VALUE

    def _lock(self, timeout_ms: int) -> int:
        if self.state != "running":
            return ILLEGAL_STATE
        self.locking = True
        done = self.cond.wait_for(lambda: self.kernels == 0, timeout_ms / 1000 if timeout_ms else None)
        self.locking = False
        if not done:
            self.cond.notify_all()
            return TIMEOUT
        self.state = "locked"
        return SUCCESS

    def _checkpoint(self) -> int:
        with open(self.mem_path(), "rb") as f:
            self.host_copy = f.read()
        os.unlink(self.mem_path())
        self.state = "checkpointed"
        return SUCCESS

    def _restore(self, remap: dict[str, str]) -> int:
        if remap and self.uuid not in remap:
            return INVALID_VALUE  # as NVIDIA documents it: the pairs must name every checkpointed GPU
        target = remap.get(self.uuid, self.uuid)
        if target not in configured_gpus(self.dir):
            return NO_DEVICE  # the GPU it was on is not here, and no remap names one that is
        assert self.host_copy is not None
        self._write_mem(target, self.host_copy)
        self.uuid, self.host_copy, self.state = target, None, "locked"
        return SUCCESS

    def _force(self, state: str) -> int:
        """Failure injection: leave the process in ``state``, moving its memory to match."""
        if state == "checkpointed" and self.host_copy is None:
            self._checkpoint()
        elif state in ("running", "locked") and self.host_copy is not None:
            self._write_mem(self.uuid, self.host_copy)
            self.host_copy = None
        self.state = state
        self.cond.notify_all()
        return SUCCESS


class HostCounter:
    """--cpu: the same protocol with the counter in host memory."""

    def __init__(self) -> None:
        self.value = 100

    def launch(self, delta: int) -> int:
        self.value += delta
        return self.value

    def hang(self, on: bool) -> None:
        pass


def own_context() -> None:
    """Give this process a CUDA context id of its own, in its environment where the fake libcuda
    reads it (/proc/<pid>/environ): an inherited one belongs to the parent, so exec again."""
    if os.environ.get("REVENANT_FAKEGPU_CTX_PID") == str(os.getpid()) and os.environ.get("REVENANT_FAKEGPU_CTX"):
        return
    env = {**os.environ, "REVENANT_FAKEGPU_CTX": uuidlib.uuid4().hex, "REVENANT_FAKEGPU_CTX_PID": str(os.getpid())}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def start_children(args: argparse.Namespace) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVENANT_FAKEGPU_CTX")}
    env["GPUCOUNTER_CHILD"] = "1"
    extra = ["--cpu"] if args.cpu else []
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--port", str(args.port + i),
                              "--device-mib", str(args.device_mib), *extra], env=env)
            for i in range(1, args.children + 1)]


def udp_requests(port: int):
    """(command, reply) pairs from datagrams on 127.0.0.1:port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    yield None  # bound: ready
    while True:
        data, peer = sock.recvfrom(4096)
        yield data.strip().decode(errors="replace"), lambda text, peer=peer: sock.sendto(f"{text}\n".encode(), peer)


def main() -> None:
    parser = argparse.ArgumentParser(description="a fake CUDA counter served over UDP")
    parser.add_argument("--port", type=int, required=True, help="serve UDP datagrams on 127.0.0.1:PORT")
    parser.add_argument("--device-mib", type=int, default=1)
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="no GPU: the counter in host memory")
    args = parser.parse_args()
    if os.environ.get("GPUCOUNTER_CHILD"):
        try:  # die with the parent, as its CUDA workers would
            import ctypes
            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    state_dir = os.environ.get("REVENANT_FAKEGPU_DIR", "")
    if not args.cpu and not state_dir:
        sys.exit("gpucounter: cuInit failed: CUDA_ERROR_NO_DEVICE (REVENANT_FAKEGPU_DIR is not set: "
                 "no fake GPU; use --cpu for a CPU-only run)")
    if not args.cpu:
        own_context()
    requests = udp_requests(args.port)
    next(requests)
    if args.cpu:
        device: FakeDriver | HostCounter = HostCounter()
    else:
        device = FakeDriver(state_dir, os.environ["REVENANT_FAKEGPU_CTX"], args.device_mib)
        device.cu_init()
    start_children(args)
    print(f"gpucounter: ready on port {args.port}", file=sys.stderr, flush=True)
    answered: dict[str, str] = {}  # request id -> its answer (the latest few)
    for said, reply in requests:
        cmd, _, rid = said.partition(" ")
        if rid and rid in answered:
            reply(answered[rid])
            continue
        if cmd in ("hang", "unhang"):
            device.hang(cmd == "hang")
            reply(cmd)
            continue
        value = device.launch(0 if cmd == "peek" else 1)
        if cmd != "peek":
            print(value, flush=True)
        if rid:
            answered[rid] = str(value)
            while len(answered) > 64:
                answered.pop(next(iter(answered)))
        reply(str(value))


if __name__ == "__main__":
    main()
