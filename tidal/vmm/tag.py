"""One tag of a region: :class:`RegionTag` (its addresses, allocations, mappings, policy and
the torch pool that allocates in it) and :class:`RegionMove`, what a release or restore did."""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
from typing import Any, Literal, Protocol, Sequence

import torch

from tidal.device import DeviceOps, register_private_pool
from tidal.transfer.arena import HostSlot
from tidal.units import gbps
from tidal.vmm.driver import VmmDriver
from tidal.vmm.space import AddressSpace, Allocation, Mapping, MapState

__all__ = ["Policy", "RegionMove", "RegionTag", "TagOwner"]


Policy = Literal["backup", "discard"]
POLICIES = ("backup", "discard")  # what a tag does with its bytes at a release
SCRATCH_BYTES = 64 << 20  # the scratch allocation that guards released addresses
# The allocation callbacks torch holds: kept for the life of the process.
_CALLBACKS: list[Any] = []


class TagOwner(Protocol):
    """What a tag reads of its :class:`~tidal.vmm.Region`: its name, device, driver and how much
    address space to reserve at a time."""

    name: str
    ops: DeviceOps
    driver: VmmDriver
    reserve_bytes: int


@dataclasses.dataclass(frozen=True)
class RegionMove:
    """What a :meth:`Region.release` or :meth:`Region.restore` did."""

    direction: str  # "release" or "restore"
    bytes_copied: int  # through PCIe (backup tags)
    bytes_mapped: int  # physical memory unmapped (release) or mapped (restore)
    seconds: float  # wall time: until the memory is back with the driver (release), or until the copies are queued and ordered before the compute stream (restore)
    driver_seconds: float  # host time in driver calls (create, map, unmap, release), overlapped with the copies

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_copied, self.seconds)


