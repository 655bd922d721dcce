"""Copies of saved-activation storages between the device and pinned host memory, ordered by
events on three streams: compute (whatever stream the forward and backward run on), D2H and
H2D (the transfer engine's side streams, one per copy engine).

Protocol, per offload batch (the storages one layer group offloads):

* :meth:`GroupMover.offload`: D2H waits for the compute stream (``produced``), copies into
  host slots reserved in one run of the arena, records ``d2h_done``.
* :meth:`GroupMover.release`: the compute stream waits for ``d2h_done``, then the device
  aliases are dropped; the caching allocator may hand their blocks to the very next compute
  kernel, which is now ordered after the copy that read them.
* :meth:`GroupMover.reload`: reload buffers are allocated on the compute stream (the consumer
  owns the blocks: no ``record_stream``), H2D waits for that allocation (``alloc_ready``) and
  for ``d2h_done``, copies, records ``h2d_done``.
* :meth:`GroupMover.consume`: the consuming stream waits for ``h2d_done`` before the first
  kernel that reads a reloaded storage.
* :meth:`GroupMover.dispose`: a storage whose views all died gives its host slot back; if a
  reload of it was never consumed, its block and slot are first ordered after that copy.

Every wait goes through tidal's sync policy (``tidal.device.SyncPolicy``) under one of the
names in ``WAIT_NAMES`` (``act_produce``, ``act_release``, ``act_reload_after_offload``,
``act_alloc``, ``act_consume``, ``act_dispose``), which is how the race tests drop one. On
``device="cpu"`` there are no streams or events: copies are synchronous and every wait is
trivially met, while the bookkeeping runs unchanged.

Memory cost: host, the arena (pinned once, exact size, reused by every later step; it grows
only when a step offloads more than any step before); device, one staging bucket per
direction (``bucket_bytes``) while small storages are moved.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tidal.activations.saved import SavedStorage
from tidal.device import DeviceOps
from tidal.transfer import CopyItem, TransferConfig, TransferContext

__all__ = ["Batch", "GroupMover", "Timer"]

WAIT_NAMES = frozenset(
    {"act_produce", "act_release", "act_reload_after_offload", "act_alloc", "act_consume", "act_dispose"}
)


class Timer:
    """Timing events on device streams; inert on CPU or when disabled."""

    def __init__(self, ops: DeviceOps, enabled: bool) -> None:
        self.ops = ops
        self.enabled = bool(enabled and ops.is_accelerator and ops.module is not None)

    def mark(self, stream: Any = None) -> Any:
        if not self.enabled:
            return None
        ev = self.ops.module.Event(enable_timing=True)
        ev.record(stream if stream is not None else self.ops.current_stream())
        return ev

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class Batch:
    """The storages one group offloads, copied out together and reloaded together."""

    __slots__ = ("index", "records", "d2h_done", "released", "reload_pass", "nbytes")

    def __init__(self, index: int, records: Sequence[SavedStorage]) -> None:
        self.index = index
        self.records = list(records)
        self.d2h_done: Any = None
        self.released = False
        self.reload_pass: int | None = None
        self.nbytes = sum(r.nbytes for r in self.records)


class GroupMover:
    """Owns the host arena, the copy engine and the events of activation offload."""

    def __init__(self, context: TransferContext, *, bucket_bytes: int, small_copy_bytes: int, measure: bool) -> None:
        self.context = context
        self.ops = ops = context.ops
        # Unpaced (tidal.transfer.pacing): the forward that saves activations queues no small
        # reads for pacing to let through, and the measured figures of this path are of whole copies.
        cfg = TransferConfig(
            bucket_bytes=bucket_bytes, small_tensor_bytes=small_copy_bytes, pin_host=True, paced_piece_bytes=0
        )
        self.engine = context.engine(cfg)
        self.arena = self.engine.arena
        self.owner = context.label("ActivationOffloader")
        self.d2h_stream = self.engine.d2h_stream
        self.h2d_stream = self.engine.h2d_stream
        self.timer = Timer(ops, measure)
        # (start, end) timing events: compute-stream waits and copy-stream busy intervals.
        self.stalls: list[tuple[str, int, Any, Any]] = []  # (phase, group index, start, end)
        self.d2h_intervals: list[tuple[Any, Any]] = []
        self.h2d_intervals: list[tuple[Any, Any]] = []

    def _waited(self, name: str, stream: Any, event: Any, phase: str, group: int) -> None:
        start = self.timer.mark(stream)
        self.ops.wait_event(name, stream, event)
        end = self.timer.mark(stream)
        if start is not None:
            self.stalls.append((phase, group, start, end))

    # ---- device -> host ----------------------------------------------------------------------
    def offload(self, batch: Batch) -> None:
        """Queue the D2H copy of every storage of ``batch`` into fresh host slots."""
        if self.ops.is_accelerator:
            produced = self.ops.new_event()
            produced.record(self.ops.current_stream())
            # D2H must not read the activations before the compute kernels that write them ran.
            self.ops.wait_event("act_produce", self.d2h_stream, produced)
        slots = self.arena.reserve([r.nbytes for r in batch.records], owner=self.owner)
        items = []
        for rec, slot in zip(batch.records, slots):
            rec.slot = slot
            rec.batch = batch
            items.append(CopyItem(rec.x_gpu.untyped_storage(), slot, rec.nbytes))
        start = self.timer.mark(self.d2h_stream)
        for seg in self.engine.plan(items):
            batch.d2h_done = self.engine.copy_out(seg)
        if start is not None:
            self.d2h_intervals.append((start, self.timer.mark(self.d2h_stream)))

    def release(self, batch: Batch, *, phase: str = "forward") -> None:
        """Drop the device copies of an offloaded batch, ordered after its D2H copy."""
        if batch.d2h_done is not None:
            # Dropped blocks go back to the compute stream's pool at once; the next kernel
            # that gets one must not overwrite it before the D2H copy has read it.
            self._waited("act_release", self.ops.current_stream(), batch.d2h_done, phase, batch.index)
        for rec in batch.records:
            rec.x_gpu = None
        batch.released = True

    # ---- host -> device ----------------------------------------------------------------------
    def reload(self, batch: Batch) -> int:
        """Queue the H2D copy of every offloaded storage of ``batch`` that is not on the
        device; returns the bytes queued."""
        records = [r for r in batch.records if r.x_gpu is None and r.slot is not None and not r.disposed]
        if not records:
            return 0
        compute = self.ops.current_stream()
        for rec in records:
            # Allocated on the consuming (compute) stream: the block is reused in that
            # stream's order after the views die, so no record_stream is needed.
            rec.x_gpu = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.ops.device)
        if self.ops.is_accelerator:
            alloc_ready = self.ops.new_event()
            alloc_ready.record(compute)
            # The blocks may have just been freed by compute kernels still queued; the
            # H2D copy must not overwrite them before those kernels ran.
            self.ops.wait_event("act_alloc", self.h2d_stream, alloc_ready)
            # The host copy must be complete before it is read back.
            self.ops.wait_event("act_reload_after_offload", self.h2d_stream, batch.d2h_done)
        items = [CopyItem(r.x_gpu.untyped_storage(), r.slot, r.nbytes) for r in records]
        start = self.timer.mark(self.h2d_stream)
        h2d_done = None
        for seg in self.engine.plan(items):
            h2d_done = self.engine.copy_in(seg)
        if start is not None:
            self.h2d_intervals.append((start, self.timer.mark(self.h2d_stream)))
        for rec in records:
            rec.h2d_done = h2d_done
            rec.alloc_stream = compute
            rec.waited_streams = []
            rec.reload_pending_read = h2d_done is not None
        return sum(r.nbytes for r in records)

    def consume(self, rec: SavedStorage, group: int) -> None:
        """Order the current stream after the reload of ``rec`` (once per stream)."""
        event = rec.h2d_done
        if event is None:
            return
        stream = self.ops.current_stream()
        if any(s == stream for s in rec.waited_streams):
            return
        # Kernels that read the reloaded activation must run after its H2D copy landed.
        self._waited("act_consume", stream, event, "backward", group)
        rec.waited_streams.append(stream)
        rec.reload_pending_read = False

    def dispose(self, rec: SavedStorage) -> None:
        """The last view of ``rec`` died: give its host slot back and drop its device copy."""
        if rec.disposed:
            return
        rec.disposed = True
        if rec.reload_pending_read and rec.h2d_done is not None:
            # A reload nobody consumed may still be copying: the block must not go back to
            # the compute stream's pool, nor the slot to the next D2H, before it finished.
            self.ops.wait_event("act_dispose", rec.alloc_stream, rec.h2d_done)
            self.ops.wait_event("act_dispose", self.d2h_stream, rec.h2d_done)
        if rec.slot is not None:
            self.arena.release(rec.slot)
            rec.slot = None
        rec.x_gpu = None

    # ---- measurement -------------------------------------------------------------------------
    def measure_line_rate(self, nbytes: int = 256 << 20, repeats: int = 3) -> tuple[float, float] | None:
        """(D2H, H2D) bytes per second of pinned copies on the offload streams, median of
        ``repeats``; None on CPU. The host slot is given back to the arena afterwards."""
        if not (self.ops.is_accelerator and self.ops.module is not None):
            return None
        slot = self.arena.reserve([nbytes], owner=self.owner)[0]
        x_host = self.arena.view(slot)
        x_gpu = torch.empty(nbytes, dtype=torch.uint8, device=self.ops.device)
        rates: list[list[float]] = [[], []]
        self.ops.synchronize()
        for _ in range(repeats + 1):
            for k, (stream, dst, src) in enumerate(
                ((self.d2h_stream, x_host, x_gpu), (self.h2d_stream, x_gpu, x_host))
            ):
                start = self.ops.module.Event(enable_timing=True)
                end = self.ops.module.Event(enable_timing=True)
                with self.ops.on_stream(stream):
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                rates[k].append(nbytes / (start.elapsed_time(end) / 1e3))
        self.ops.synchronize()
        del x_gpu
        self.arena.release(slot)
        d2h, h2d = (sorted(r[1:])[len(r[1:]) // 2] for r in rates)  # first pass is warm-up
        return d2h, h2d

    def close(self) -> None:
        self.ops.synchronize()
        self.engine.release_staging()
        self.arena.disown(self.owner)
        self.context.trim()
