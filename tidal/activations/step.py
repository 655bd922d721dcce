"""One step of activation offload: the groups of saved storages (one per layer) and the
bookkeeping that offloads, releases and reloads them in order. The context that drives it,
with the saved-tensor hooks, is :class:`tidal.activations.offload.ActivationOffloader`; the
copies and stream waits are in :mod:`tidal.activations.mover`."""

from __future__ import annotations

import threading
from typing import Any

import torch

from tidal.activations.config import LayerMode, StepReport
from tidal.activations.mover import Batch, GroupMover
from tidal.activations.saved import SavedStorage, storage_referenced_elsewhere
from tidal.device import DeviceOps

__all__ = ["Group", "PeakWindows", "Step"]


class PeakWindows:
    """The allocator's peak in each stretch of one step, for the planner: each layer's
    forward and backward, the head's forward (from the last layer's end to the forward's
    exit) and the head's backward (from the forward's exit, after its releases, to the last
    layer's backward).

    A stretch is opened with :meth:`open` (which resets the allocator's peak counter) and
    closed with :meth:`close`; :attr:`peak` holds its peak, :attr:`excess` its peak less what
    was allocated when it opened.
    What happens between a close and the next open (releases, reloads) belongs to no stretch.
    Cost: two allocator-stat reads and a peak reset per stretch, host side only. Side effect:
    afterwards ``torch.cuda.max_memory_allocated`` covers only the stretch since the last
    open; :attr:`step_peak` is the peak over the whole step."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.excess: dict[tuple[str, int], int] = {}
        self.peak: dict[tuple[str, int], int] = {}
        self.step_peak = 0
        self._open: tuple[tuple[str, int], int] | None = None

    def open(self, key: tuple[str, int]) -> None:
        self.close()
        now = self.ops.allocated_bytes()
        self.step_peak = max(self.step_peak, now)
        self.ops.reset_peak()
        self._open = (key, now)

    def close(self) -> None:
        peak = self.ops.peak_allocated_bytes()
        self.step_peak = max(self.step_peak, peak)
        if self._open is not None:
            key, start = self._open
            self.excess[key] = max(self.excess.get(key, 0), peak - start)
            self.peak[key] = max(self.peak.get(key, 0), peak)
            self._open = None


class Group:
    """One layer call of the forward."""

    __slots__ = (
        "index",
        "layer_index",
        "mode",
        "records",
        "kept_bytes",
        "batch",
        "input_keys",
        "input_bytes",
        "fwd_start",
        "fwd_end",
        "bwd_mark",
    )

    def __init__(self, index: int, layer_index: int, mode: LayerMode) -> None:
        self.index = index
        self.layer_index = layer_index
        self.mode = mode
        self.records: list[SavedStorage] = []
        self.kept_bytes: dict[int, int] = {}  # candidates saved raw (KEEP groups): key -> bytes
        self.batch: Batch | None = None
        self.input_keys: set[int] = set()
        self.input_bytes = 0
        self.fwd_start: Any = None
        self.fwd_end: Any = None
        self.bwd_mark: Any = None

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.records) + sum(self.kept_bytes.values())


class Step:
    """One forward under the offloader and the backward passes over its graph. Views point
    here (not at the offloader), so a step outlives the context until its graph dies."""

    def __init__(
        self,
        mover: GroupMover,
        ops: DeviceOps,
        modes: list[LayerMode],
        *,
        prefetch_groups: int,
        lock: threading.RLock,
    ) -> None:
        """``mover`` moves the groups, ``ops`` reads the device's memory; ``prefetch_groups``:
        how many layers ahead the backward reloads; ``lock``: the offloader's, taken where a
        view's death (any thread) changes the step's records."""
        self.mover = mover
        self.modes = modes
        self.prefetch_groups = prefetch_groups
        self.lock = lock
        self.groups: list[Group] = []
        self.batches: list[Batch] = []
        self.current: Group | None = None
        self.gap: list[SavedStorage] = []
        self.live: dict[int, SavedStorage] = {}
        self.inflight: Batch | None = None
        self.pending: list[SavedStorage] = []
        self.live_records = 0
        self.aborted = False  # an exception escaped its forward or backward
        self.forward_open = True
        self.bytes_offloaded = 0
        self.bytes_reloaded = 0
        self.bytes_kept_referenced = 0
        self.pass_id: int | None = None
        self.pass_seen: set[int] = set()
        self.bwd_group = -1
        self.fwd_first: Any = None
        self.fwd_exit: Any = None
        self.bwd_start: Any = None
        self.bwd_end: Any = None
        self.peak: int | None = None
        # Set on the step the planner measures (ActivationOffloader.__enter__).
        self.windows: PeakWindows | None = None
        self.start_allocated = ops.allocated_bytes() if ops.is_accelerator else None
        self.stalls: list = []
        self.d2h_intervals: list = []
        self.h2d_intervals: list = []
        self.report: StepReport | None = None

    # ---- forward ----------------------------------------------------------------------------
    def offload_point(self) -> None:
        """Layer ``len(groups)`` is about to start: offload the group that just ended."""
        if not self.groups:
            return
        if self.inflight is not None:
            # Its copy had one layer of compute to hide behind; holding it longer would keep
            # its memory at the peak (allocation order is host order).
            self.release(self.inflight)
        prev = self.groups[-1]
        retry, self.pending = self.pending, []
        fresh = [r for r in prev.records if r.slot is None and r.x_gpu is not None] if prev.mode.offloads else []
        chosen: list[SavedStorage] = []
        for rec in retry + fresh:
            if rec.disposed or rec.slot is not None:
                continue
            if storage_referenced_elsewhere(rec.x_gpu):
                if rec in retry:
                    self.bytes_kept_referenced += rec.nbytes  # still held a layer later: it stays
                else:
                    self.pending.append(rec)
            else:
                chosen.append(rec)
        if not chosen:
            return
        batch = Batch(prev.index, chosen)
        self.mover.offload(batch)
        prev.batch = batch
        self.batches.append(batch)
        self.inflight = batch
        self.bytes_offloaded += batch.nbytes

    def release(self, batch: Batch) -> None:
        self.mover.release(batch)
        for rec in batch.records:
            if self.live.get(rec.key) is rec:
                del self.live[rec.key]  # its storage may be freed now; the key may be reused
        if self.inflight is batch:
            self.inflight = None

    def close_forward(self) -> None:
        if self.inflight is not None:
            self.release(self.inflight)
        self.bytes_kept_referenced += sum(r.nbytes for r in self.pending if not r.disposed)
        self.pending = []
        self.gap = []
        self.live.clear()
        self.current = None
        self.forward_open = False

    # ---- backward ---------------------------------------------------------------------------
    def on_backward_use(self, gi: int, pid: int) -> None:
        if self.pass_id != pid:
            self.pass_id = pid
            self.pass_seen = set()
            if self.bwd_start is None:
                self.bwd_start = self.mover.timer.mark()
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_end)
        if gi in self.pass_seen:
            return
        self.pass_seen.add(gi)
        if gi >= len(self.groups):
            return  # the tail (head, loss): prefetching now would add to its peak
        group = self.groups[gi]
        self.bwd_group = gi
        if group.bwd_mark is None:
            group.bwd_mark = self.mover.timer.mark()
        if self.windows is not None:
            self.windows.close()  # the previous stretch ends before this layer's reloads
        if group.batch is not None:
            self.reload(group.batch, pid)
        # Prefetch the groups whose backward comes within the next prefetch_groups layers;
        # a farther one would sit on the device (and at the peak) before it is needed.
        lowest = gi - self.prefetch_groups
        for batch in reversed(self.batches):
            if batch.index < lowest:
                break
            if batch.index < gi:
                self.reload(batch, pid)
        if self.windows is not None:
            self.windows.open(("backward", group.layer_index))

    def reload(self, batch: Batch, pid: int | None) -> None:
        if batch.reload_pass == pid and pid is not None:
            return
        batch.reload_pass = pid
        self.bytes_reloaded += self.mover.reload(batch)

    def _pass_end(self) -> None:
        if self.bwd_end is None:
            self.bwd_end = self.mover.timer.mark()
        if self.windows is not None:
            self.windows.close()

    # ---- views --------------------------------------------------------------------------------
    def view_died(self, rec: SavedStorage, view_id: int) -> None:
        with self.lock:
            rec.live_views -= 1
            rec.unpacked_views.discard(view_id)
            if rec.live_views == 0 and not rec.disposed:
                self.mover.dispose(rec)
                self.live_records -= 1

    def abandon(self) -> None:
        """Give back the device copies and host slots of an aborted step whose graph will
        never run (PyTorch keeps some nodes of a backward that a ``KeyboardInterrupt`` stopped
        alive for good, with the views they saved)."""
        with self.lock:
            for rec in self.live.values():
                if not rec.disposed:
                    self.mover.dispose(rec)
            for rec in self.gap + self.pending:
                if not rec.disposed:
                    self.mover.dispose(rec)
            self.live_records = 0
