"""Residency backends: how a storage's device memory is released and restored.

The store decides *what* moves and *when* (admission, host slots, the copy schedule, recovery);
a backend decides how the device memory under a storage goes away after its bytes reached the
host, and how it comes back before they return. Protocol::

    class Backend:
        def reserve(self, items: Sequence[tuple[UntypedStorage, int]]) -> None: ...  # about to restore these (a hint)
        def restore(self, storage, nbytes: int) -> None: ...     # give the storage its memory back
        def release(self, storage) -> None: ...                   # take its memory away
        def settle(self, *, final=True) -> int: ...               # after a release: where the memory goes;
                                                                  # returns the bytes given back to the driver
        def can_release_after(self, storage) -> bool: ...         # release_after() serves this storage
        def release_after(self, storage, stream) -> None: ...     # release now, reuse after stream's queued work

:class:`ResizeBackend` (the default, no native code) resizes the storage itself, as FSDP does:
tensors, views and optimizer keys stay valid, but a restored storage may get another device
address. :class:`RegionBackend` keeps addresses for storages allocated in a
:class:`~tidal.vmm.Region` tag (CUDA virtual memory unmapped and mapped again in place) and
hands every other storage to a fallback (resize).

Every storage a backend releases is *guarded* (:mod:`tidal.guard`): any access to its
bytes, by tidal or by code that does not know tidal, raises ``RuntimeError`` with the message
the backend's ``describe`` gives (the role, and what to do), where it would otherwise read freed
or unmapped memory (a segfault; on a GPU an illegal address that poisons the CUDA context).
Nothing is checked per op: torch tests the guard's flag on every data access anyway. A storage
whose bytes are still being copied in is guarded too: a restored storage until the store
calls :func:`landed`, a prefetched one until :func:`mark_arriving` clears it (the copies write
through an alias of the memory, :func:`tidal.transfer.byte_view`).

A storage released keeps its size (its tensors' views and slices stay valid, and reach the
guard's message rather than torch's bounds check), as does one released in place or arriving,
so "moved out" cannot be read off ``nbytes()``: :func:`holds_memory` is the one test every
reader uses (foreign access, strict access, checkpoints, recovery), and :func:`counted_nbytes`
the size tidal counts (0 for a storage without memory). Without a guard (no C++ compiler) a
release is ``resize_(0)`` and reads of moved-out tensors are undefined, as torch leaves them.
"""

from __future__ import annotations

import weakref
from typing import Callable, Protocol, Sequence

import torch

from tidal.device import DeviceOps
from tidal import guard
from tidal.transfer.engine import byte_view
from tidal.vmm import RegionTag

__all__ = [
    "Describe",
    "RegionBackend",
    "ResidencyBackend",
    "ResizeBackend",
    "counted_nbytes",
    "guarded",
    "has_memory",
    "holds_memory",
    "landed",
    "mark_arriving",
    "releasable_in_place",
]

# What a guarded storage says when touched: ``describe(storage, why)`` with ``why`` one of
# "released" (its bytes are on the host), "loading" (restored, its bytes being copied in by a
# load) or "arriving" (a prefetch is copying them in).
Describe = Callable[[torch.UntypedStorage, str], bytes]

_GENERIC = (
    b"tidal: this tensor's bytes were moved to host memory by tidal, and its device storage holds none of "
    b"them now. Bring its role back before using it (inside `with ts.use(role):`, or after the "
    b"offload_optimizer() block), or read its values through state_dict()"
)


def _generic(storage: torch.UntypedStorage, why: str) -> bytes:
    return _GENERIC


# The backends serving region tags (each knows the storages it released in place: their tensors
# look whole but their addresses hold no bytes of theirs), and those tags: storages in them can
# be released in place, resizable or not. Weak: a dropped timeshare takes its entries with it.
_BACKENDS: "weakref.WeakSet[RegionBackend]" = weakref.WeakSet()
_IN_PLACE_TAGS: "weakref.WeakSet[RegionTag]" = weakref.WeakSet()
# How many storages are released in place now (an upper bound: a backend dropped with entries
# leaves its count, which only costs holds_memory its fast path).
_IN_PLACE_COUNT = [0]


def releasable_in_place(storage: torch.UntypedStorage) -> bool:
    """The storage lies in a region tag that an address-stable backend serves."""
    ptr = guard.address(storage)  # guarded or not
    return any(t.find(ptr) is not None for t in list(_IN_PLACE_TAGS))


# Keys of storages whose device memory is allocated but whose bytes are still on their way in,
# ahead of their reload (OffloadStore.prefetch): they hold no bytes of theirs yet. The store
# that marks one keeps the storage alive until it unmarks it, so no other storage takes its key.
_ARRIVING: set[int] = set()


