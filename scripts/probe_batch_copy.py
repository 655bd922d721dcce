"""Probe (issue 26): why does queueing the optimizer state's prefetch (678 copies, 14 GB at the
Qwen2-1.5B shape) cost the host the whole copy time, while a role's weights (339 copies) queue
in milliseconds? Times the host's share of one ``cuMemcpyBatchAsync`` H2D batch by the number of
copies, the number of pinned host regions they come from, whether the copy stream is gated
behind queued compute, and split into several calls. Prints one line per case."""

from __future__ import annotations

import time

import torch

from tidal.device import DeviceOps
from tidal.transfer.batch import batch_copier

PARAMS = [151936 * 1536] * 2 + [1536] + [1536 * 1536, 1536, 256 * 1536, 256, 256 * 1536, 256, 1536 * 1536]
PARAMS += [8960 * 1536] * 3 + [1536, 1536]
LAYER = PARAMS[3:]


def sizes(n_layers: int, copies_per_param: int) -> list[int]:
    per = [151936 * 1536 * 4] * 2 + [1536 * 4] + [n * 4 for n in LAYER] * n_layers
    return [s for s in per for _ in range(copies_per_param)]


def run(ops, copier, nbytes: list[int], regions: int, gate_ms: float, calls: int) -> tuple[float, float]:
    total = sum(nbytes)
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in nbytes]
    per_region = -(-len(nbytes) // regions)
    hosts, ptrs = [], []
    for r in range(regions):
        part = nbytes[r * per_region : (r + 1) * per_region]
        if not part:
            continue
        buf = ops.new_host_buffer(sum(part), pin=True)
        hosts.append(buf)
        off = 0
        for n in part:
            ptrs.append(buf.data_ptr() + off)
            off += n
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    if gate_ms:
        torch.cuda._sleep(int(gate_ms * 1.98e6))  # queued compute the copies wait behind
        stream.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    step = -(-len(nbytes) // calls)
    for c in range(calls):
        sl = slice(c * step, (c + 1) * step)
        copier.copy([d.data_ptr() for d in dev[sl]], ptrs[sl], nbytes[sl], stream.cuda_stream, to_device=True)
    host = time.perf_counter() - t0
    stream.synchronize()
    wall = time.perf_counter() - t0
    for b in hosts:
        ops.free_host_buffer(b, pinned=True)
    del dev
    torch.cuda.empty_cache()
    return host, wall, total


def main() -> None:
    ops = DeviceOps("cuda")
    copier = batch_copier(torch.device("cuda"))
    print("copier:", copier)
    cases = [
        ("weights: 339 copies, 1 region", sizes(28, 1), 1, 0, 1),
        ("state: 678 copies, 1 region", sizes(28, 2), 1, 0, 1),
        ("state: 678 copies, 48 regions", sizes(28, 2), 48, 0, 1),
        ("state: 678 copies, 1 region, 4 calls", sizes(28, 2), 1, 0, 4),
        ("state: 678 copies, 1 region, gated 200 ms", sizes(28, 2), 1, 200, 1),
        ("weights: 339 copies, 1 region, gated 200 ms", sizes(28, 1), 1, 200, 1),
        ("state: 678 copies, 1 region, again", sizes(28, 2), 1, 0, 1),
        ("state halves: 339 copies of 2x size", [2 * s for s in sizes(28, 1)], 1, 0, 1),
    ]
    for name, nbytes, regions, gate, calls in cases:
        host, wall, total = run(ops, copier, nbytes, regions, gate, calls)
        print(
            f"{name:48s} {total / 1e9:6.2f} GB  host {host * 1e3:8.1f} ms  done {wall * 1e3:8.1f} ms  ({total / wall / 1e9:.1f} GB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
