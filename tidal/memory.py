"""Memory accounting: what the allocator holds, what the driver sees, what the host holds.

``memory_allocated`` says what tensors use; it is not what another process (an inference
engine sharing the GPU) can get. That is the driver's free memory (``mem_get_info``), and,
where NVML is importable, the device-wide used bytes that NVML reports. tidal confirms every
release against the driver, never against the allocator alone.
"""

from __future__ import annotations

import dataclasses
import os
import time

from tidal.device import DeviceOps, HostMemory, host_memory
from tidal.units import phase_need_bytes

__all__ = [
    "HostMemory",
    "MemorySnapshot",
    "host_memory",
    "host_peak_rss_bytes",
    "host_rss_bytes",
    "nvml_used_bytes",
    "phase_need_bytes",
    "reset_host_peak_rss",
    "snapshot",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """One reading of device memory. On CPU the device figures are the host's."""

    time_s: float
    driver_free_bytes: int
    driver_total_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    nvml_used_bytes: int | None
    private_free_bytes: int = 0  # free inside private pools (a region's tags, their graphs)

    @property
    def cached_free_bytes(self) -> int:
        """Held by the caching allocator, not in use, outside private pools: reusable here by
        an ordinary allocation, invisible to others."""
        return self.reserved_bytes - self.allocated_bytes - self.private_free_bytes


def nvml_used_bytes(ops: DeviceOps) -> int | None:
    """Device-wide used bytes from NVML (all processes), or None where NVML is absent."""
    if ops.device.type != "cuda":
        return None
    try:
        import pynvml  # noqa: PLC0415  (optional; shipped as nvidia-ml-py)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = ops.device.index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if index < len(ids) and ids[index].isdigit():
                index = int(ids[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # NVML not usable in this container: report nothing, not a guess
        return None


def snapshot(ops: DeviceOps, *, with_nvml: bool = False) -> MemorySnapshot:
    """Read the device's memory now (no synchronisation is implied)."""
    free, total = ops.driver_free_bytes()
    return MemorySnapshot(
        time_s=time.perf_counter(),
        driver_free_bytes=free,
        driver_total_bytes=total,
        allocated_bytes=ops.allocated_bytes(),
        reserved_bytes=ops.reserved_bytes(),
        nvml_used_bytes=nvml_used_bytes(ops) if with_nvml else None,
        private_free_bytes=ops.private_free_bytes(),
    )


def reset_host_peak_rss() -> bool:
    """Start a new peak for :func:`host_peak_rss_bytes` (Linux: writes ``5`` to
    ``/proc/self/clear_refs``, which resets the process's ``VmHWM`` to its current RSS).
    False where that is not possible: the peak then covers the process's whole life."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_peak_rss_bytes() -> int:
    """The process's peak resident set size since it started or since the last
    :func:`reset_host_peak_rss` (Linux ``VmHWM``; elsewhere the lifetime peak from
    ``getrusage``). Pinned host memory is resident, so it counts."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_rss_bytes() -> int:
    """Resident set size of this process, in bytes (Linux ``/proc/self/statm``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
