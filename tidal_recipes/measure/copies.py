"""What the benchmarks and ``tidal bench`` measure against: the line rate of the device's copy
engines (one large copy each way, and both at once), the machine and versions a figure ran with,
and giving torch's pinned host cache back between an anchor and tidal."""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch

from tidal.device import DeviceOps
from tidal.units import gbps

__all__ = ["empty_host_cache", "environment", "measure_line_rate", "timed"]


def timed(ops: DeviceOps, fn: Callable):
    """(result, seconds) of ``fn`` with the device idle before and after, so the wall clock
    covers exactly the work ``fn`` queued (the same clock tidal's own records use)."""
    ops.synchronize()
    t0 = time.perf_counter()
    result = fn()
    ops.synchronize()
    return result, time.perf_counter() - t0


def empty_host_cache(ops: DeviceOps) -> None:
    """Give the blocks torch's pinned host caching allocator keeps back to the system (pinned
    tensors made with ``pin_memory=True`` stay cached there after they die), so an anchor's
    host copies and tidal's never hold host RAM at once. Nothing on a CPU."""
    fn = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if ops.is_accelerator and fn is not None:
        fn()


def environment(ops: DeviceOps) -> dict:
    """The device and the versions a measurement ran with, for its report."""
    try:
        import transformers  # noqa: PLC0415

        tf = transformers.__version__
    except ImportError:
        tf = None
    cpu_name = platform.processor() or platform.machine() or "cpu"
    name = torch.cuda.get_device_name(ops.device) if ops.device.type == "cuda" else cpu_name
    return {
        "device": str(ops.device),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": tf,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
    }


def measure_line_rate(ops: DeviceOps, nbytes: int, reps: int = 5) -> dict:
    """GB/s of one ``nbytes`` copy device->pinned host, host->device, and both at once (two
    streams, each direction's bytes counted). On CPU the copies are memcpy, run one after the
    other."""
    x_dev = torch.full((nbytes,), 7, dtype=torch.uint8, device=ops.device)
    y_dev = torch.empty(nbytes, dtype=torch.uint8, device=ops.device)
    x_host = ops.new_host_buffer(nbytes, pin=True)
    y_host = ops.new_host_buffer(nbytes, pin=True)
    y_host.fill_(3)
    d2h, h2d = ops.new_stream(), ops.new_stream()
    compute = ops.current_stream()

    def queue(pairs):
        for stream, dst, src in pairs:
            if stream is not None:
                # The buffers were written on the compute stream; copies must start after that.
                stream.wait_stream(compute)
            with ops.on_stream(stream):
                dst.copy_(src, non_blocking=True)

    runs = {
        "d2h": [(d2h, x_host, x_dev)],
        "h2d": [(h2d, y_dev, y_host)],
        "bidir": [(d2h, x_host, x_dev), (h2d, y_dev, y_host)],
    }
    out: dict = {"bytes": nbytes, "reps": reps, "pinned": bool(ops.is_accelerator and x_host.is_pinned())}
    for name, pairs in runs.items():
        timed(ops, lambda: queue(pairs))  # warm-up: first-touch, driver mappings
        secs = [timed(ops, lambda: queue(pairs))[1] for _ in range(reps)]
        out[f"{name}_gbps"] = gbps(nbytes * len(pairs), statistics.median(secs))
    ops.free_host_buffer(x_host, pinned=True)
    ops.free_host_buffer(y_host, pinned=True)
    del x_dev, y_dev
    ops.empty_cache()
    return out
