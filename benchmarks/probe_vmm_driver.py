"""Where a region's release and restore spend time outside the copies: the CUDA driver calls.

    python benchmarks/probe_vmm_driver.py

Times, on one 256 MiB chunk each: cuMemCreate, cuMemMap + cuMemSetAccess, cuMemUnmap,
cuMemRelease, with the copy engines idle and with a 2 GiB D2H copy of other memory in flight
(does a driver call wait for it?), and the scratch guard's map of 256 MiB in 64 MiB pieces.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tidal.device import DeviceOps  # noqa: E402
from tidal.vmm import cuda_driver  # noqa: E402

MiB = 1 << 20


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    drv = cuda_driver()
    n = 256 * MiB
    va = drv.reserve(4 * n)
    ops = DeviceOps("cuda")
    host = ops.new_host_buffer(2048 * MiB, pin=True)
    other = torch.empty(2048 * MiB, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for busy in (False, True, False, True):
        handle = None

        def create():
            nonlocal handle
            handle = drv.create(n)

        if busy:
            with torch.cuda.stream(stream):
                host.copy_(other, non_blocking=True)  # ~37 ms of D2H in flight
        t_create = ms(create)
        t_map = ms(lambda: drv.map(va, n, handle))
        t_unmap = ms(lambda: drv.unmap(va, n))
        t_release = ms(lambda: drv.release(handle))
        in_flight = not stream.query() if busy else False
        torch.cuda.synchronize()
        print(
            f"copy engine {'busy' if busy else 'idle'}: create {t_create:.2f} ms, map+access {t_map:.2f} ms, "
            f"unmap {t_unmap:.2f} ms, release {t_release:.2f} ms (copy still in flight after: {in_flight})"
        )
    g = drv.create(64 * MiB)
    pieces = [va + i * 64 * MiB for i in range(4)]
    t_guard = ms(lambda: [drv.map(p, 64 * MiB, g) for p in pieces])
    t_unguard = ms(lambda: [drv.unmap(p, 64 * MiB) for p in pieces])
    print(f"guard 256 MiB as 4 x 64 MiB of one scratch: map {t_guard:.2f} ms, unmap {t_unguard:.2f} ms")
    g2 = drv.create(2 * MiB)
    t_small = ms(lambda: [drv.map(va + i * 2 * MiB, 2 * MiB, g2) for i in range(128)])
    t_small_un = ms(lambda: [drv.unmap(va + i * 2 * MiB, 2 * MiB) for i in range(128)])
    print(f"guard 256 MiB as 128 x 2 MiB: map {t_small:.2f} ms, unmap {t_small_un:.2f} ms")


if __name__ == "__main__":
    main()
