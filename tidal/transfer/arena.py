"""An exact-size host arena: pinned once, carved into slots, reused across transitions.

Why not ``torch.empty(..., pin_memory=True)`` per tensor: torch's pinned allocator rounds
every block up to a power of two (host RAM up to ~2x the bytes held), and each new
``cudaHostAlloc`` costs ~0.4 s/GiB, paid again whenever the cache misses. Here a batch of
slots is served from one new chunk of exactly the batch's size (plus <= ``alignment_bytes``
per slot), pinned once; released slots go back to a free list and are reused first.

Slots of one batch are laid out contiguously, in the order asked, so the transfer engine can
move a run of small slots with one PCIe copy.

Memory cost: host RAM == :attr:`HostArena.reserved_bytes`, which is the bytes held plus
alignment padding plus free slots not yet reused. Nothing is freed until :meth:`close`.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import time
import weakref
from typing import Sequence

import torch

from tidal.device import DeviceOps

__all__ = ["HostArena", "HostSlot"]


@dataclasses.dataclass(frozen=True)
class HostSlot:
    """``nbytes`` of host memory at byte ``offset`` of chunk ``chunk``."""

    chunk: int
    offset: int
    nbytes: int


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
        self._free_offsets: list[list[int]] = []
        self._free_sizes: list[list[int]] = []
        self._used_bytes = 0
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
        return self._used_bytes

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def alignment_bytes(self) -> int:
        """Every slot starts at a multiple of this; a slot owns ``[offset, align_up(offset +
        nbytes))``, its padding included."""
        return self._alignment

    # ---- slots --------------------------------------------------------------------------------
    def reserve(self, sizes: Sequence[int]) -> list[HostSlot]:
        """Slots for ``sizes`` (bytes), in order. Free space is reused first (first fit); the
        rest come from one new chunk sized exactly for them, laid out contiguously."""
        if self._closed:
            raise RuntimeError("this HostArena was closed; create a new one")
        # Validate everything before taking any free range: a bad size must not leak free space.
        for n in sizes:
            if n < 0:
                raise ValueError(f"slot size must be >= 0, got {n}")
        slots: list[HostSlot | None] = [None] * len(sizes)
        missing: list[int] = []
        for i, n in enumerate(sizes):
            slot = self._take_free(n)
            if slot is None:
                missing.append(i)
            slots[i] = slot
        if missing:
            total = sum(_align_up(sizes[i], self._alignment) for i in missing)
            try:
                chunk_id = self._new_chunk(total)
            except BaseException:
                # The host could not give (or pin) the memory: hand back the free ranges taken
                # above, so a failed reserve leaves the arena exactly as it was.
                for slot in slots:
                    if slot is not None:
                        self._give_back(slot)
                raise
            offset = 0
            for i in missing:
                slots[i] = HostSlot(chunk_id, offset, sizes[i])
                offset += _align_up(sizes[i], self._alignment)
        self._used_bytes += sum(sizes)
        return slots  # type: ignore[return-value]

    def release(self, slot: HostSlot) -> None:
        """Give a slot back; its space is reused by later :meth:`reserve` calls."""
        self._give_back(slot)
        self._used_bytes -= slot.nbytes

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

    def slot_tensor(self, slot: HostSlot) -> torch.Tensor:
        """The slot as a uint8 host tensor with a storage of its own: exactly the slot's
        bytes (no copy). Unlike :meth:`view`, whose storage is the whole chunk, it can be
        handed to code that serializes storages (``torch.save`` writes a tensor's whole
        storage). It keeps the chunk alive, so it stays readable after :meth:`close` (no
        longer pinned then)."""
        chunk = self._chunks[slot.chunk]
        # A buffer over the slot's bytes that holds a reference to the chunk; the tensor made
        # from it holds the buffer. An empty slot gets an empty tensor of its own.
        if slot.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        window = (ctypes.c_ubyte * slot.nbytes).from_address(chunk.data_ptr() + slot.offset)
        window.chunk = chunk
        return torch.frombuffer(window, dtype=torch.uint8)

    def span(self, chunk: int, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of a chunk as one uint8 host tensor (for bucketed copies)."""
        return self._chunks[chunk][start:end]

    def close(self) -> None:
        """Unpin and drop every chunk. Slots handed out become invalid."""
        self._finalizer()
        self._free_offsets = []
        self._free_sizes = []
        self._used_bytes = 0
        self._closed = True

    # ---- internals ---------------------------------------------------------------------------
    def _take_free(self, n: int) -> HostSlot | None:
        span = _align_up(n, self._alignment)
        for chunk_id, (offs, sizes) in enumerate(zip(self._free_offsets, self._free_sizes)):
            for i, size in enumerate(sizes):
                if size >= span:
                    offset = offs[i]
                    if size == span:
                        offs.pop(i)
                        sizes.pop(i)
                    else:
                        offs[i] += span
                        sizes[i] -= span
                    return HostSlot(chunk_id, offset, n)
        return None

    def _new_chunk(self, nbytes: int) -> int:
        t0 = time.perf_counter()
        chunk = self._ops.new_host_buffer(nbytes, pin=self.pinned)
        self.pin_seconds += time.perf_counter() - t0
        self._chunks.append(chunk)
        self._free_offsets.append([])
        self._free_sizes.append([])
        return len(self._chunks) - 1


def _release_chunks(ops: DeviceOps, chunks: list[torch.Tensor], pinned: bool) -> None:
    try:
        for chunk in chunks:
            ops.free_host_buffer(chunk, pinned=pinned)
    finally:
        chunks.clear()
