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

from tidal.device import DeviceOps

__all__ = ["HostMemory", "MemorySnapshot", "host_memory", "host_rss_bytes", "nvml_used_bytes", "snapshot"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """One reading of device memory. On CPU the device figures are the host's."""

    time_s: float
    driver_free_bytes: int
    driver_total_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    nvml_used_bytes: int | None

    @property
    def cached_free_bytes(self) -> int:
        """Held by the caching allocator, not in use: reusable here, invisible to others."""
        return self.reserved_bytes - self.allocated_bytes


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
    )


def host_rss_bytes() -> int:
    """Resident set size of this process, in bytes (Linux ``/proc/self/statm``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostMemory:
    """This machine's RAM as a process here can use it: the kernel's totals (``/proc/meminfo``)
    bounded by the memory cgroup's limit (a container's), where there is one.

    Attributes:
        total_bytes: ``MemTotal``, or the cgroup's limit if lower.
        available_bytes: ``MemAvailable``, or what the cgroup's limit leaves above its current
            usage if lower: what a new allocation can still get.
        cgroup_limit_bytes: the cgroup's limit (None: no limit, or no memory cgroup found).
    """

    total_bytes: int
    available_bytes: int
    cgroup_limit_bytes: int | None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def host_memory(*, meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> HostMemory:
    """Read :class:`HostMemory` (Linux; cgroup v2 ``memory.max``/``memory.current`` at
    ``cgroup_root``, else v1 ``memory/memory.limit_in_bytes``/``memory.usage_in_bytes``). A v1
    limit near 2**63 means none. Raises ``OSError`` if ``meminfo`` cannot be read."""
    fields: dict[str, int] = {}
    with open(meminfo) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    total = fields["MemTotal"]
    available = fields.get("MemAvailable", fields.get("MemFree", total))
    limit = _read_int(os.path.join(cgroup_root, "memory.max"))
    usage = _read_int(os.path.join(cgroup_root, "memory.current"))
    if limit is None:
        limit = _read_int(os.path.join(cgroup_root, "memory", "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(cgroup_root, "memory", "memory.usage_in_bytes"))
        if limit is not None and limit >= 1 << 60:  # v1 reports "no limit" as a huge number
            limit = None
    if limit is not None:
        total = min(total, limit)
        available = min(available, max(0, limit - (usage or 0)))
    return HostMemory(total_bytes=total, available_bytes=available, cgroup_limit_bytes=limit)
