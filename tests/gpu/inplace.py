"""In-place CUDA checkpoint and restore of a process, timed, with no CRIU.

First the machine's pinned-copy bandwidth (cuMemAllocHost + cuMemcpyDtoH/HtoD of a large
buffer); then, for each size, a child process allocates that much device memory and fills
it with a pattern per GiB (cuMemsetD32), and this process times
    d2h: cuCheckpointProcessLock (timeoutMs 10000) + cuCheckpointProcessCheckpoint
    h2d: cuCheckpointProcessRestore + cuCheckpointProcessUnlock
reading cuCheckpointProcessGetState after each step; the child then copies sampled regions
back and compares them with the pattern, and checks that the GPU still works.

    python3 tests/gpu/inplace.py [--sizes 1,8,32] [--json PATH] [--libcuda libcuda.so.1]

Exit status: 0 when every size that ran was verified, 1 when one was not, 2 when there is
no usable GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cudrv import CudaError, Driver  # noqa: E402

GIB = 1 << 30
SAMPLE = 1 << 20  # bytes compared per sample
RATIO_TARGET = 0.5
CHILD_READY_S = 300.0
CHILD_VERIFY_S = 120.0


def pattern(chunk: int) -> int:
    return (0xA5000000 + chunk * 0x010101) & 0xFFFFFFFF


# ---------------------------------------------------------------------- child processes
def child_bandwidth(libcuda: str, nbytes: int) -> dict:
    drv = Driver(libcuda)
    dev = drv.init(0)
    out = {"name": drv.device_name(dev), "total_bytes": drv.total_mem(dev)}
    out["free_bytes"] = drv.mem_info()[0]
    dptr, host = drv.alloc(nbytes), drv.alloc_host(nbytes)
    drv.memset32(dptr, 0x12345678, nbytes // 4)
    drv.synchronize()
    for name, copy in (("d2h", lambda: drv.dtoh(host, dptr, nbytes)), ("h2d", lambda: drv.htod(dptr, host, nbytes))):
        copy()  # warm-up
        best = min(_timed(copy) for _ in range(3))
        out[f"{name}_gbps"] = nbytes / best / 1e9
    out["bytes"] = nbytes
    drv.free_host(host)
    drv.free(dptr)
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def child_hold(libcuda: str, nbytes: int) -> int:
    """Allocate and fill, say READY, wait for VERIFY on stdin, then check and say VERIFIED."""
    drv = Driver(libcuda)
    drv.init(0)
    chunks = []
    left = nbytes
    while left > 0:
        n = min(GIB, left)
        chunks.append((drv.alloc(n), n))
        left -= n
    for i, (dptr, n) in enumerate(chunks):
        drv.memset32(dptr, pattern(i), n // 4)
    drv.synchronize()
    print(f"READY {nbytes} {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "VERIFY":
        return 3
    buf = (ctypes.c_uint8 * SAMPLE)()
    bad = []
    for i, (dptr, n) in enumerate(chunks):
        want = pattern(i).to_bytes(4, "little") * (SAMPLE // 4)
        for off in sorted({0, (n // 2) & ~3, n - SAMPLE}):
            drv.dtoh(ctypes.addressof(buf), dptr + off, SAMPLE)
            if bytes(buf) != want:
                bad.append(f"chunk {i} offset {off}")
    # The GPU still works after the restore: a new allocation, filled and read back.
    probe = drv.alloc(SAMPLE)
    drv.memset32(probe, 0xC0FFEE, SAMPLE // 4)
    drv.dtoh(ctypes.addressof(buf), probe, SAMPLE)
    if bytes(buf) != (0xC0FFEE).to_bytes(4, "little") * (SAMPLE // 4):
        bad.append("a new allocation after the restore reads back wrong")
    print("VERIFIED ok" if not bad else "VERIFIED bad " + "; ".join(bad[:10]), flush=True)
    return 0


# ---------------------------------------------------------------------- the parent
def run_child(args: list[str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise TimeoutError(f"no answer from the child within {timeout:g} s")
    return proc.stdout.readline().strip()


def one_size(drv: Driver, libcuda: str, gib: int, pinned: dict) -> dict:
    r: dict = {"size_gib": gib, "bytes": gib * GIB, "status": "failed", "verified": False, "errors": [],
               "states": {}}
    free = pinned.get("free_bytes", 0)
    if free and gib * GIB > free - GIB:
        r.update(status="skipped", skip_reason=f"the GPU has {free / GIB:.1f} GiB free, too little for {gib} GiB")
        return r
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-hold", str(gib * GIB),
                             "--libcuda", libcuda], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid = proc.pid
    locked = checkpointed = False
    try:
        t = time.perf_counter()
        line = read_line(proc, CHILD_READY_S)
        if not line.startswith("READY"):
            raise RuntimeError(f"child: {line or proc.stderr.read().strip()}")
        r["fill_s"] = time.perf_counter() - t
        r["states"]["before"] = drv.get_state(pid)
        r["lock_s"] = _timed(lambda: drv.lock(pid, 10000))
        locked = True
        r["states"]["after_lock"] = drv.get_state(pid)
        r["checkpoint_s"] = _timed(lambda: drv.checkpoint(pid))
        checkpointed = True
        r["states"]["after_checkpoint"] = drv.get_state(pid)
        r["restore_s"] = _timed(lambda: drv.restore(pid))
        checkpointed = False
        r["states"]["after_restore"] = drv.get_state(pid)
        r["unlock_s"] = _timed(lambda: drv.unlock(pid))
        locked = False
        r["states"]["after_unlock"] = drv.get_state(pid)
        want = {"before": "running", "after_lock": "locked", "after_checkpoint": "checkpointed",
                "after_restore": "locked", "after_unlock": "running"}
        for step, state in want.items():
            if r["states"][step] != state:
                r["errors"].append(f"state {step}: {r['states'][step]}, expected {state}")
        r["d2h_s"] = r["lock_s"] + r["checkpoint_s"]
        r["h2d_s"] = r["restore_s"] + r["unlock_s"]
        r["d2h_gbps"] = r["bytes"] / r["d2h_s"] / 1e9
        r["h2d_gbps"] = r["bytes"] / r["h2d_s"] / 1e9
        if pinned.get("d2h_gbps"):
            r["d2h_ratio"] = r["d2h_gbps"] / pinned["d2h_gbps"]
            r["ratio_ok"] = r["d2h_ratio"] >= RATIO_TARGET
        proc.stdin.write("VERIFY\n")
        proc.stdin.flush()
        line = read_line(proc, CHILD_VERIFY_S)
        r["verified"] = line == "VERIFIED ok"
        if not r["verified"]:
            r["errors"].append(f"child: {line or proc.stderr.read().strip()}")
        r["status"] = "ok" if r["verified"] and not r["errors"] else "failed"
    except (CudaError, RuntimeError, TimeoutError, OSError) as exc:
        r["errors"].append(str(exc))
        try:
            r["states"]["at_error"] = drv.get_state(pid)
        except CudaError as e2:
            r["states"]["at_error"] = str(e2)
        # Leave the child runnable before it is killed, so the driver can clean up.
        for needed, step in ((checkpointed, drv.restore), (locked, drv.unlock)):
            if needed:
                try:
                    step(pid)
                except CudaError as e3:
                    r["errors"].append(f"cleanup: {e3}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return r


def report(out: dict) -> str:
    p = out.get("pinned", {})
    lines = [f"driver {out.get('driver_version')}  GPU {p.get('name', '?')}  "
             f"{p.get('total_bytes', 0) / GIB:.1f} GiB (free {p.get('free_bytes', 0) / GIB:.1f})",
             f"pinned copy: d2h {p.get('d2h_gbps', 0):.1f} GB/s  h2d {p.get('h2d_gbps', 0):.1f} GB/s"
             + (f"  ERROR {p['error']}" if p.get("error") else ""),
             f"{'size':>6} {'d2h s':>8} {'GB/s':>7} {'h2d s':>8} {'GB/s':>7} {'ratio':>6} {'verified':>8}  status"]
    for r in out["runs"]:
        if "d2h_s" in r:
            lines.append(f"{r['size_gib']:>4}Gi {r['d2h_s']:8.3f} {r['d2h_gbps']:7.2f} {r['h2d_s']:8.3f} "
                         f"{r['h2d_gbps']:7.2f} {r.get('d2h_ratio', 0):6.2f} {'yes' if r['verified'] else 'no':>8}"
                         f"  {r['status']}")
        else:
            lines.append(f"{r['size_gib']:>4}Gi {'-':>8} {'-':>7} {'-':>8} {'-':>7} {'-':>6} "
                         f"{'yes' if r['verified'] else 'no':>8}  {r['status']} {r.get('skip_reason', '')}")
        lines += [f"       error: {e}" for e in r["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,8,32", help="GiB, comma-separated (default 1,8,32)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--libcuda", default="libcuda.so.1")
    p.add_argument("--bandwidth-gib", type=int, default=2, help="buffer for the pinned-copy bandwidth")
    p.add_argument("--child-hold", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-bandwidth", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        if args.child_hold:
            return child_hold(args.libcuda, args.child_hold)
        if args.child_bandwidth:
            print(json.dumps(child_bandwidth(args.libcuda, args.child_bandwidth)))
            return 0
    except (OSError, CudaError) as exc:
        print(f"inplace: {exc}", file=sys.stderr)
        return 1
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    out: dict = {"libcuda": args.libcuda, "ratio_target": RATIO_TARGET, "runs": []}
    try:
        drv = Driver(args.libcuda)
        out["driver_version"] = drv.driver_version()
    except (OSError, CudaError) as exc:
        out["error"] = f"no usable CUDA driver: {exc}"
        print(f"inplace: {out['error']}", file=sys.stderr)
        _write(args.json, out)
        return 2
    try:
        out["pinned"] = run_child(["--child-bandwidth", str(args.bandwidth_gib * GIB), "--libcuda", args.libcuda],
                                  CHILD_READY_S)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        out["pinned"] = {"error": str(exc)}
    for gib in sizes:
        out["runs"].append(one_size(drv, args.libcuda, gib, out["pinned"]))
        _write(args.json, out)
        last = out["runs"][-1]
        print(f"inplace: {gib} GiB: {last['status']} {'; '.join(last['errors'])}", flush=True)
    print(report(out))
    _write(args.json, out)
    ran = [r for r in out["runs"] if r["status"] != "skipped"]
    return 0 if ran and all(r["verified"] and not r["errors"] for r in ran) else 1


def _write(path: str | None, out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
