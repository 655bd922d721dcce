"""An exact-size host arena: pinned once, carved into slots, reused across transitions.

Why not ``torch.empty(..., pin_memory=True)`` per tensor: torch's pinned allocator rounds
every block up to a power of two (host RAM up to ~2x the bytes held), and each new
``cudaHostAlloc`` costs ~0.4 s/GiB, paid again whenever the cache misses. Here a batch of
slots is served from one new chunk of exactly the batch's size (plus <= ``alignment_bytes``
per slot), pinned once; released slots go back to a free list and are reused first.

Slots of one batch are laid out contiguously, in the order asked, so the transfer engine can
move a run of small slots with one PCIe copy.

Several owners (a timeshare's store, activation offload, CPUAdam) may share one arena (see
:class:`~tidal.transfer.context.TransferContext`): every slot names its owner, and
:meth:`HostArena.bytes_by_owner` says who holds what.

Memory cost: host RAM == :attr:`HostArena.reserved_bytes`, which is the bytes held plus
alignment padding plus free slots not yet reused. A chunk is freed only by :meth:`trim` (once
every slot in it is free) or :meth:`close`.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import time
import weakref
from typing import Sequence

import torch

from tidal.device import DeviceOps, host_available_bytes
from tidal.errors import HostMemoryError

__all__ = ["HostArena", "HostSlot"]


@dataclasses.dataclass(frozen=True)
class HostSlot:
    """``nbytes`` of host memory at byte ``offset`` of chunk ``chunk``, held by ``owner``."""

    chunk: int
    offset: int
    nbytes: int
    owner: str = ""


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class HostArena:
    """Host memory for offloaded state, in exact-size (optionally pinned) chunks.

    Args:
        ops: the device the memory serves (decides whether pinning is possible).
        pin: page-lock the chunks (default: when the device is an accelerator). Pinned memory
            is what lets a copy run asynchronously at full PCIe rate.
        alignment_bytes: every slot starts at a multiple of this (DMA-friendly addresses).
    """

    def __init__(self, ops: DeviceOps, *, pin: bool | None = None, alignment_bytes: int = 512) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
        self._ops = ops
        self.pinned = ops.is_accelerator if pin is None else bool(pin and ops.is_accelerator)
        self._alignment = alignment_bytes
        self._chunks: list[torch.Tensor] = []
        # Unpin even if the owner forgets close(): freeing registered memory without
        # unregistering it leaves the driver with a stale registration.
        self._finalizer = weakref.finalize(self, _release_chunks, ops, self._chunks, self.pinned)
        # Per chunk: sorted free ranges as parallel lists of offsets and sizes.
        self._chunk_owner: list[str | None] = []  # who a chunk serves; None: its owner closed
        self._free_offsets: list[list[int]] = []
        self._free_sizes: list[list[int]] = []
        self._used_bytes = 0
        # Slots whose handed-out tensor died (see slot_tensor(release_when_dead=True)): released
        # at the next reserve or query, never from inside the garbage collector.
        self._dead: list[HostSlot] = []
        self._dead_owners: list[str] = []  # owners dropped without close(): disowned likewise
        self._closed = False
        self.pin_seconds = 0.0

    # ---- accounting -----------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Host bytes this arena holds (what it costs in RAM)."""
        return sum(c.numel() for c in self._chunks)

    @property
    def used_bytes(self) -> int:
        """Bytes currently given out in slots (the requested sizes, without padding)."""
        self._release_dead()
        return self._used_bytes

    def owner_bytes(self, owner: str) -> int:
        """Host bytes of the chunks serving ``owner``: what it costs in RAM, its free space
        (kept for its own reuse) included."""
        return sum(c.numel() for c, o in zip(self._chunks, self._chunk_owner) if o == owner)

    def bytes_by_owner(self) -> dict[str, int]:
        """Owner -> host bytes of the chunks serving it; ``"unowned"``: chunks whose owner
        closed, reused by the next reservation or freed by :meth:`trim`."""
        held: dict[str, int] = {}
        for c, o in zip(self._chunks, self._chunk_owner):
            if c.numel():
                key = "unowned" if o is None else o
                held[key] = held.get(key, 0) + c.numel()
        return held

    @property
    def num_chunks(self) -> int:
        """Chunks holding memory (trimmed ones excluded)."""
        return sum(1 for c in self._chunks if c.numel())

    @property
    def alignment_bytes(self) -> int:
        """Every slot starts at a multiple of this; a slot owns ``[offset, align_up(offset +
        nbytes))``, its padding included."""
        return self._alignment

    # ---- slots --------------------------------------------------------------------------------
    def reserve(self, sizes: Sequence[int], *, owner: str = "", what: str | None = None) -> list[HostSlot]:
        """Slots for ``sizes`` (bytes), in order, held by ``owner``. Free space is reused first
        (first fit); the rest come from one new chunk sized exactly for them, laid out
        contiguously.

        Raises :class:`~tidal.errors.HostMemoryError` (naming ``what``, default ``owner``, the
        bytes asked for and the host's available memory) if the host cannot give or pin the
        new chunk; the arena is then exactly as it was."""
        if self._closed:
            raise RuntimeError("this HostArena was closed; create a new one")
        self._release_dead()
        # Validate everything before taking any free range: a bad size must not leak free space.
        for n in sizes:
            if n < 0:
                raise ValueError(f"slot size must be >= 0, got {n}")
        slots: list[HostSlot | None] = [None] * len(sizes)
        missing: list[int] = []
        for i, n in enumerate(sizes):
            slot = self._take_free(n, owner)
            if slot is None:
                missing.append(i)
            slots[i] = slot
        if missing:
            total = sum(_align_up(sizes[i], self._alignment) for i in missing)
            try:
                chunk_id = self._new_chunk(total, owner)
            except BaseException as e:
                # The host could not give (or pin) the memory: hand back the free ranges taken
                # above, so a failed reserve leaves the arena exactly as it was.
                for slot in slots:
                    if slot is not None:
                        self._give_back(slot)
                if isinstance(e, (RuntimeError, MemoryError)):
                    raise HostMemoryError(
                        what or owner or "a host arena reservation",
                        needed_bytes=total,
                        available_bytes=_available_here(),
                        cause=str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
                    ) from e
                raise
            offset = 0
            for i in missing:
                slots[i] = HostSlot(chunk_id, offset, sizes[i], owner)
                offset += _align_up(sizes[i], self._alignment)
        self._used_bytes += sum(sizes)
        return slots  # type: ignore[return-value]

    def release(self, slot: HostSlot) -> None:
        """Give a slot back; its space is reused by later :meth:`reserve` calls."""
        if self._closed:
            return  # close() dropped every chunk (and slot) already
        self._give_back(slot)
        self._used_bytes -= slot.nbytes

    def disown(self, owner: str) -> None:
        """``owner`` is done (closed): its chunks serve anyone from now on, and :meth:`trim`
        may free them once no slot uses them. Slots it still holds stay valid."""
        self._chunk_owner[:] = [None if o == owner else o for o in self._chunk_owner]

    def trim(self) -> int:
        """Free (unpin and drop) every chunk of no owner (see :meth:`disown`) that no slot
        uses; returns the bytes freed. Costs a device synchronize per pinned chunk freed;
        owners call it when they close. Chunks of a live owner stay, free or not: it reuses
        them (an activation offloader's chunks are free between steps)."""
        self._release_dead()
        freed = 0
        for i, chunk in enumerate(self._chunks):
            n = chunk.numel()
            if n and self._chunk_owner[i] is None and self._free_offsets[i] == [0] and self._free_sizes[i] == [n]:
                self._ops.free_host_buffer(chunk, pinned=self.pinned)
                # The index stays (slots name chunks by index); the chunk is now empty.
                self._chunks[i] = torch.empty(0, dtype=torch.uint8)
                self._free_offsets[i], self._free_sizes[i] = [], []
                freed += n
        return freed

    def release_later(self, slots: Sequence[HostSlot], *, disown: str | None = None) -> None:
        """Queue ``slots`` for release (and ``disown``'s chunks for :meth:`disown`) at the next
        arena call. Safe from a finalizer or the garbage collector (it only appends)."""
        self._dead.extend(slots)
        if disown is not None:
            self._dead_owners.append(disown)

    def _release_dead(self) -> None:
        while self._dead:
            self.release(self._dead.pop())
        while self._dead_owners:
            self.disown(self._dead_owners.pop())

    def _give_back(self, slot: HostSlot) -> None:
        span = _align_up(slot.nbytes, self._alignment)
        if span == 0:
            return  # a zero-byte slot owns no bytes (it may sit inside a free range)
        offs, sizes = self._free_offsets[slot.chunk], self._free_sizes[slot.chunk]
        i = bisect.bisect_left(offs, slot.offset)
        # A slot overlapping a free range (either neighbour) was released twice; inserting it
        # would make two free ranges overlap and later hand the same bytes to two storages.
        if (i < len(offs) and offs[i] < slot.offset + span) or (i > 0 and offs[i - 1] + sizes[i - 1] > slot.offset):
            raise ValueError(f"double release of host slot {slot}")
        offs.insert(i, slot.offset)
        sizes.insert(i, span)
        # Merge with the right neighbour, then the left one, so free ranges stay maximal.
        if i + 1 < len(offs) and offs[i] + sizes[i] == offs[i + 1]:
            sizes[i] += sizes.pop(i + 1)
            offs.pop(i + 1)
        if i > 0 and offs[i - 1] + sizes[i - 1] == offs[i]:
            sizes[i - 1] += sizes.pop(i)
            offs.pop(i)

    def view(self, slot: HostSlot) -> torch.Tensor:
        """The slot as a uint8 host tensor (no copy)."""
        return self._chunks[slot.chunk][slot.offset : slot.offset + slot.nbytes]

    def address(self, slot: HostSlot) -> int:
        """The host address of the slot's first byte (for copies queued by address)."""
        return self._chunks[slot.chunk].data_ptr() + slot.offset

    def slot_tensor(self, slot: HostSlot, *, release_when_dead: bool = False) -> torch.Tensor:
        """The slot as a uint8 host tensor with a storage of its own: exactly the slot's
        bytes (no copy). Unlike :meth:`view`, whose storage is the whole chunk, it can be
        handed to code that serializes storages (``torch.save`` writes a tensor's whole
        storage). It keeps the chunk alive, so it stays readable after :meth:`close` (no
        longer pinned then). With ``release_when_dead`` the slot is released once that
        storage dies (every tensor viewing it gone), not before: for slots handed to code that
        may keep them past their owner (an optimizer's ``state_dict()`` kept after the
        optimizer)."""
        chunk = self._chunks[slot.chunk]
        # A buffer over the slot's bytes that holds a reference to the chunk; the tensor made
        # from it holds the buffer. An empty slot gets an empty tensor of its own.
        if slot.nbytes == 0:
            if release_when_dead:
                self.release(slot)
            return torch.empty(0, dtype=torch.uint8)
        window = (ctypes.c_ubyte * slot.nbytes).from_address(chunk.data_ptr() + slot.offset)
        window.chunk = chunk
        if release_when_dead:
            window.on_death = _ReleaseOnDeath(self._dead, slot)
        return torch.frombuffer(window, dtype=torch.uint8)

    def span(self, chunk: int, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of a chunk as one uint8 host tensor (for bucketed copies)."""
        return self._chunks[chunk][start:end]

    def close(self) -> None:
        """Unpin and drop every chunk. Slots handed out become invalid."""
        self._finalizer()
        self._free_offsets = []
        self._free_sizes = []
        self._chunk_owner = []
        self._used_bytes = 0
        self._dead.clear()
        self._dead_owners.clear()
        self._closed = True

    # ---- internals ---------------------------------------------------------------------------
    def _take_free(self, n: int, owner: str) -> HostSlot | None:
        # First fit over the owner's own chunks, then over chunks of no owner (adopted). Not
        # over other live owners' chunks: their free space is theirs to reuse (activation
        # offload's chunks are free between steps and needed again at the next one), and
        # taking it would make both owners grow the arena in turn.
        span = _align_up(n, self._alignment)
        for pass_owner in (owner, None):
            slot = self._first_fit(n, span, owner, pass_owner)
            if slot is not None:
                return slot
        return None

    def _first_fit(self, n: int, span: int, owner: str, chunk_owner: str | None) -> HostSlot | None:
        for chunk_id, (offs, sizes) in enumerate(zip(self._free_offsets, self._free_sizes)):
            if self._chunk_owner[chunk_id] != chunk_owner:
                continue
            for i, size in enumerate(sizes):
                if size >= span:
                    offset = offs[i]
                    if size == span:
                        offs.pop(i)
                        sizes.pop(i)
                    else:
                        offs[i] += span
                        sizes[i] -= span
                    self._chunk_owner[chunk_id] = owner
                    return HostSlot(chunk_id, offset, n, owner)
        return None

    def _new_chunk(self, nbytes: int, owner: str) -> int:
        t0 = time.perf_counter()
        chunk = self._ops.new_host_buffer(nbytes, pin=self.pinned)
        self.pin_seconds += time.perf_counter() - t0
        self._chunks.append(chunk)
        self._chunk_owner.append(owner)
        self._free_offsets.append([])
        self._free_sizes.append([])
        return len(self._chunks) - 1


def _available_here() -> int:
    """Host memory a new allocation of this process can still get: the kernel's available
    memory, or what the process's address-space limit leaves, if lower (Linux)."""
    available = host_available_bytes()
    try:
        import resource  # noqa: PLC0415 (POSIX only; read on an error path)

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            available = min(available, max(0, soft - used))
    except (ImportError, OSError, StopIteration, ValueError):
        pass
    return available


class _ReleaseOnDeath:
    """Queues a slot for release when the buffer holding it dies. Only appends: the garbage
    collector may run this in the middle of any arena call, which must not see its free lists
    change under it."""

    __slots__ = ("dead", "slot")

    def __init__(self, dead: list[HostSlot], slot: HostSlot) -> None:
        self.dead, self.slot = dead, slot

    def __del__(self) -> None:
        self.dead.append(self.slot)


def _release_chunks(ops: DeviceOps, chunks: list[torch.Tensor], pinned: bool) -> None:
    try:
        for chunk in chunks:
            ops.free_host_buffer(chunk, pinned=pinned)
    finally:
        chunks.clear()