def mark_arriving(storage: torch.UntypedStorage, arriving: bool) -> None:
    """Count ``storage`` as holding none of its bytes (``arriving``) or as itself again (which
    also lifts the guard a backend's :meth:`~ResizeBackend.seal` put on it)."""
    if arriving:
        _ARRIVING.add(storage._cdata)
    else:
        _ARRIVING.discard(storage._cdata)
        guard.unseal(storage, empty=False)


def holds_memory(storage: torch.UntypedStorage) -> bool:
    """The storage's device bytes are its own: it has a size and memory, no backend released
    it (in place or not), and no prefetch is still copying its bytes in."""
    if storage.nbytes() == 0:
        return False
    if not _IN_PLACE_COUNT[0] and not _ARRIVING and not guard.sealed_count():
        return True  # the common case (nothing released, in place or arriving anywhere): no lookup
    key = storage._cdata
    if key in _ARRIVING or guard.is_sealed(storage):
        return False
    return not any(key in b._released for b in list(_BACKENDS))


def has_memory(storage: torch.UntypedStorage) -> bool:
    """The storage has device memory, its bytes its own or not (guarded while they arrive): what
    a recovery must free. Without a guard: :func:`holds_memory` less the arriving mark."""
    if storage.nbytes() == 0:
        return False
    if not guard.available():
        return storage._cdata in _ARRIVING or holds_memory(storage)
    if guard.address(storage) == 0:
        return False
    return not any(storage._cdata in b._released for b in list(_BACKENDS))


def landed(storage: torch.UntypedStorage) -> None:
    """A restored storage's bytes are in (its copy has completed): lift its guard."""
    guard.unseal(storage, empty=False)


def guarded(storage: torch.UntypedStorage) -> bool:
    """Every access to the storage's bytes raises (or there is no guard to set: then True, as
    nothing more can be done for it)."""
    return not guard.available() or guard.is_sealed(storage)


def counted_nbytes(storage: torch.UntypedStorage) -> int:
    """The storage's size as tidal counts it: 0 for one released without its memory (a guarded
    storage keeps its size for its views), else ``nbytes()``."""
    n = storage.nbytes()
    if n and guard.sealed_count() and guard.is_freed(storage):
        return 0
    return n


_LARGE = 1 << 20  # the caching allocator serves larger requests from its large pool
_MIN_RESERVE = 16 << 20


