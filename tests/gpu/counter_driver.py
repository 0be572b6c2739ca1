"""NVIDIA's counter example (tests/gpu/counter.cu) through the CUDA driver API only, for a
machine without nvcc: every UDP packet to 127.0.0.1:PORT runs a kernel that increments a
device counter starting at 100, and the new value goes back as "%d\\n" and to stdout.

The kernel is hand-written PTX, JIT-compiled by the driver (cuModuleLoadData).

    python3 tests/gpu/counter_driver.py [PORT] [--device-mib N]
    python3 tests/gpu/counter_driver.py --poll FILE     (no socket: each byte appended to
        FILE is a packet, answered on stdout only; CRIU 4.1 cannot dump an INET socket on
        Linux >= 6.16, which refuses SO_PASSCRED there)

--device-mib N also allocates N MiB of device memory and fills it (cuMemsetD32), so that a
checkpoint has that much to move; a packet "verify" then reads 256 words spread over it back
and answers "verified N MiB" or "corrupt at OFFSET: VALUE" (the counter is left alone).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cudrv import CudaError, Driver  # noqa: E402

PTX = """\
.version 6.0
.target sm_50
.address_size 64

.visible .global .align 4 .u32 counter = 100;

.visible .entry increment()
{
    .reg .u32 %r<2>;

    ld.global.u32 %r1, [counter];
    add.u32 %r1, %r1, 1;
    st.global.u32 [counter], %r1;
    ret;
}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("port", nargs="?", type=int, default=10000)
    p.add_argument("--device-mib", type=int, default=0, help="also hold N MiB of filled device memory")
    p.add_argument("--libcuda", default="libcuda.so.1")
    p.add_argument("--poll", metavar="FILE", help="no socket: answer each byte appended to FILE")
    p.add_argument("--cpu", action="store_true", help="no GPU: keep the counter in host memory (a dry run)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"bad port {args.port}")
    if args.cpu:
        return serve(args.port, None, args.poll)
    try:
        drv = Driver(args.libcuda)
        drv.init(0)
        mod = drv.load_ptx(PTX)
        fn = drv.function(mod, "increment")
        counter, _size = drv.global_(mod, "counter")
        big = None
        if args.device_mib > 0:
            nbytes = args.device_mib << 20
            big = (drv.alloc(nbytes), nbytes)
            drv.memset32(big[0], FILL, nbytes // 4)
            drv.synchronize()
    except (OSError, CudaError) as exc:
        print(f"counter_driver: {exc}", file=sys.stderr)
        return 1
    try:
        return serve(args.port, (drv, fn, counter), args.poll, big)
    except CudaError as exc:
        print(f"counter_driver: {exc}", file=sys.stderr, flush=True)
        return 1


def next_value(gpu: tuple[Driver, int, int] | None, value: ctypes.c_uint32) -> int:
    """The counter incremented: on the GPU, or (gpu None) in host memory."""
    if gpu is None:
        value.value += 1
    else:
        drv, fn, counter = gpu
        drv.launch1(fn)
        drv.dtoh(ctypes.addressof(value), counter, 4)
    return value.value


FILL = 0x5EED5EED


def verify(drv: Driver, big: tuple[int, int] | None) -> bytes:
    """Read 256 words spread over the filled device memory back: the answer to "verify"."""
    if big is None:
        return b"nothing to verify\n"
    ptr, nbytes = big
    word = ctypes.c_uint32(0)
    for i in range(256):
        offset = (nbytes // 4 - 1) * i // 255 * 4
        drv.dtoh(ctypes.addressof(word), ptr + offset, 4)
        if word.value != FILL:
            return b"corrupt at %d: %#x\n" % (offset, word.value)
    return b"verified %d MiB\n" % (nbytes >> 20)


def serve(port: int, gpu: tuple[Driver, int, int] | None, poll: str | None,
          big: tuple[int, int] | None = None) -> int:
    """Answer each packet (or each byte appended to ``poll``) with the incremented counter."""
    value = ctypes.c_uint32(100)
    if poll:
        print(f"counter_driver: listening on {poll}{'' if gpu else ' (no GPU)'}", flush=True)
        seen = 0
        while True:
            try:
                size = os.stat(poll).st_size
            except FileNotFoundError:
                size = 0
            for _ in range(seen, size):
                print(next_value(gpu, value), flush=True)
            seen = max(seen, size)
            time.sleep(0.02)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    print(f"counter_driver: listening on 127.0.0.1:{port}{'' if gpu else ' (no GPU)'}", flush=True)
    while True:
        try:
            data, peer = sock.recvfrom(16)
        except InterruptedError:
            continue
        if data.strip() == b"verify" and gpu is not None:
            sock.sendto(verify(gpu[0], big), peer)
            continue
        n = next_value(gpu, value)
        sock.sendto(b"%d\n" % n, peer)
        print(n, flush=True)


if __name__ == "__main__":
    sys.exit(main())
