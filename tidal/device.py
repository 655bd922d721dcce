"""The few things tidal needs from a device backend, behind one small object.

Everything above this module speaks to a :class:`DeviceOps` and never to ``torch.cuda``
directly, so the CPU path (used by CI) runs the same code as the GPU path, and another
accelerator backend only has to be taught here. On ``device="cpu"`` there are no streams or
events: copies are synchronous, so every "wait" is trivially satisfied.

Nothing here touches CUDA at import time; a ``DeviceOps`` for an accelerator initialises it
on construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
import weakref
from typing import Any, Iterator

import torch

__all__ = [
    "DeviceOps",
    "HostMemory",
    "RandomState",
    "SyncPolicy",
    "host_available_bytes",
    "host_memory",
    "register_private_pool",
    "sync_policy",
    "use_sync_policy",
]


class RandomState:
    """The state of the random generators work on ``device`` draws from (the host's and, on
    CUDA, the device's default generator), to run that work again from the same draws."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.get_rng_state()
        self.on_device = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.on_device is not None:
            torch.cuda.set_rng_state(self.on_device, self.device)


class SyncPolicy:
    """How tidal orders its work: every stream wait, event wait and host wait tidal makes, every
    block whose reuse it defers behind a stream (:meth:`hold_until`), and
    every step of a transition where an exception may land, goes through the current policy,
    by name. The default policy simply waits (and does nothing at a :meth:`point`).

    This is the one seam the tests inject: a race test installs a policy that drops one named
    wait (and checks it was reached) to show the test detects the missing wait; the fault
    sweep installs one that raises at the k-th call, for every k, to show no state is lost
    wherever an exception lands. Production code never switches a wait off.

    On ``device="cpu"`` streams and events are None: the waits are trivially met, but the
    policy still sees every call, so the fault sweep runs on the CPU path too.
    """

    def wait_stream(self, name: str, consumer: Any, producer: Any) -> None:
        """``consumer`` runs what is queued on it from now on after what ``producer`` has queued."""
        if consumer is not None:
            consumer.wait_stream(producer)

    def wait_event(self, name: str, stream: Any, event: Any) -> None:
        """``stream`` runs what is queued on it from now on after ``event`` (no host blocking)."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    def wait_host(self, name: str, event: Any) -> None:
        """The host blocks until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def hold_until(self, name: str, tensor: torch.Tensor, stream: Any) -> None:
        """The caching allocator hands ``tensor``'s block out again, once it is freed, only
        after the work queued on ``stream`` now has run (no host blocking)."""
        if stream is not None:
            tensor.record_stream(stream)

    def point(self, name: str) -> None:
        """A step of a transition where an exception may land (nothing to do by default)."""


_POLICY: list[SyncPolicy] = [SyncPolicy()]


def sync_policy() -> SyncPolicy:
    """The policy in force (process-wide: the copy worker threads use it too)."""
    return _POLICY[0]


@contextlib.contextmanager
def use_sync_policy(policy: SyncPolicy) -> Iterator[SyncPolicy]:
    """Install ``policy`` for the block (process-wide), restoring the previous one after."""
    if not isinstance(policy, SyncPolicy):
        raise TypeError(f"policy must be a tidal.device.SyncPolicy, got {type(policy).__name__}")
    previous = _POLICY[0]
    _POLICY[0] = policy
    try:
        yield policy
    finally:
        _POLICY[0] = previous


def host_available_bytes() -> int:
    """Host memory a new allocation can still get, in bytes: :func:`host_memory`'s
    ``available_bytes`` (a memory cgroup's limit included), or the free pages where there is
    no ``/proc/meminfo``."""
    try:
        return host_memory().available_bytes
    except OSError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


# Private memory pools (``torch.cuda.MemPool``: an address-stable region's tags, the CUDA graphs
# captured into them). The caching allocator counts their segments in ``memory_reserved``, but a
# free block in one serves only allocations made inside that pool, and a region's released
# segments hold no memory at all. Room for ordinary allocations must leave them out.
_private_pools: dict[int, Any] = {}  # id(pool) -> weakref to it (or the pool, where no weakref)
_private_lock = threading.Lock()


def register_private_pool(pool: Any) -> None:
    """Count ``pool`` (a ``torch.cuda.MemPool``, or anything with ``snapshot()`` giving the
    allocator's segment records of that pool) as private: its free blocks are left out of
    :meth:`DeviceOps.cached_free_bytes`. Held weakly; a pool that is gone stops counting."""
    try:
        ref: Any = weakref.ref(pool)
    except TypeError:
        ref = lambda pool=pool: pool  # noqa: E731 (held for the life of the process)
    with _private_lock:
        _private_pools[id(pool)] = ref


def _private_free_bytes(device_index: int | None) -> int:
    """Bytes free inside the registered private pools' segments on ``device_index``."""
    with _private_lock:
        refs = list(_private_pools.items())
    total = 0
    for key, ref in refs:
        pool = ref()
        if pool is None:
            with _private_lock:
                if _private_pools.get(key) is ref:
                    del _private_pools[key]
            continue
        try:
            segments = pool.snapshot(include_traces=False)
        except TypeError:  # a torch whose snapshot() takes no such argument
            segments = pool.snapshot()
        pool_id = getattr(pool, "id", None)
        for seg in segments:
            if device_index is not None and seg.get("device", device_index) != device_index:
                continue
            # Only this pool's segments (a torch whose pool snapshot lists every pool).
            if pool_id is not None and "segment_pool_id" in seg and tuple(seg["segment_pool_id"]) != tuple(pool_id):
                continue
            total += int(seg["total_size"]) - int(seg["allocated_size"])
    return total


class DeviceOps:
    """Streams, events, memory queries and host pinning for one device.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device`` ... An accelerator
            device without an index means the current one.
    """

    def __init__(self, device: str | torch.device) -> None:
        dev = torch.device(device)
        self.is_accelerator = dev.type != "cpu"
        if self.is_accelerator:
            module = torch.get_device_module(dev.type)
            if not module.is_available():
                raise ValueError(
                    f"device {str(dev)!r} was asked for but torch reports no {dev.type} device "
                    f"available; ask for the CPU on a machine without one (device='cpu'; the CLI's --device cpu)"
                )
            if dev.index is None:
                dev = torch.device(dev.type, module.current_device())
            if dev.index >= module.device_count():
                raise ValueError(
                    f"device {str(dev)!r} does not exist: {module.device_count()} {dev.type} device(s) are visible"
                )
            self.module: Any = module
        else:
            self.module = None
            dev = torch.device("cpu")  # CPU tensors report "cpu"; "cpu:0" would compare unequal
        self.device = dev
        self._can_register = dev.type == "cuda" and hasattr(torch.cuda, "cudart")

    def __repr__(self) -> str:
        return f"DeviceOps({str(self.device)!r})"

    # ---- streams and events (None on CPU) ---------------------------------------------
    def new_stream(self) -> Any:
        """A new side stream on this device, or None on CPU."""
        if not self.is_accelerator:
            return None
        return self.module.Stream(device=self.device)

    def current_stream(self) -> Any:
        if not self.is_accelerator:
            return None
        return self.module.current_stream(self.device)

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current for the block (no-op on CPU)."""
        if stream is None:
            yield
            return
        with self.module.stream(stream):
            yield

    def new_event(self, *, timing: bool = False) -> Any:
        """A new event (``timing``: one that ``elapsed_time`` can read), or None on CPU."""
        if not self.is_accelerator:
            return None
        return self.module.Event(enable_timing=True) if timing else self.module.Event()

    def synchronize(self) -> None:
        if self.is_accelerator:
            self.module.synchronize(self.device)

    # ---- ordering, through the sync policy (see SyncPolicy) ------------------------------
    def wait_stream(self, name: str, consumer: Any, producer: Any) -> None:
        _POLICY[0].wait_stream(name, consumer, producer)

    def wait_event(self, name: str, stream: Any, event: Any) -> None:
        _POLICY[0].wait_event(name, stream, event)

    def wait_host(self, name: str, event: Any) -> None:
        _POLICY[0].wait_host(name, event)

    def hold_until(self, name: str, tensor: torch.Tensor, stream: Any) -> None:
        _POLICY[0].hold_until(name, tensor, stream)

    def point(self, name: str) -> None:
        _POLICY[0].point(name)

    # ---- memory -----------------------------------------------------------------------
    def driver_free_bytes(self) -> tuple[int, int]:
        """(free, total) bytes as the driver sees them: what another process could get.

        On CPU this is the host's available memory and total memory.
        """
        if self.is_accelerator:
            free, total = self.module.mem_get_info(self.device)
            return int(free), int(total)
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return host_available_bytes(), total

    def allocated_bytes(self) -> int:
        if self.is_accelerator:
            return int(self.module.memory_allocated(self.device))
        return 0

    def reserved_bytes(self) -> int:
        if self.is_accelerator:
            return int(self.module.memory_reserved(self.device))
        return 0

    def peak_allocated_bytes(self) -> int:
        """Highest allocated bytes since :meth:`reset_peak` (0 on CPU)."""
        if self.is_accelerator:
            return int(self.module.max_memory_allocated(self.device))
        return 0

    def reset_peak(self) -> None:
        if self.is_accelerator:
            self.module.reset_peak_memory_stats(self.device)

    def cached_free_bytes(self) -> int:
        """Bytes the caching allocator holds but has not handed out, less those free inside
        private pools (:func:`register_private_pool`): what an ordinary allocation of this
        process can reuse."""
        return self.reserved_bytes() - self.allocated_bytes() - self.private_free_bytes()

    def fragmented_free_bytes(self) -> int:
        """Of :meth:`cached_free_bytes`, the bytes free inside segments that also hold live
        blocks (the allocator's "inactive, non-releasable" memory): an allocation larger than
        the largest such piece cannot use them. The rest of the cached free memory is whole
        segments, which the allocator returns to the driver when an allocation finds no room,
        so it is as good as the driver's free memory for any size. On an accelerator whose
        allocator does not report it, all of the cached free memory; 0 on CPU."""
        if not self.is_accelerator:
            return 0
        cached = self.cached_free_bytes()
        stats = self.module.memory_stats(self.device) if hasattr(self.module, "memory_stats") else {}
        split = stats.get("inactive_split_bytes.all.current")
        return cached if split is None else max(0, min(cached, int(split)))

    def private_free_bytes(self) -> int:
        """Bytes free inside the registered private pools (0 on CPU or with none): reserved
        by this process, usable only by allocations made in those pools."""
        if not self.is_accelerator or not _private_pools:
            return 0
        return _private_free_bytes(self.device.index)

    def empty_cache(self) -> None:
        """Return the caching allocator's unused blocks to the driver.

        The allocator synchronises the device before it frees, so this is also a barrier.
        """
        if self.is_accelerator:
            self.module.empty_cache()

    def release_to_driver(self) -> None:
        """:meth:`empty_cache`, after dropping cuBLAS's cached workspaces.

        Why: the allocator returns only whole segments with nothing allocated in them, and
        torch keeps one cuBLAS(Lt) workspace per handle and stream for the life of the
        process (32 MiB each on Hopper), allocated wherever the first matmul found room, often
        inside a large segment that a role's storages share. Measured on 2x H200 with an FSDP2
        role: two such workspaces kept two 520 MiB segments, ~1 GiB per rank, from the driver
        after every offload. Dropped here, they are allocated again by the next matmul (one
        cached allocation); no kernel can be using them, as the allocator synchronises the
        device before freeing.
        """
        if not self.is_accelerator:
            return
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None) if self.device.type == "cuda" else None
        if clear is not None:
            self.synchronize()  # queued matmuls may still read their workspace
            clear()
        self.empty_cache()

    # ---- host memory --------------------------------------------------------------------
    def new_host_buffer(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """An exact-size uint8 host buffer, page-locked when ``pin`` and the backend allows.

        Pinning goes through ``cudaHostRegister`` on a plain allocation rather than
        ``pin_memory=True``: torch's pinned caching allocator rounds every request up to a
        power of two (up to ~2x the host RAM), and we want host RAM == bytes held.
        """
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if not (pin and self.is_accelerator) or nbytes == 0:
            return buf
        if self._can_register:
            err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {err}); "
                    f"the host may be short of lockable memory (check `ulimit -l` and free RAM)"
                )
            return buf
        warnings.warn(
            f"exact-size host pinning is only implemented for CUDA; {self.device.type} falls "
            f"back to torch's pinned allocator, which may round the buffer up",
            stacklevel=2,
        )
        return buf.pin_memory()

    def free_host_buffer(self, buf: torch.Tensor, *, pinned: bool) -> None:
        """Unpin a buffer made by :meth:`new_host_buffer` (the tensor itself is then dropped)."""
        if pinned and self._can_register and buf.numel() > 0:
            # The buffer may be the source or target of a copy still queued on a stream.
            self.synchronize()
            err = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
            assert err == 0, f"cudaHostUnregister failed with cudaError {err}"
