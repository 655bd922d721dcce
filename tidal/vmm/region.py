"""Address-stable regions: device memory released to the driver and brought back at the same
addresses.

A :class:`Region` owns every allocation made inside ``with region.allocate(tag):`` by any code
(model weights, a static KV cache, a third-party module) and every allocation of a CUDA graph
captured with ``torch.cuda.graph(g, pool=region.pool(tag).id)``. Each tag is a
``torch.cuda.MemPool`` over an allocator that maps CUDA virtual memory (:mod:`tidal.vmm.driver`).
:meth:`Region.release` copies what a ``backup`` tag holds to pinned host memory through the
device's transfer context (both copy engines, buckets, one exact-size arena; no per-allocation
pinning), then unmaps and frees the physical memory; :meth:`Region.restore` maps new physical
memory at the same virtual addresses and copies the bytes back. A ``discard`` tag (a KV cache, a
graph's workspace) is released without a copy and restored as fresh memory. Tensors, captured
graphs and raw pointers into the region stay valid across the cycle: nothing is re-allocated or
re-captured.

Both directions are pipelined: a release unmaps each piece of memory as soon as its copies
have landed, while later copies still run; a restore maps the memory in chunks of
``map_chunk_bytes`` and starts each chunk's copies before mapping the next.

Memory cost. Device: while resident, every segment torch's pool holds in the tag (its free
cached blocks included), rounded to the driver's granularity (2 MiB); while released, nothing but
a 64 MiB and a 2 MiB scratch allocation per region when ``guard_released`` (see below). Host:
pinned bytes equal to the allocated bytes of the ``backup`` tags, reserved at the first release
(or by :meth:`Region.reserve_host`) and reused by every later one. Virtual addresses: ranges of
``reserve_bytes`` per tag (address space only, no memory).

Released memory and foreign access. With ``guard_released=True`` (default) the addresses of a
released tag are mapped to the scratch allocation, so a kernel that reads or writes them anyway
(a graph replayed while released, a tensor read by foreign code) touches scratch bytes instead
of faulting, which would kill the process's CUDA context; what it computes is garbage, so call
:meth:`Region.restore` first (:meth:`Region.check_resident` raises a clear error). Without the
guard such an access is a CUDA illegal-address error.

Freed memory. Torch's pool gives segments back only on its own schedule; the region learns of
it from the pool at the next release, unmaps that memory with the rest and reuses its addresses
after the next restore. The allocator torch calls on a free is a C function that does nothing, so
no Python runs from torch's teardown at interpreter exit.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import threading
import time
import warnings
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch

from tidal.device import DeviceOps
from tidal.errors import InsufficientMemoryError
from tidal.transfer import TransferContext
from tidal.transfer.arena import HostSlot
from tidal.transfer.engine import CopyItem, TransferEngine
from tidal.units import format_bytes, gbps
from tidal.vmm.driver import VmmDriver, cuda_driver
from tidal.vmm.space import AddressSpace, Allocation, Mapping, MapState

__all__ = ["Region", "RegionMove", "RegionTag", "Policy"]

Policy = Literal["backup", "discard"]
_POLICIES = ("backup", "discard")
_SCRATCH_BYTES = 64 << 20
# The allocation callbacks torch holds: kept for the life of the process.
_CALLBACKS: list[Any] = []


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


def _round_up(n: int, g: int) -> int:
    return -(-n // g) * g


class RegionTag:
    """One tag of a region: its addresses, allocations, mappings, policy and torch pool.

    :meth:`alloc` and :meth:`free` are the allocator (torch's pool calls :meth:`alloc`; code
    that manages raw device memory may call both); the region does the rest.
    """

    def __init__(self, region: "Region", name: str, policy: Policy) -> None:
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
        n = _round_up(max(int(nbytes), 1), drv.granularity)
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
            if not _covered(mapped, va, n):
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


def _covered(mapped: Sequence[Mapping], va: int, n: int) -> bool:
    """``[va, va + n)`` lies in mapped memory (possibly across adjacent mappings)."""
    end, pos = va + n, va
    for m in mapped:
        if m.va <= pos < m.end:
            pos = m.end
            if pos >= end:
                return True
    return False


class Region:
    """Device memory that goes back to the driver and returns at the same addresses.

    Args:
        name: shown in errors and in the host-memory account of the transfer context.
        device: the CUDA device (default: the current one).
        context: the transfer context whose copy streams and pinned arena to use (default: the
            device's shared one, ``TransferContext.of(device)``).
        driver: the virtual-memory driver (default: the CUDA driver of ``device``; raises
            :class:`~tidal.vmm.VmmUnavailableError` where there is none).
        guard_released: map released addresses to a scratch allocation (see the module
            docstring).
        release_to_driver: after a release, also return the blocks torch's default pool holds
            cached (the copies' staging buffers among them), so another process sees every byte
            the release freed.
        map_chunk_bytes: a restore maps each run of adjacent allocations in physical pieces
            of at most this size, queuing a piece's copies before mapping the next.
        reserve_bytes: virtual address space reserved per tag at a time (no memory).

    Raises ``ValueError`` for an unknown policy or a tag redeclared with another policy.
    """

    def __init__(
        self,
        name: str = "region",
        *,
        device: str | torch.device | int | None = None,
        context: TransferContext | None = None,
        driver: VmmDriver | None = None,
        guard_released: bool = True,
        release_to_driver: bool = True,
        map_chunk_bytes: int = 256 << 20,
        reserve_bytes: int = 1 << 40,
    ) -> None:
        if map_chunk_bytes <= 0 or reserve_bytes <= 0:
            raise ValueError(f"map_chunk_bytes and reserve_bytes must be > 0, got {map_chunk_bytes}, {reserve_bytes}")
        if driver is None:
            driver = cuda_driver(device)
        self.driver = driver
        if context is None:
            context = TransferContext.of(f"cuda:{driver.device_index}")
        self.context = context
        self.ops: DeviceOps = context.ops
        self.name = name
        self.guard_released = guard_released
        self.release_to_driver = release_to_driver
        self.map_chunk_bytes = _round_up(map_chunk_bytes, driver.granularity)
        self.reserve_bytes = _round_up(reserve_bytes, driver.granularity)
        self.owner = context.label(f"Region[{name}]")
        self.arena = context.arena(pin=True)
        self.engine: TransferEngine = context.engine()
        self._tags: dict[str, RegionTag] = {}
        self._scratch: tuple[int, int, int, int] | None = None  # (large handle, its bytes, granule handle, granule)
        self._routing = threading.local()
        self._driver_s = 0.0
        self._closed = False
        self.last_move: RegionMove | None = None

    # ---- declaring and allocating ---------------------------------------------------------------
    def tag(self, name: str = "default", *, policy: Policy | None = None) -> RegionTag:
        """The tag ``name``, declared with ``policy`` (``"backup"`` by default) on first use."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tag name must be a non-empty string, got {name!r}")
        if policy is not None and policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        t = self._tags.get(name)
        if t is None:
            t = self._tags[name] = RegionTag(self, name, policy or "backup")
        elif policy is not None and policy != t.policy:
            raise ValueError(
                f"region {self.name!r}: tag {name!r} was declared with policy {t.policy!r}, not {policy!r}; "
                f"use another tag for memory with another policy"
            )
        return t

    @property
    def tags(self) -> dict[str, RegionTag]:
        return dict(self._tags)

    def pool(self, tag: str = "default", *, policy: Policy | None = None) -> Any:
        """The tag's ``torch.cuda.MemPool``: pass ``region.pool("graph").id`` as the ``pool`` of
        ``torch.cuda.graph`` to put a captured graph's memory in the region. Raises
        ``RuntimeError`` if the tag is released (a capture would use memory that is gone)."""
        t = self.tag(tag, policy=policy)
        self.check_resident([tag])
        return t.pool()

    @contextlib.contextmanager
    def allocate(self, tag: str = "default", *, policy: Policy | None = None) -> Iterator[RegionTag]:
        """Route this thread's allocations on the region's device into ``tag`` for the block.
        Allocations made by other threads (autograd's backward) are not routed. Raises
        ``RuntimeError`` if the tag is released (restore it first)."""
        t = self.tag(tag, policy=policy)
        self.check_resident([tag])
        pool = t.pool()
        depth = getattr(self._routing, "depth", 0)
        self._routing.depth = depth + 1
        t.last_error = None
        try:
            with torch.cuda.use_mem_pool(pool, self.ops.device):
                yield t
        finally:
            self._routing.depth = depth
        if isinstance(t.last_error, (KeyboardInterrupt, SystemExit)):
            raise t.last_error  # it landed inside the allocator, where it could not propagate

    def check_resident(self, tags: Iterable[str] | None = None) -> None:
        """Raise ``RuntimeError`` naming the tags of ``tags`` (default: all) that are not resident."""
        out = [t.name for t in self._select(tags) if not t.resident]
        if out:
            raise RuntimeError(
                f"region {self.name!r}: tag(s) {out} are released (their memory is back with the driver); "
                f"call region.restore() before using the memory"
            )

    # ---- queries ------------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        return all(t.resident for t in self._tags.values())

    def mapped_bytes(self) -> int:
        """Physical bytes mapped for the tags (the scratch guard not included)."""
        return sum(t.mapped_bytes for t in self._tags.values())

    def host_bytes(self) -> int:
        """Pinned host bytes held for the backup tags' copies."""
        return sum(s.nbytes for t in self._tags.values() for s in t.slots.values())

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Give every byte back: device memory, scratch, addresses and pinned host copies.
        Raises ``ValueError``, before anything is freed, while torch still holds allocated
        blocks in the region (free the tensors and graphs first). Torch's pools keep empty
        segments at the released addresses until they are collected; nothing may allocate in
        them after this (:meth:`allocate` and :meth:`pool` raise). Idempotent."""
        if self._closed:
            return
        self._check_not_routing("close")
        live = {t.name: sum(n for _, n in t._allocated_blocks()) for t in self._tags.values()}
        live = {k: v for k, v in live.items() if v}
        if live:
            raise ValueError(
                f"region {self.name!r} still has allocated memory in tag(s) "
                f"{ {k: format_bytes(v) for k, v in live.items()} }; drop the tensors (and captured graphs) that "
                f"use it, then close()"
            )
        self.ops.synchronize()  # no kernel may still use memory about to be unmapped
        for t in self._tags.values():
            self._unguard(t)
            for m in t.mappings:
                self._unmap(m)
            t.mappings = []
            t.allocations = {}
            for slot in t.slots.values():
                self.arena.release(slot)
            t.slots = {}
            for va, n in t.space.ranges:
                self.driver.free_range(va, n)
            t.space = AddressSpace()
        if self._scratch is not None:
            self.driver.release(self._scratch[0])
            self.driver.release(self._scratch[2])
            self._scratch = None
        self._closed = True

    def __del__(self) -> None:
        # Nothing can be freed safely here (torch may still hold blocks in the region, and at
        # interpreter exit the driver binding may be gone): say so, once, while it can be fixed.
        try:
            held = 0 if self._closed else self.mapped_bytes()
        except Exception:  # noqa: BLE001 - a half-built region, or interpreter teardown
            return
        if held:
            warnings.warn(
                f"region {self.name!r} was dropped without close(): {format_bytes(held)} of device memory stay "
                f"mapped until the process exits",
                ResourceWarning,
                stacklevel=2,
            )

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- release and restore ----------------------------------------------------------------------
    def reserve_host(self, tags: Iterable[str] | None = None) -> int:
        """Reserve and pin the host memory the next :meth:`release` of ``tags`` (default: all)
        will copy into, so that the release runs at the copy rate (pinning costs about 0.4
        s/GiB, once). Returns the pinned bytes the region holds. Optional: a release reserves
        what is missing itself."""
        self._check_not_routing("reserve_host")
        for t in self._select(tags):
            segments = t._sync_with_pool()
            if t.policy == "backup":
                self._reserve_slots(t, t._live_ranges(segments))
        return self.host_bytes()

    def release(
        self, tags: Iterable[str] | None = None, *, keep: dict[str, Sequence[tuple[int, int]]] | None = None
    ) -> RegionMove:
        """Copy the allocated bytes of the ``backup`` tags among ``tags`` (default: all) to the
        host, then give all their physical memory back to the driver. Blocks until the memory
        is back with the driver. ``keep`` names byte ranges ``(address, bytes)`` of ``discard``
        tags to copy all the same (what else lives in a role's tag, see
        :class:`~tidal.state.backends.RegionBackend`); they come back with the next restore.
        Idempotent; after an exception (KeyboardInterrupt included) the region is either as
        before or partly released, and :meth:`restore` or another :meth:`release` completes
        from there."""
        self._check_not_routing("release")
        selected = self._select(tags)
        t0 = time.perf_counter()
        self._driver_s = 0.0
        # Kernels queued on any stream (a graph replayed on a side stream) may still read or
        # write memory about to be copied and unmapped.
        self.ops.synchronize()
        segments = {t.name: t._sync_with_pool() for t in selected}
        unknown = set(keep or {}) - {t.name for t in selected}
        if unknown:
            raise ValueError(f"region {self.name!r}: keep= names tags {sorted(unknown)} that are not being released")
        copied, unmapped = self._release_tags(selected, keep or {}, segments)
        if self.release_to_driver and unmapped:
            self.ops.release_to_driver()  # the copies' staging buffers, cached by torch's default pool
        self.last_move = RegionMove("release", copied, unmapped, time.perf_counter() - t0, self._driver_s)
        return self.last_move

    def restore(self, tags: Iterable[str] | None = None) -> RegionMove:
        """Map new physical memory at the released addresses of ``tags`` (default: all) and
        queue the ``backup`` tags' bytes back; the current stream waits for them (no host
        block). Raises :class:`~tidal.errors.InsufficientMemoryError` before mapping anything
        if the driver has too little free memory. Idempotent, and completes a partial one."""
        self._check_not_routing("restore")
        selected = self._select(tags)
        t0 = time.perf_counter()
        self._driver_s = 0.0
        for t in selected:
            self._recut(t)
        needed = sum(m.nbytes for t in selected for m in t.mappings if m.handle is None)
        free = self.driver.driver_free_bytes()
        if needed > free:
            raise InsufficientMemoryError(
                f"restoring region {self.name!r}",
                needed_bytes=needed,
                free_bytes=free,
                hint="Release another region or role first.",
            )
        copied = 0
        # Backup tags first: the discard tags are mapped while their copies run.
        for t in sorted(selected, key=lambda t: t.policy != "backup"):
            copied += self._restore_tag(t)
        self.last_move = RegionMove("restore", copied, needed, time.perf_counter() - t0, self._driver_s)
        return self.last_move

    # ---- internals: release ----------------------------------------------------------------------
    def _release_tags(
        self,
        selected: Sequence[RegionTag],
        keep: dict[str, Sequence[tuple[int, int]]],
        segments: dict[str, list[dict] | None],
    ) -> tuple[int, int]:
        """Queue the copies (backup tags, and what ``keep`` names), unmap each mapping as soon as
        the copies reading it have landed, the discard tags last. Returns (bytes copied, bytes
        unmapped)."""
        items: list[CopyItem] = []
        for t in selected:
            if t.policy == "backup" or keep.get(t.name):
                mapped = [m for m in t.mappings if m.state is MapState.MAPPED]
                ranges = (
                    t._live_ranges(segments[t.name])
                    if t.policy == "backup"
                    else sorted(r for r in keep[t.name] if _covered(mapped, *r))
                )
                self._reserve_slots(t, ranges)
                items += [
                    CopyItem(self.driver.view(va, n).untyped_storage(), t.slots[(va, n)], n, (va, n))
                    for va, n in ranges
                ]
        items.sort(key=lambda it: it.tag[0])  # address order: a copy's event covers every lower address
        copy_segments = self.engine.plan(items)
        events: list[tuple[int, Any]] = []  # (highest address the copies so far read, their event)
        unmapped = 0
        try:
            if copy_segments:
                self.engine.begin_out()
                reach = 0
                for seg in copy_segments:
                    reach = max(reach, max(it.tag[0] + it.tag[1] for it in seg.items))
                    events.append((reach, self.engine.copy_out(seg)))
            reaches = [r for r, _ in events]  # non-decreasing: searched by bisection
            # Backup tags first, each mapping as soon as its copies landed; the discard tags
            # after the copies: driver calls that change page tables slow a copy in flight
            # (one H100, best warm release of 2.9 GB beside a 4 GiB KV cache: 72 ms this way,
            # 78 ms with the discard tags unmapped during the copies).
            for t in sorted(selected, key=lambda t: t.policy != "backup" and not keep.get(t.name)):
                if all(m.state is MapState.RELEASED for m in t.mappings) and (t.guard or not self.guard_released):
                    continue
                self._unguard(t)  # a partly released tag: guarded again whole below
                t.guard_run = None  # a run left open by an interrupted release
                for m in t.mappings:
                    if m.state is not MapState.RELEASED:
                        if m.state is MapState.MAPPED and events:
                            # The copies that read this mapping (all queued no later than the
                            # first one reaching past it, on one stream) must have landed.
                            self.engine.wait("region_d2h_done", events[_first_reaching(reaches, m.end)][1])
                        unmapped += m.nbytes
                        self._unmap(m)
                        self.ops.point("region_unmapped")
                    self._guard_add(t, m)
                self._guard_flush(t)
        except BaseException:
            self.engine.drain()  # no copy may still read memory that a later release unmaps
            raise
        finally:
            self.engine.release_staging()
        return sum(it.nbytes for it in items), unmapped

    def _reserve_slots(self, t: RegionTag, ranges: Sequence[tuple[int, int]]) -> None:
        """Host slots for ``ranges``: reused where a range is the one of the last release, new
        ones reserved before any copy (so a host out of memory fails before work), and those
        of mapped ranges that changed given back."""
        wanted = [r for r in ranges if r not in t.slots]
        if wanted:
            for r, slot in zip(wanted, self.arena.reserve([n for _, n in wanted], owner=self.owner)):
                t.slots[r] = slot
        keep = set(ranges)
        mapped = [m for m in t.mappings if m.state is MapState.MAPPED]
        for r in [r for r in t.slots if r not in keep and _covered(mapped, *r)]:
            self.arena.release(t.slots.pop(r))

    def _unmap(self, m: Mapping) -> None:
        """Take ``m``'s physical memory away; ``m`` is then released."""
        if m.handle is None:
            m.state = MapState.RELEASED
            return
        t0 = time.perf_counter()
        self.driver.unmap(m.va, m.nbytes)
        handle, m.handle = m.handle, None
        m.state = MapState.RELEASED
        self.driver.release(handle)
        self._driver_s += time.perf_counter() - t0

    def _guard_add(self, t: RegionTag, m: Mapping) -> None:
        """Add released mapping ``m`` to the run of ``t``'s released addresses not yet guarded,
        and map the scratch over the run's whole large pieces at once (while later copies
        still run)."""
        if not self.guard_released:
            return
        run = t.guard_run
        if run is not None and run[1] == m.va and t.space._same_range(run[0], m.va):
            run[1] = m.end
        else:
            self._guard_flush(t)
            run = t.guard_run = [m.va, m.end]
        self._guard_map(t, run, final=False)

    def _guard_flush(self, t: RegionTag) -> None:
        """Guard what is left of the open run (less than one large piece: granules)."""
        run, t.guard_run = t.guard_run, None
        if run is not None and self.guard_released:
            self._guard_map(t, run, final=True)

    def _guard_map(self, t: RegionTag, run: list[int], *, final: bool) -> None:
        # The driver maps a physical allocation whole only, so the scratch is one large
        # allocation for the bulk of a run and one granule for its tail: a few map calls per
        # run, not one per granule.
        t0 = time.perf_counter()
        try:
            if self._scratch is None:
                g = self.driver.granularity
                big = _round_up(_SCRATCH_BYTES, g)
                first = self.driver.create(big)
                try:
                    self._scratch = (first, big, self.driver.create(g), g)
                except BaseException:
                    self.driver.release(first)
                    raise
            big_handle, big, small_handle, g = self._scratch
            while run[1] - run[0] >= big or (final and run[0] < run[1]):
                handle, n = (big_handle, big) if run[1] - run[0] >= big else (small_handle, g)
                self.driver.map(run[0], n, handle)
                t.guard.append((run[0], n))
                run[0] += n
        except (torch.OutOfMemoryError, RuntimeError) as e:
            t.guard_run = None
            self._unguard(t)
            warnings.warn(
                f"region {self.name!r}: released addresses cannot be guarded with scratch memory ({e}); they "
                f"stay unmapped, and a kernel touching them faults",
                stacklevel=4,
            )
            self.guard_released = False
        finally:
            self._driver_s += time.perf_counter() - t0

    def _unguard(self, t: RegionTag, lo: int = 0, hi: int = 1 << 64) -> None:
        """Unmap the scratch pieces of ``t`` that overlap ``[lo, hi)`` (default: all)."""
        t0 = time.perf_counter()
        i = 0
        while i < len(t.guard):
            va, n = t.guard[i]
            if va < hi and lo < va + n:
                self.driver.unmap(va, n)
                del t.guard[i]  # one at a time: an exception never leaves a piece listed twice or lost
            else:
                i += 1
        self._driver_s += time.perf_counter() - t0

    # ---- internals: restore ----------------------------------------------------------------------
    def _recut(self, t: RegionTag) -> None:
        """Re-cut the released memory of ``t`` into chunks over its live allocations: freed
        allocations dropped (their addresses back to the tag's space, its guard still over them
        until the restore ends), each run of adjacent live allocations split into mappings of
        at most ``map_chunk_bytes``."""
        if not any(m.state is MapState.RELEASED for m in t.mappings):
            return  # nothing released: no guard either (a guard only covers released memory)
        mapped = [m for m in t.mappings if m.state is not MapState.RELEASED]
        for a in [a for a in t.allocations.values() if a.dead]:
            if not any(m.va < a.va + a.nbytes and a.va < m.end for m in mapped):
                del t.allocations[a.va]
                t._starts = None
                t.space.give_back(a.va, a.nbytes)
        new: list[Mapping] = []
        for va, n in t._runs():
            pos = va
            while pos < va + n:
                if any(m.va <= pos < m.end for m in mapped):  # mapped already (a partial restore)
                    pos = next(m.end for m in mapped if m.va <= pos < m.end)
                    continue
                stop = min(va + n, pos + self.map_chunk_bytes)
                stop = min([stop] + [m.va for m in mapped if pos < m.va < stop])
                new.append(Mapping(pos, stop - pos, None, MapState.RELEASED))
                pos = stop
        t.mappings = sorted(mapped + new, key=lambda m: m.va)

    def _restore_tag(self, t: RegionTag) -> int:
        """Map each released chunk and queue the copies into it before mapping the next.
        Returns the bytes copied."""
        # The host copies cut at the mappings' bounds: a piece lands as soon as its chunk is
        # mapped, and the part of a copy over memory freed since the release is left out.
        pieces: dict[int, list[CopyItem]] = {}
        for (va, n), slot in sorted(t.slots.items()):
            for i, m in enumerate(t.mappings):
                lo, hi = max(va, m.va), min(va + n, m.end)
                if lo < hi and m.state is not MapState.MAPPED:
                    sub = HostSlot(slot.chunk, slot.offset + (lo - va), hi - lo, slot.owner)
                    pieces.setdefault(i, []).append(CopyItem(None, sub, hi - lo, (lo, hi - lo)))  # type: ignore[arg-type]
        copied = 0
        last = None
        filling: list[Mapping] = []
        try:
            for i, m in enumerate(t.mappings):
                if m.handle is None:
                    self._unguard(t, m.va, m.end)
                    t0 = time.perf_counter()
                    handle = self.driver.create(m.nbytes)
                    try:
                        self.driver.map(m.va, m.nbytes, handle)
                    except BaseException:
                        self.driver.release(handle)
                        raise
                    finally:
                        self._driver_s += time.perf_counter() - t0
                    m.handle = handle
                    m.state = MapState.FILLING if i in pieces else MapState.MAPPED
                    self.ops.point("region_mapped")
                if m.state is not MapState.FILLING:
                    continue
                filling.append(m)
                items = pieces.get(i, [])
                for it in items:
                    it.storage = self.driver.view(*it.tag).untyped_storage()
                if last is None:
                    self.engine.begin_in()
                for seg in self.engine.plan(items):
                    last = self.engine.copy_in(seg)
                copied += sum(it.nbytes for it in items)
            if last is not None:
                self.engine.publish(last)
        except BaseException:
            self.engine.drain()  # the copies stop here; the host copy stays the live one
            raise
        finally:
            self.engine.release_staging()
        for m in filling:
            m.state = MapState.MAPPED
        self._unguard(t)  # pieces left over addresses freed since the release
        # A host copy that also held memory freed since is stale now; the next release makes
        # a new one of the live ranges.
        for r in [r for r in t.slots if not _covered(t.mappings, *r)]:
            self.arena.release(t.slots.pop(r))
        return copied

    # ---- internals ------------------------------------------------------------------------------
    def _select(self, tags: Iterable[str] | None) -> list[RegionTag]:
        self._check_open()
        if tags is None:
            return list(self._tags.values())
        if isinstance(tags, str):
            tags = [tags]
        out = []
        for name in tags:
            if name not in self._tags:
                raise ValueError(f"region {self.name!r} has no tag {name!r} (tags: {sorted(self._tags)})")
            out.append(self._tags[name])
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"region {self.name!r} is closed; make a new one")

    def _check_not_routing(self, what: str) -> None:
        if getattr(self._routing, "depth", 0):
            raise RuntimeError(
                f"region {self.name!r}: {what}() inside region.allocate(): the copy's own buffers would be "
                f"allocated in the region; call it after the with block"
            )


def _first_reaching(reaches: Sequence[int], end: int) -> int:
    """Index of the first copy event whose copies reach ``end`` or beyond (the last one if
    none); ``reaches`` is non-decreasing."""
    return min(bisect.bisect_left(reaches, end), len(reaches) - 1)
