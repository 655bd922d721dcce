"""Is queueing an H2D copy from tidal's pinned arena asynchronous for the host? Host seconds to
queue vs seconds until done, per source kind and path (direct, through staging, the store's
prefetch), for 1 GiB.

    python scripts/probe_h2d_async.py
"""

from __future__ import annotations

import time

import torch

from tidal.device import DeviceOps
from tidal.state.collect import StateEntry  # noqa: F401
from tidal.transfer.arena import HostArena

GiB = 1 << 30


def timed(label, fn, stream):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        fn()
    t1 = time.perf_counter()
    stream.synchronize()
    t2 = time.perf_counter()
    print(f"{label:<58} host {1e3 * (t1 - t0):7.2f} ms, done after {1e3 * (t2 - t0):7.2f} ms")


def main() -> None:
    ops = DeviceOps("cuda")
    s = torch.cuda.Stream()
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    reg = ops.new_host_buffer(GiB, pin=True)
    pinned = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(GiB, dtype=torch.uint8)
    print("is_pinned: registered", reg.is_pinned(), "| pin_memory", pinned.is_pinned())
    for name, src in (("registered (cudaHostRegister)", reg), ("pin_memory", pinned), ("pageable", pageable)):
        timed(f"one copy, {name}", lambda: dst.copy_(src, non_blocking=True), s)
    timed(
        "64 copies of 16 MiB, registered",
        lambda: [
            dst[i << 24 : (i + 1) << 24].copy_(reg[i << 24 : (i + 1) << 24], non_blocking=True) for i in range(64)
        ],
        s,
    )
    # busy compute stream: does the copy's queueing wait for it?
    torch.cuda._sleep(int(2e8))
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        dst.copy_(reg, non_blocking=True)
    print(
        f"{'one copy, registered, compute stream busy (no wait)':<58} host {1e3 * (time.perf_counter() - t0):7.2f} ms"
    )
    torch.cuda.synchronize()
    arena = HostArena(ops, pin=True)
    slots = arena.reserve([GiB // 64] * 64, owner="probe")
    views = [arena.view(sl) for sl in slots]
    timed(
        "64 copies from arena slots",
        lambda: [dst[i << 24 : (i + 1) << 24].copy_(v, non_blocking=True) for i, v in enumerate(views)],
        s,
    )
    print("arena view is_pinned:", views[0].is_pinned())


if __name__ == "__main__":
    main()