def round_up(n: int, g: int) -> int:
    return -(-n // g) * g


class RegionTag:
    """One tag of a region: its addresses, allocations, mappings, policy and torch pool.

    :meth:`alloc` and :meth:`free` are the allocator (torch's pool calls :meth:`alloc`; code
    that manages raw device memory may call both); the region does the rest.
    """

    def __init__(self, region: TagOwner, name: str, policy: Policy) -> None:
        self.region = region
        self.name = name
        self.policy: Policy = policy
        self.space = AddressSpace()
        self.allocations: dict[int, Allocation] = {}
        self.mappings: list[Mapping] = []  # sorted by address, disjoint
        self.slots: dict[tuple[int, int], HostSlot] = {}  # (va, nbytes) of an allocated range -> its host copy
        self.guard: list[tuple[int, int]] = []  # scratch pieces mapped over its released addresses
        self.guard_run: list[int] | None = None  # [start, end) released during a release, not yet guarded
        self._pool: Any = None
        self._pool_segments: set[int] = set()  # addresses of the allocations torch's pool asked for
        self._starts: list[int] | None = None  # sorted allocation addresses (see find), rebuilt after a change
        self.last_error: BaseException | None = None  # what the last failed allocation raised

    # ---- queries --------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        return all(m.state is MapState.MAPPED for m in self.mappings)

    @property
    def mapped_bytes(self) -> int:
        return sum(m.nbytes for m in self.mappings if m.handle is not None)

    @property
    def allocated_bytes(self) -> int:
        return sum(a.nbytes for a in self.allocations.values() if not a.dead)

    # ---- the allocator --------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Map ``nbytes`` (rounded up to the granularity) of new memory; returns its address.
        Raises ``torch.OutOfMemoryError`` when the device is full, ``RuntimeError`` while the
        tag is released."""
        if not self.resident:
            raise RuntimeError(
                f"region {self.region.name!r}, tag {self.name!r}: allocation while released; restore() it first"
            )
        drv = self.region.driver
        n = round_up(max(int(nbytes), 1), drv.granularity)
        va = self.space.take(n)
        if va is None:
            size = max(n, self.region.reserve_bytes)
            self.space.add_range(drv.reserve(size), size)
            va = self.space.take(n)
            assert va is not None
        try:
            handle = drv.create(n)
        except BaseException:
            self.space.give_back(va, n)
            raise
        try:
            drv.map(va, n, handle)
        except BaseException:
            drv.release(handle)
            self.space.give_back(va, n)
            raise
        self.allocations[va] = Allocation(va, n)
        self._starts = None
        self._insert(Mapping(va, n, handle))
        return va

    def find(self, ptr: int) -> Allocation | None:
        """The live allocation holding address ``ptr``, if any (a binary search)."""
        if self._starts is None:
            self._starts = sorted(self.allocations)
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        a = self.allocations.get(self._starts[i])
        return a if a is not None and not a.dead and ptr < a.va + a.nbytes else None

    def free(self, va: int) -> None:
        """Mark an allocation made by :meth:`alloc` free: its memory goes back to the driver
        at the next release (with the mapping it shares), its addresses are reused after the
        next restore, and its bytes are no longer copied. Unknown addresses are ignored."""
        alloc = self.allocations.get(va)
        if alloc is not None:
            alloc.dead = True

    def pool(self) -> Any:
        """The ``torch.cuda.MemPool`` whose new memory comes from :meth:`alloc` (made on first use)."""
        if self._pool is None:
            if self.region.ops.device.type != "cuda":
                raise ValueError(
                    f"region {self.region.name!r}: a torch memory pool needs a CUDA device, "
                    f"the region is on {self.region.ops.device}"
                )
            self._pool = torch.cuda.MemPool(self._torch_allocator())
            # Its free blocks serve only allocations inside it; released, its segments hold
            # nothing: neither is room for the timeshare's moves.
            register_private_pool(self._pool)
        return self._pool

    # ---- internals --------------------------------------------------------------------------
    def _torch_allocator(self) -> Any:
        alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

        def alloc(size: int, device: int, stream: int) -> int | None:
            # An exception cannot cross into torch: a null pointer is its out-of-memory signal
            # (it frees cached blocks, retries, then raises OutOfMemoryError).
            try:
                va = self.alloc(size)
                self._pool_segments.add(va)
                return va
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt re-raised by Region.allocate
                self.last_error = e
                return None

        callback = alloc_t(alloc)
        _CALLBACKS.append(callback)
        fn_alloc = ctypes.cast(callback, ctypes.c_void_p).value
        # torch calls the free function when its pool gives a segment back, possibly during
        # interpreter teardown, where no Python may run: a C function that ignores its
        # arguments and does nothing. Freed segments are found from the pool (_sync_with_pool).
        fn_free = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
        return torch._C._cuda_customAllocator(fn_alloc, fn_free)

    def _insert(self, m: Mapping) -> None:
        i = 0
        while i < len(self.mappings) and self.mappings[i].va < m.va:
            i += 1
        self.mappings.insert(i, m)

    def _snapshot(self) -> list[dict] | None:
        """The segments torch's pool holds in the tag (None when torch does not manage it)."""
        return None if self._pool is None else torch.cuda.memory.memory_snapshot(self._pool.id)

    def _sync_with_pool(self) -> list[dict] | None:
        """Mark the allocations torch's pool no longer holds as freed; returns the pool's
        snapshot it read, for the caller to reuse (see :meth:`_allocated_blocks`)."""
        segments = self._snapshot()
        if segments is None:
            return None
        held = {int(seg["address"]) for seg in segments}
        for va in self._pool_segments - held:
            self._pool_segments.discard(va)
            if va in self.allocations:
                self.allocations[va].dead = True
        return segments

    def _live_ranges(self, segments: list[dict] | None) -> list[tuple[int, int]]:
        """The byte ranges in mapped memory whose contents matter, in address order: the pool's
        allocated blocks when torch manages the tag, else the live allocations whole; adjacent
        ranges merged. ``segments``: the pool's snapshot, taken since the last change."""
        mapped = [m for m in self.mappings if m.state is MapState.MAPPED]
        out: list[tuple[int, int]] = []
        for va, n in sorted(self._allocated_blocks(segments)):
            if not covered(mapped, va, n):
                continue  # in memory whose host copy is the live one already (a partial release)
            if out and out[-1][0] + out[-1][1] == va:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((va, n))
        return out

    def _allocated_blocks(self, segments: list[dict] | None = None) -> list[tuple[int, int]]:
        """(address, bytes) of what is allocated in the tag: the blocks torch's pool has handed
        out of the segments it asked for (from ``segments``, the pool's snapshot, or a new one),
        and the live allocations made directly."""
        out = [(a.va, a.nbytes) for a in self.allocations.values() if not a.dead and a.va not in self._pool_segments]
        if self._pool is None:
            return out
        for seg in segments if segments is not None else self._snapshot():
            addr = int(seg["address"])
            for block in seg.get("blocks", []):
                size = int(block["size"])
                if block.get("state") in ("active_allocated", "active_pending_free"):
                    out.append((int(block.get("address", addr)), size))
                addr += size
        return out

    def _runs(self) -> list[tuple[int, int]]:
        """Adjacent live allocations, as (va, nbytes), within one reserved range each."""
        out: list[tuple[int, int]] = []
        for a in sorted((a for a in self.allocations.values() if not a.dead), key=lambda a: a.va):
            if out and out[-1][0] + out[-1][1] == a.va and self.space._same_range(out[-1][0], a.va):
                out[-1] = (out[-1][0], out[-1][1] + a.nbytes)
            else:
                out.append((a.va, a.nbytes))
        return out


def covered(mapped: Sequence[Mapping], va: int, n: int) -> bool:
    """``[va, va + n)`` lies in mapped memory (possibly across adjacent mappings)."""
    end, pos = va + n, va
    for m in mapped:
        if m.va <= pos < m.end:
            pos = m.end
            if pos >= end:
                return True
    return False
