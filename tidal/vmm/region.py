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

import contextlib
import threading
import time
import warnings
from typing import Any, Iterable, Iterator, Sequence

import torch

from tidal.device import DeviceOps
from tidal.errors import InsufficientMemoryError
from tidal.transfer import TransferContext
from tidal.transfer.engine import TransferEngine
from tidal.units import format_bytes
from tidal.vmm.driver import VmmDriver, cuda_driver
from tidal.vmm.moves import RegionMoves
from tidal.vmm.space import AddressSpace
from tidal.vmm.tag import POLICIES, Policy, RegionMove, RegionTag, round_up

__all__ = ["Region", "RegionMove", "RegionTag", "Policy"]


class Region(RegionMoves):
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
        self.map_chunk_bytes = round_up(map_chunk_bytes, driver.granularity)
        self.reserve_bytes = round_up(reserve_bytes, driver.granularity)
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
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
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