class ResidencyBackend(Protocol):
    def reserve(self, items: Sequence[tuple[torch.UntypedStorage, int]]) -> None: ...

    def restore(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` memory for its ``nbytes`` again. It stays guarded (its bytes are
        not in yet): the store copies them in through an alias of its memory and lifts the
        guard once they have landed (:func:`landed`)."""
        ...

    def release(self, storage: torch.UntypedStorage) -> None:
        """Take its memory away and guard it (idempotent: a released storage that lost its
        guard, an interrupted release, gets it back)."""
        ...

    def seal(self, storage: torch.UntypedStorage) -> None:
        """Guard ``storage``, keeping its memory: its bytes are not its own yet (a prefetch's
        copy is landing in them); :func:`mark_arriving` lifts it."""
        ...

    def can_release_after(self, storage: torch.UntypedStorage) -> bool:
        """:meth:`release_after` can release ``storage`` before the copy reading it has run."""
        ...

    def release_after(self, storage: torch.UntypedStorage, stream) -> None:
        """Release ``storage`` now; its memory is handed out again only after the work queued
        on ``stream`` so far (a D2H copy reading it) has run. Only where
        :meth:`can_release_after` says so."""
        ...

    def settle(self, *, final: bool = True) -> int:
        """Put the memory of the storages released since the last settle where it goes;
        return how many bytes this process gave back to the driver doing so (0 when it keeps
        them), which a cross-process hand-over passes on to the next holder as credit.
        ``final=False``: the offload is still under way (a hand-over settles after every
        chunk), so memory shared with storages not yet copied out must stay."""
        ...


class ResizeBackend:
    """Release a storage's memory (the guard frees it and keeps the size; without a guard
    ``resize_(0)``), ``resize_(nbytes)`` to restore, through torch's
    caching allocator.

    Args:
        ops: the device.
        coalesce: before restoring a run of large storages, make the allocator hold one free
            block that fits them all (:meth:`reserve`), so their ``resize_`` calls split it
            instead of each paying a ``cudaMalloc`` (which costs enough host time to starve the
            copy queue), and the next release returns few allocator segments instead of
            hundreds. Only on an accelerator, and only when the allocator's cache does not
            hold that many free bytes already (then they come from there).
        release_to_driver: after releasing, hand the freed blocks back to the driver
            (:meth:`settle`), so another process (an inference engine) can use them.
        describe: the message a released storage raises when touched (see :data:`Describe`);
            default: one that names no role.

    A released storage keeps its size and is guarded (see the module docstring); without a
    guard, release is ``resize_(0)``. Cost per storage: one call into the guard library each
    way (about 0.5 us more than a bare ``resize_``, measured on an H100 with torch 2.11).
    """

    def __init__(
        self,
        ops: DeviceOps,
        *,
        coalesce: bool = True,
        release_to_driver: bool = True,
        describe: Describe | None = None,
    ) -> None:
        self.ops = ops
        self.coalesce = coalesce and ops.is_accelerator
        self.release_to_driver = release_to_driver
        self.describe: Describe = describe or _generic
        guard.warn_once()  # builds the guard now (once per process), not in the first transition

    def reserve(self, items: Sequence[tuple[torch.UntypedStorage, int]]) -> None:
        if not self.coalesce:
            return
        nbytes = [n for _, n in items]
        # The allocator rounds large requests to 512 bytes; smaller ones come from 2 MiB
        # small-pool segments that this block cannot serve.
        large = sum(-(-n // 512) * 512 for n in nbytes if n > _LARGE)
        if large < _MIN_RESERVE:
            return
        if self.ops.cached_free_bytes() >= large:
            # The allocator holds that much free already (memory kept in-process: the blocks
            # these storages, or others, had): the storages take it without asking the driver.
            # One block of it all would rarely be free in one piece, so reserving would map new
            # memory beside the cache instead: the suspect for the 0.37 s of host time a step
            # that a 12.3 GB optimizer-state prefetch took on an H100, the device idle meanwhile
            # (benchmarks/RESULTS.md, 2026-11-26).
            return
        try:
            # Allocated and freed on the current stream, whose pool the storages' resize_
            # calls draw from.
            block = torch.empty(large, dtype=torch.uint8, device=self.ops.device)
            del block
        except torch.OutOfMemoryError:
            pass  # fragmented: those storages fall back to one allocation each

    def restore(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        guard.unseal(storage, empty=True)  # size 0 again: resize_ allocates it
        storage.resize_(nbytes)
        # Guarded again until its bytes have landed: a reader in another thread must not see the
        # new block's old contents (the copy writes through an alias of the memory).
        guard.seal(storage, self.describe(storage, "loading"))

    def release(self, storage: torch.UntypedStorage) -> None:
        guard.release(storage, self.describe(storage, "released"))

    def seal(self, storage: torch.UntypedStorage) -> None:
        guard.seal(storage, self.describe(storage, "arriving"))

    def can_release_after(self, storage: torch.UntypedStorage) -> bool:
        return self.ops.is_accelerator

    def release_after(self, storage: torch.UntypedStorage, stream) -> None:
        # The D2H copy queued on `stream` still reads the block: nothing else may be put there
        # before it has run (the allocator records an event at the free and polls it).
        self.ops.hold_until("free_behind_d2h", byte_view(storage), stream)
        guard.release(storage, self.describe(storage, "released"))

    def settle(self, *, final: bool = True) -> int:
        # Whole free segments only: a segment a storage still copying out lies in stays.
        if not self.release_to_driver:
            return 0
        before = self.ops.reserved_bytes()
        # Other processes (an inference engine) only see what the driver sees.
        self.ops.release_to_driver()
        # This process's own reading: the driver's free memory also moves with other processes.
        return max(0, before - self.ops.reserved_bytes())


class RegionBackend:
    """Address-stable residency for storages allocated in region tags; any other storage goes
    to ``fallback``.

    The store copies a storage's bytes as always; releasing one only marks it (its tensors keep
    their size and addresses). :meth:`settle` then gives a tag's memory back to the driver
    (:meth:`Region.release`): the released storages without a copy, any other block allocated
    in the tag (a module's plain tensor attribute, a tensor of the caller's) copied by the
    region and restored with it. Restoring the first storage of a released tag maps the whole
    tag again at the same addresses; the store then copies the bytes in. Tags are registered
    with :meth:`add` and must have policy ``"discard"`` (the store holds the copy).

    Memory cost: none beyond the region's (its scratch guard while released).
    """

    def __init__(self, fallback: ResidencyBackend, *, describe: Describe | None = None) -> None:
        self.fallback = fallback
        if describe is not None:
            fallback.describe = describe  # type: ignore[attr-defined]
        self.describe: Describe = describe or getattr(fallback, "describe", _generic)
        self._tags: list[RegionTag] = []
        self._pending: set[RegionTag] = set()  # tags with storages released since the last settle
        # storage key -> (tag, address, bytes, the storage): held, so no other storage can take
        # its key while it is listed here
        self._released: dict[int, tuple[RegionTag, int, int, torch.UntypedStorage]] = {}
        _BACKENDS.add(self)

    def add(self, tag: RegionTag) -> bool:
        """Serve the storages allocated in ``tag`` (see :meth:`check`); returns whether it is new."""
        self.check(tag)
        if tag in self._tags:
            return False
        self._tags.append(tag)
        _IN_PLACE_TAGS.add(tag)
        return True

    def remove(self, tag: RegionTag) -> None:
        """Stop serving ``tag`` (none of its storages may be released)."""
        assert not any(e[0] is tag for e in self._released.values()), "a released storage's tag"
        self._tags.remove(tag)
        if not any(tag in b._tags for b in _BACKENDS):
            _IN_PLACE_TAGS.discard(tag)

    @staticmethod
    def check(tag: RegionTag) -> None:
        """``TypeError`` unless ``tag`` is a region tag, ``ValueError`` unless its policy is ``"discard"``."""
        if not isinstance(tag, RegionTag):
            raise TypeError(f"expected a tidal.vmm.RegionTag (region.tag(name)), got {type(tag).__name__}")
        if tag.policy != "discard":
            raise ValueError(
                f"region {tag.region.name!r}, tag {tag.name!r} has policy {tag.policy!r}: a role's store copies its "
                f"bytes itself, so the tag must not copy them again; declare it with policy='discard'"
            )

    def tag_of(self, storage: torch.UntypedStorage) -> RegionTag | None:
        """The registered tag whose allocations hold ``storage``, if any."""
        if not self._tags:
            return None
        ptr = guard.address(storage)  # guarded or not
        for t in self._tags:
            if t.find(ptr) is not None:
                return t
        return None

    def reserve(self, items: Sequence[tuple[torch.UntypedStorage, int]]) -> None:
        # Storages released in place come back in their own memory: no room to make for them.
        self.fallback.reserve([(s, n) for s, n in items if s._cdata not in self._released])

    def release(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._released:
            guard.seal(storage, self.describe(storage, "released"))  # idempotent; a lost guard comes back
            return
        tag = self.tag_of(storage)
        if tag is None:
            self.fallback.release(storage)
            return
        self._released[key] = (tag, guard.address(storage), storage.nbytes(), storage)
        _IN_PLACE_COUNT[0] += 1
        self._pending.add(tag)
        # Its memory stays mapped until settle() unmaps the tag; from here on it is not its own.
        guard.seal(storage, self.describe(storage, "released"))

    def can_release_after(self, storage: torch.UntypedStorage) -> bool:
        # A tag's memory is unmapped whole at settle: its storages go only once their copies ran.
        return self.tag_of(storage) is None and self.fallback.can_release_after(storage)

    def release_after(self, storage: torch.UntypedStorage, stream) -> None:
        assert self.tag_of(storage) is None, "a region tag's storage released before its copy ran"
        self.fallback.release_after(storage, stream)

    def restore(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        entry = self._released.get(storage._cdata)
        if entry is None:
            self.fallback.restore(storage, nbytes)
            return
        tag = entry[0]
        if not tag.resident:
            tag.region.restore([tag.name])  # the whole tag, at the same addresses; no copy
        del self._released[storage._cdata]
        _IN_PLACE_COUNT[0] -= 1
        # Mapped again at its address; guarded until the store's copy of its bytes has landed.
        guard.seal(storage, self.describe(storage, "loading"))

    def seal(self, storage: torch.UntypedStorage) -> None:
        guard.seal(storage, self.describe(storage, "arriving"))

    def settle(self, *, final: bool = True) -> int:
        if not final:
            # A tag goes back whole: not while storages of it may still be copying out.
            return self.fallback.settle(final=False)
        given = 0
        for tag in list(self._pending):
            released = sorted((e[1], e[2]) for e in self._released.values() if e[0] is tag)
            if not released:
                self._pending.discard(tag)  # brought back before it was settled (a recovered transition)
                continue
            # Blocks of the tag that are no released storage's (a plain tensor attribute of a
            # module, a tensor of the caller's) are copied by the region and come back with it.
            other = [(va, n) for va, n in tag._allocated_blocks() if not _inside(released, va, n)]
            if tag.resident:
                mapped = tag.mapped_bytes
                tag.region.release([tag.name], keep={tag.name: other} if other else None)
                given += max(0, mapped - tag.mapped_bytes)
            self._pending.discard(tag)
        return given + self.fallback.settle()


def _inside(ranges: Sequence[tuple[int, int]], va: int, n: int) -> bool:
    """The block at ``va`` is a released storage's (a block may be rounded up past the storage's end)."""
    return any(lo <= va < lo + m for lo, m in ranges)
