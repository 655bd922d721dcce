"""The copy engine: D2H and H2D on their own streams, small tensors moved in buckets.

A GPU has one copy engine per direction, so offloading one role while reloading another
runs both at line rate only if the two directions are on different streams. Every copy is
ordered by events, never by ``record_stream``: the caller decides when a device block may
be freed (after waiting on its copy's event), which keeps the caching allocator honest.

Small storages kill PCIe throughput (each copy pays a fixed cost of several microseconds),
so runs of small storages whose host slots are adjacent are gathered on the device into a
staging buffer (device copies run at ~3 TB/s) and moved in one PCIe copy; on the way back
the staging buffer is scattered into the storages. One multi-tensor kernel does each
gather/scatter.

On the way in, a bucket is scattered on a stream of its own while the copy engine goes on to
the next bucket, which lands in a second staging buffer (the two are used in turn).

Memory cost on the device: at most ``bucket_bytes`` of staging out and twice that in while a
transfer runs (each buffer only as large as the transfer's largest bucket, rounded up to a
power of two); released by :meth:`TransferEngine.release_staging`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from tidal import guard
from tidal.device import DeviceOps
from tidal.transfer.arena import HostArena, HostSlot, _align_up
from tidal.transfer.pacing import CopyPacer

__all__ = ["TransferConfig", "TransferEngine", "CopyItem", "Segment", "byte_view"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How state moves between device and host.

    Attributes:
        bucket_bytes: largest size of a staging bucket; during a transfer the device holds
            at most one bucket's buffer out and two in (used in turn).
        small_tensor_bytes: storages smaller than this are gathered into buckets; larger
            ones are copied directly (one copy each, already at line rate).
        pin_host: page-lock host memory (needed for asynchronous, full-rate copies). Ignored
            on CPU.
        coalesce_allocations: on reload, take the incoming storages' device memory with one
            allocation that the caching allocator then splits, instead of one ``cudaMalloc``
            per storage (each costs enough host time to starve the H2D queue), and so that
            the next offload returns one segment instead of hundreds.
        verify: check that state comes back exactly as it went out. ``"full"`` digests every
            byte on the device at offload and again after the reload (``tidal.state.digest``;
            device memory bandwidth, a few percent of the copy time on a GPU, measured in
            benchmarks/RESULTS.md); ``"sampled"`` digests a few thousand words per storage
            (catches corrupted pages, not single bits); ``"off"`` (default) checks nothing. A
            mismatch raises :class:`~tidal.errors.StateCorruptionError` naming the tensors;
            they stay offloaded (never used with wrong bytes).
        paced_piece_bytes: device-to-host copies reach the copy engine in pieces of at most
            this many bytes, each once the one before has run (:mod:`tidal.transfer.pacing`), so
            a small read the compute stream queues meanwhile (a generated token's ``.item()``)
            waits for one piece instead of every byte queued (on an H100, 64 MiB: about 1.2 ms,
            at the line rate). 0 queues each copy whole. Ignored on CPU.
    """

    bucket_bytes: int = 64 << 20
    small_tensor_bytes: int = 8 << 20
    pin_host: bool = True
    coalesce_allocations: bool = True
    verify: str = "off"
    paced_piece_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.small_tensor_bytes < 0:
            raise ValueError(f"small_tensor_bytes must be >= 0, got {self.small_tensor_bytes}")
        if self.paced_piece_bytes < 0:
            raise ValueError(
                f"paced_piece_bytes must be >= 0 (0: device-to-host copies unpaced), got {self.paced_piece_bytes}"
            )
        if self.verify not in ("off", "sampled", "full"):
            raise ValueError(f"verify must be 'off', 'sampled' or 'full', got {self.verify!r}")
        if self.small_tensor_bytes > self.bucket_bytes:
            raise ValueError(
                f"small_tensor_bytes ({self.small_tensor_bytes}) must not exceed bucket_bytes "
                f"({self.bucket_bytes}): a small storage has to fit in one bucket"
            )


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a 1-D uint8 tensor (no copy). Every byte moves, so views,
    strides and offsets of the tensors that share the storage all survive a round trip.

    A storage tidal guards while its bytes arrive (:mod:`tidal.guard`) is viewed through an
    alias of its memory that carries no guard, so tidal's own copies reach it while every
    other access raises; the alias does not keep the storage alive (its owner does)."""
    if guard.sealed_count() and guard.is_sealed(storage):
        ptr = guard.address(storage)
        if ptr:
            storage = torch._C._construct_storage_from_data_pointer(ptr, storage.device, storage.nbytes())
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclasses.dataclass
class CopyItem:
    """One storage and the host slot that holds its bytes while it is offloaded."""

    storage: torch.UntypedStorage
    slot: HostSlot
    nbytes: int
    tag: Any = None  # the caller's record of the storage (the state layer's entry)


@dataclasses.dataclass
class Segment:
    """A unit of transfer: one large storage, or a bucket of small ones whose host slots
    span ``[start, end)`` of one arena chunk."""

    items: list[CopyItem]
    bucketed: bool
    chunk: int
    start: int
    end: int
    nbytes: int = -1  # the items' bytes (computed when not given; kept up to date by plan())

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = sum(item.nbytes for item in self.items)


class TransferEngine:
    """Moves storages between a device and a :class:`HostArena`.

    The protocol for the caller (the state layer), per transfer:

    * out: :meth:`begin_out`, then :meth:`copy_out` per segment (returns an event), then wait
      on each event (:meth:`wait`) before freeing that segment's device storages.
    * in: allocate the device storages, :meth:`begin_in`, :meth:`copy_in` per segment, then
      :meth:`publish` the last event so the compute stream waits for the data.
    * :meth:`release_staging` when the transfer is over.
    """

    def __init__(
        self,
        ops: DeviceOps,
        arena: HostArena,
        config: TransferConfig | None = None,
        *,
        streams: tuple[Any, Any] | None = None,
        pacer: CopyPacer | None = None,
    ) -> None:
        """``streams``: the (D2H, H2D) copy streams to queue on, shared with other engines of
        the device (see :class:`~tidal.transfer.context.TransferContext`); new ones if None.
        ``pacer``: the :class:`~tidal.transfer.pacing.CopyPacer` of the D2H stream, shared
        with those engines (one of its own if None, on an accelerator)."""
        self.ops = ops
        self.arena = arena
        self.config = config or TransferConfig()
        self.d2h_stream, self.h2d_stream = streams if streams is not None else (ops.new_stream(), ops.new_stream())
        if pacer is not None and pacer.stream is not self.d2h_stream:
            raise ValueError("the pacer given paces another stream than this engine's D2H stream")
        if pacer is None and self.d2h_stream is not None:
            pacer = CopyPacer(ops, self.d2h_stream)
        self.pacer = pacer
        self._staging_out: torch.Tensor | None = None
        # Two incoming staging buffers, used in turn, and the event after each one's last scatter.
        self._staging_in: list[torch.Tensor | None] = [None, None]
        self._scattered: list[Any] = [None, None]
        self._in_buckets = 0
        # A bucket's scatter runs here, beside the H2D stream, so the copy engine goes on to the
        # next copy instead of waiting for the kernel; every incoming segment's event is
        # recorded here too, so it marks that segment and all before it as landed.
        self.scatter_stream = ops.new_stream() if self.h2d_stream is not None else None
        self.bytes_out = 0
        self.bytes_in = 0

    # ---- planning ---------------------------------------------------------------------------
    def plan(self, items: Sequence[CopyItem]) -> list[Segment]:
        """Group items into segments, keeping their order. Consecutive small items whose
        host slots are adjacent in one chunk share a bucket of at most ``bucket_bytes``."""
        cfg = self.config
        # The bucket's D2H copy writes the whole host span [start, end), gaps included, so a
        # slot may join only if the gap before it is the previous slot's own alignment padding.
        # A wider gap can hold another storage's slot (offloaded earlier, its only copy) that
        # the copy would overwrite with staging garbage.
        align = self.arena.alignment_bytes
        segments: list[Segment] = []
        open_bucket: Segment | None = None
        for item in items:
            s = item.slot
            if item.nbytes >= cfg.small_tensor_bytes or not self.ops.is_accelerator:
                open_bucket = None
                segments.append(Segment([item], False, s.chunk, s.offset, s.offset + s.nbytes))
                continue
            if (
                open_bucket is not None
                and s.chunk == open_bucket.chunk
                and open_bucket.end <= s.offset <= _align_up(open_bucket.end, align)
                and s.offset + s.nbytes - open_bucket.start <= cfg.bucket_bytes
            ):
                open_bucket.items.append(item)
                open_bucket.nbytes += item.nbytes
                open_bucket.end = s.offset + s.nbytes
            else:
                open_bucket = Segment([item], True, s.chunk, s.offset, s.offset + s.nbytes)
                segments.append(open_bucket)
        return segments

    # ---- device -> host -------------------------------------------------------------------
    def begin_out(self) -> None:
        # The state may still be written by kernels queued on the compute stream
        # (an optimizer step, a forward); the D2H stream must not read it before them.
        self.ops.wait_stream("d2h_after_compute", self.d2h_stream, self.ops.current_stream())

    def copy_out(self, seg: Segment) -> Any:
        """Queue the copy of a segment to its host slots; returns the event that marks it
        done (None on CPU, where the copy has already happened)."""
        with self.ops.on_stream(self.d2h_stream):
            if seg.bucketed and len(seg.items) > 1:
                staging = self._staging_out_buffer(seg.end - seg.start)
                dst = [staging[it.slot.offset - seg.start : it.slot.offset - seg.start + it.nbytes] for it in seg.items]
                torch._foreach_copy_(dst, [byte_view(it.storage) for it in seg.items])
                self._to_host(self.arena.span(seg.chunk, seg.start, seg.end), staging[: seg.end - seg.start])
            else:
                for it in seg.items:
                    self._to_host(self.arena.view(it.slot), byte_view(it.storage))
            self.bytes_out += seg.nbytes
            self.ops.point("d2h_queued")  # queued, its event not yet recorded
            return self._record(self.d2h_stream)

    # ---- host -> device -------------------------------------------------------------------
    def begin_in(self) -> None:
        # Storages (re)allocated on the compute stream may sit in blocks that kernels
        # queued there still use; the H2D stream must not overwrite them before that.
        self.ops.wait_stream("h2d_after_compute", self.h2d_stream, self.ops.current_stream())

    def copy_in(self, seg: Segment) -> Any:
        """Queue the copy of a segment from its host slots into its (already allocated)
        device storages; returns the event that marks it done, and every segment queued
        before it (None on CPU).

        A bucket lands in one of two staging buffers, taken in turn, and is scattered into its
        storages on :attr:`scatter_stream` while the next copy runs; the buffer's next copy
        waits for that scatter. Memory cost: two buckets of staging on the device."""
        ops = self.ops
        bucket = seg.bucketed and len(seg.items) > 1
        with ops.on_stream(self.h2d_stream):
            if bucket:
                turn = self._in_buckets % 2
                self._in_buckets += 1
                staging = self._staging_in_buffer(turn, seg.end - seg.start)
                if self._scattered[turn] is not None:
                    # The buffer's previous bucket must have been scattered out of it first.
                    ops.wait_event("staging_in_after_scatter", self.h2d_stream, self._scattered[turn])
                staging[: seg.end - seg.start].copy_(self.arena.span(seg.chunk, seg.start, seg.end), non_blocking=True)
            else:
                for it in seg.items:
                    byte_view(it.storage).copy_(self.arena.view(it.slot), non_blocking=True)
            self.bytes_in += seg.nbytes
            ops.point("h2d_queued")  # queued, its event not yet recorded
            copied = self._record(self.h2d_stream)
        if self.scatter_stream is None:  # no streams: the copy has run; scatter it now
            if bucket:
                torch._foreach_copy_([byte_view(it.storage) for it in seg.items], self._pieces(staging, seg))
            return copied
        # The segment's bytes are on the device (and the storages free of the compute stream's
        # earlier kernels, which the H2D stream waited for) before it is scattered or counted in.
        ops.wait_event("scatter_after_h2d", self.scatter_stream, copied)
        with ops.on_stream(self.scatter_stream):
            if bucket:
                torch._foreach_copy_([byte_view(it.storage) for it in seg.items], self._pieces(staging, seg))
            done = self._record(self.scatter_stream)
        if bucket:
            self._scattered[turn] = done
        return done

    @staticmethod
    def _pieces(staging: torch.Tensor, seg: Segment) -> list[torch.Tensor]:
        return [staging[it.slot.offset - seg.start : it.slot.offset - seg.start + it.nbytes] for it in seg.items]

    # ---- queued behind compute ---------------------------------------------------------------
    def queue_direct(self, items: Sequence[CopyItem], *, to_device: bool) -> Any:
        """Queue one direct copy per item (no staging buffer, no gather or scatter) on the copy
        stream of the direction, after whatever the caller ordered that stream behind
        (:meth:`begin_in` / :meth:`begin_out`); returns the event marking them all done.

        For copies queued behind compute (a prefetch, a write-back), where the host's time to
        queue them is what the phase waits for: one ``copy_`` per storage from its host slot,
        each returning once queued where the arena is pinned (from pageable memory the copy
        holds the host until it is done). (One ``cuMemcpyBatchAsync`` call for all of them held the
        host about as long as the copies took once they were large: 0.26 s for 14.2 GB in 678
        copies on an H100, against 0.01-0.016 s this way; benchmarks/RESULTS.md, 2026-11-26.)"""
        stream = self.h2d_stream if to_device else self.d2h_stream
        with self.ops.on_stream(stream):
            for it in items:
                if to_device:
                    byte_view(it.storage).copy_(self.arena.view(it.slot), non_blocking=True)
                else:
                    self._to_host(self.arena.view(it.slot), byte_view(it.storage))
            nbytes = sum(it.nbytes for it in items)
            if to_device:
                self.bytes_in += nbytes
                self.ops.point("h2d_queued")
            else:
                self.bytes_out += nbytes
                self.ops.point("d2h_queued")
            return self._record(stream)

    def publish(self, event: Any) -> None:
        """Make the compute stream wait for an H2D event (no host blocking)."""
        # Kernels on the compute stream may read reloaded state only after it landed.
        self.ops.wait_event("compute_after_h2d", self.ops.current_stream(), event)

    def wait(self, name: str, event: Any) -> None:
        """Block the host until ``event`` (a copy) has completed; ``name`` says why (the sync
        policy sees it)."""
        self.ops.wait_host(name, event)

    def drain(self) -> None:
        """Block the host until every copy queued on either copy stream has completed, also
        those whose event was never recorded (an exception landed between the two): after
        it, no copy reads or writes any device block or host slot."""
        for stream in (self.d2h_stream, self.h2d_stream, self.scatter_stream):
            if stream is not None:
                stream.synchronize()
        if self.pacer is not None:
            self.pacer.synchronize()  # pieces on its second stream that the D2H stream never waited for

    def holds_staging(self) -> bool:
        """Whether a staging buffer is allocated (between a transfer's copies and its end)."""
        return self._staging_out is not None or any(b is not None for b in self._staging_in)

    def release_staging(self) -> None:
        """Drop the staging buffers (their blocks return to the copy streams' pools; an
        incoming one only once the scatters queued from it have run)."""
        self._staging_out = None
        self._staging_in = [None, None]
        self._scattered = [None, None]
        self._in_buckets = 0

    # ---- internals ------------------------------------------------------------------------
    def _to_host(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        """Queue ``host.copy_(dev)`` on the D2H stream (current), paced where configured."""
        piece = self.config.paced_piece_bytes
        if self.pacer is not None and piece and host.numel() > 0:
            self.pacer.copy(host, dev, piece)
        else:
            host.copy_(dev, non_blocking=True)

    def _record(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = self.ops.new_event()
        event.record(stream)
        return event

    def _staging_size(self, nbytes: int) -> int:
        # A buffer as large as its bucket needs, rounded up to a power of two (so buckets of
        # growing sizes reallocate it a few times at most), never above bucket_bytes: a transfer
        # whose buckets are small (a role's biases and norms) does not hold full buckets.
        return max(nbytes, min(self.config.bucket_bytes, 1 << max(nbytes - 1, 0).bit_length()))

    def _staging_in_buffer(self, turn: int, nbytes: int) -> torch.Tensor:
        # Allocated on the H2D stream (current here), read by the scatter stream: the allocator
        # hands the block out again only after the scatters queued by then have run.
        buf = self._staging_in[turn]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(self._staging_size(nbytes), dtype=torch.uint8, device=self.ops.device)
            self.ops.hold_until("staging_in_read_by_scatter", buf, self.scatter_stream)
            self._staging_in[turn] = buf
            self._scattered[turn] = None  # a new block: no scatter of it to wait for
        return buf

    def _staging_out_buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated on the D2H stream that uses it (we are inside on_stream), so its block is
        # reused only in that stream's order; one buffer is enough because the gather, the copy
        # and the next gather are ordered on that stream.
        buf = self._staging_out
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(self._staging_size(nbytes), dtype=torch.uint8, device=self.ops.device)
            self._staging_out = buf
        return buf
