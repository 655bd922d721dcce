"""Moves queued ahead of a transition, behind the compute: :class:`StoreAhead`, the part of
:class:`~tidal.state.store.OffloadStore` that prefetches offloaded storages (allocated, their
copies in queued, claimed by the next switch without a copy) and writes resident ones back
to their host slots (so their switch out releases them without one)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Collection, Sequence

import torch

from tidal.memory import snapshot
from tidal.state.backends import mark_arriving
from tidal.state.collect import StateEntry
from tidal.state.digest import digest_many
from tidal.state.result import MoveResult
from tidal.transfer.engine import Segment

__all__ = ["Arrival", "StoreAhead", "WriteBack"]


class StoreAhead:
    """Prefetch and write-back, a mixin of :class:`~tidal.state.store.OffloadStore` (whose
    ``__init__`` sets the bookkeeping these methods read)."""

    # ---- ahead of a transition: prefetch and write-back ----------------------------------------
    def prefetch(
        self, entries: Sequence[StateEntry], *, leave_free_bytes: int = 0, limit_bytes: int | None = None
    ) -> MoveResult:
        """Start bringing offloaded ``entries`` back behind the work queued on the current
        stream, and return without waiting for the copies.

        In the order given (give them in the order their next user reads them), as many as fit
        in the device memory that is free (driver-free plus allocator-cached, less
        ``leave_free_bytes``, at most ``limit_bytes``) are allocated and their H2D copies queued
        (direct copies, one ``copy_`` each from its pinned slot: see
        :meth:`TransferEngine.queue_direct`); it stops at the first that does not fit. They stay tracked as
        offloaded until a :meth:`switch` (or :meth:`reload`) brings them in: their memory holds
        none of their bytes yet (:func:`~tidal.state.backends.holds_memory` is False), so every
        reader of the state (``state_dict``, checkpoints, strict access) sees their host copy,
        which stays valid. That switch does not copy them again: the current stream waits for
        their copies (no host wait) and they count as resident. A prefetch lasts until claimed
        or :meth:`cancel_prefetch`; :meth:`host_view` of one (the caller may write the host
        copy) cancels that storage's.

        Memory cost: the device memory of the storages it brings in, from the call on.

        Atomic per storage under any exception (``KeyboardInterrupt`` included): the store
        waits for the copies queued, releases every storage a prefetch allocated (their host
        copies stay the truth) and re-raises. Returns what it queued (``bytes_in``; ``seconds``
        is the host time spent queueing, ``queued`` is set)."""
        if leave_free_bytes < 0:
            raise ValueError(f"leave_free_bytes must be >= 0, got {leave_free_bytes}")
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0 or None, got {limit_bytes}")
        self._check_open()
        if self._in_flight:
            self.recover()
        # No settling of write-backs here: a prefetch touches no resident storage's host slot
        # (and waiting for their copies would cost the host the whole D2H).
        self.forget_unreferenced()
        todo = {e.key: self._offloaded[e.key] for e in entries if e.key in self._offloaded}
        todo = [e for k, e in todo.items() if k not in self._arriving]
        before = snapshot(self.ops)
        room = before.driver_free_bytes + before.cached_free_bytes - leave_free_bytes
        if limit_bytes is not None:
            room = min(room, limit_bytes)
        take: list[StateEntry] = []
        total = 0
        for e in todo:
            if total + e.nbytes > room:
                break
            take.append(e)
            total += e.nbytes
        t0 = time.perf_counter()
        segments, alloc_seconds, queue_seconds = 0, 0.0, 0.0
        if take:
            self._in_flight = True  # cleared once every storage queued is recorded as arriving
            try:
                segments, alloc_seconds, queue_seconds = self._queue_arrivals(take)
            except BaseException:
                self.recover()
                raise
            finally:
                self.engine.release_staging()
            self._in_flight = False
        seconds = time.perf_counter() - t0
        self.last_move = MoveResult(
            bytes_out=0,
            bytes_in=total,
            seconds=seconds,
            release_seconds=0.0,
            driver_free_before=before.driver_free_bytes,
            driver_free_after=before.driver_free_bytes,  # not read again: nothing was released
            segments=segments,
            alloc_seconds=alloc_seconds,
            queue_seconds=queue_seconds,
            queued=True,
        )
        return self.last_move

    def _queue_arrivals(self, take: list[StateEntry]) -> tuple[int, float, float]:
        """Allocate ``take`` and queue their H2D copies (see :meth:`prefetch`); returns the
        segments, and the host seconds spent allocating and inside the queueing call."""
        engine, ops = self.engine, self.ops
        t0 = time.perf_counter()
        # Everything taken fits at once: its memory in one block where the backend can.
        self.backend.reserve([(e.storage, e.nbytes) for e in take])
        for e in take:
            # Allocated while tracked (an exception now frees it again in recover()), then
            # marked: its memory holds none of its bytes until a switch claims it.
            self.backend.restore(e.storage, e.nbytes)
            mark_arriving(e.storage, True)
            self._arriving[e.key] = Arrival(e, next(self._arrival_order))
            ops.point("prefetch_allocated")
        alloc_seconds = time.perf_counter() - t0
        engine.begin_in()
        self._after_departures(engine.h2d_stream, take)
        # Direct copies: the host's time to queue them is what a prefetch costs the phase it
        # runs in.
        items = self._items(take)
        t1 = time.perf_counter()
        event = engine.queue_direct(items, to_device=True)
        queue_seconds = time.perf_counter() - t1
        for e in take:
            self._arriving[e.key].event = event
        verify = self.config.verify
        if verify != "off":
            seg = Segment(items, False, 0, 0, 0)
            ((done, values),) = self._digest_segments([seg], [event], verify)
            for j, e in enumerate(take):
                self._arriving[e.key].digest = (done, values, j)
        for e in take:
            self.backend.seal(e.storage)  # queued: until claimed, its memory holds none of its bytes
        return 1, alloc_seconds, queue_seconds

    def _claim(self, claimed: Sequence[StateEntry], frozen: set[int], what: str) -> None:
        """Count prefetched storages as resident: the current stream waits for their copies."""
        arrivals = [self._arriving[e.key] for e in claimed]
        last = max(arrivals, key=lambda a: a.order)
        # Kernels on the compute stream may read them only after their copies landed; the H2D
        # stream runs its copies in queue order, so the last one's event covers them all.
        with self._timed_stall():
            self.ops.wait_event("compute_after_prefetch", self.ops.current_stream(), last.event)
        if any(a.digest is not None for a in arrivals):
            for done in {id(a.digest[0]): a.digest[0] for a in arrivals if a.digest is not None}.values():
                # The digests of the bytes that arrived must be done before they are read.
                self.engine.wait("prefetch_digested", done)
            checked = [a for a in arrivals if a.digest is not None]
            values = {id(a.digest[1]): a.digest[1] for a in checked}
            read = {k: v.tolist() for k, v in values.items()}  # one read per prefetch's digests
            got = [read[id(a.digest[1])][a.digest[2]] for a in checked]
            self._verify([a.entry for a in checked], got, self.config.verify, what)
        for e in claimed:
            mark_arriving(e.storage, False)  # its bytes are its own once the stream waited
            del self._offloaded[e.key]
            self._arriving.pop(e.key)
            self._came_in(e.key, frozen)
            self.ops.point("prefetch_claimed")

    @property
    def prefetched_bytes(self) -> int:
        """Bytes a prefetch has allocated and queued that no switch has claimed yet."""
        return sum(a.entry.nbytes for a in self._arriving.values())

    def prefetched_keys(self) -> set[int]:
        """Keys of the storages a prefetch has allocated and queued that no switch has claimed."""
        return set(self._arriving)

    def cancel_prefetch(self, *, only: Collection[int] | None = None) -> int:
        """Give back the device memory of prefetched storages (those in ``only``, default all)
        once their copies have landed; they stay offloaded, their host copies valid. Returns
        the bytes released. Atomic per storage under any exception (see :meth:`recover`)."""
        self._check_open()
        gone = [a for k, a in self._arriving.items() if only is None or k in only]
        if not gone:
            return 0
        self._in_flight = True  # a storage unmarked but not yet released is freed by recover()
        last = max(gone, key=lambda a: a.order)
        # The copies into their memory must have landed before the allocator may hand it out.
        self.engine.wait("cancel_after_h2d", last.event)
        if any(a.digest is not None for a in gone):
            self._drain_digests()  # no digest still reads that memory either
        for a in gone:
            mark_arriving(a.entry.storage, False)
            del self._arriving[a.entry.key]
            self.ops.point("prefetch_cancelled")
            self.backend.release(a.entry.storage)
        self.backend.settle()
        self._in_flight = False
        return sum(a.entry.nbytes for a in gone)

    def write_back(self, entries: Sequence[StateEntry]) -> MoveResult:
        """Queue a copy of resident ``entries`` to their host slots behind the work queued on the
        current stream, without waiting and without releasing anything, so that a later
        :meth:`switch` releases those not written since without copying them again.

        The copy reads the bytes as they are once the current stream's queued work has run. The
        device bytes are digested just before and just after the copy, on the copy's stream;
        the host copy counts only if the two digests agree: a write that lands while the copy
        runs, through any path, discards it (the one case not caught is a write undone before
        the copy ends). At the storage's offload its bytes are digested again and copied only
        if they changed, whatever ``check_unchanged`` says. Storages offloaded already or whose
        host copy is valid (frozen) are skipped. The next verb of the store reads the digests
        (waiting for the copy if it has not finished).

        Memory cost: nothing on the device (direct copies, as :meth:`prefetch`); the storages'
        own host slots (reserved here if missing: pinned once). Returns what it queued (``bytes_out``;
        ``seconds`` is the host time spent queueing, ``queued`` is set)."""
        self._check_open()
        if self._in_flight:
            self.recover()
        self._settle_write_backs()
        todo = {e.key: e for e in entries if e.key not in self._offloaded and e.key not in self._host_valid}
        todo = [e for e in todo.values() if e.nbytes > 0]
        before = snapshot(self.ops)
        t0 = time.perf_counter()
        segments, queue_seconds = 0, 0.0
        if todo:
            self.prepare(todo)
            for e in todo:
                self._host_digest.pop(e.key, None)  # its slot is about to be overwritten
            engine, ops = self.engine, self.ops
            storages = [e.storage for e in todo]
            try:
                engine.begin_out()
                with ops.on_stream(engine.d2h_stream):
                    pre = digest_many(storages)
                t1 = time.perf_counter()
                engine.queue_direct(self._items(todo), to_device=False)  # as prefetch() does
                queue_seconds = time.perf_counter() - t1
                with ops.on_stream(engine.d2h_stream):
                    post = digest_many(storages)
                    done = ops.new_event()
                    if done is not None:
                        done.record(engine.d2h_stream)
                segments = 1
            except BaseException:
                engine.drain()  # no copy still writes a slot that nothing records as written
                raise
            # Holds the storages until settled: no block may be reused while the copy reads it.
            self._writing.append(WriteBack(todo, done, pre, post))
            ops.point("write_back_queued")
        self.last_move = MoveResult(
            bytes_out=sum(e.nbytes for e in todo),
            bytes_in=0,
            seconds=time.perf_counter() - t0,
            release_seconds=0.0,
            driver_free_before=before.driver_free_bytes,
            driver_free_after=before.driver_free_bytes,
            segments=segments,
            queue_seconds=queue_seconds,
            queued=True,
        )
        return self.last_move

    def _settle_write_backs(self) -> None:
        """Read the digests of the write-backs queued: a host copy whose storage's bytes were
        the same before and after its copy counts (its digest is recorded)."""
        while self._writing:
            wb = self._writing[0]
            # The copies and the digests around them must have run before the digests are read
            # and before any slot they write is reserved again.
            self.engine.wait("write_back_done", wb.done)
            pre, post = wb.pre.tolist(), wb.post.tolist()
            self._writing.pop(0)
            for e, a, b in zip(wb.entries, pre, post):
                held = self._slots.get(e.key)  # the slot written is still this storage's
                if a == b and e.key not in self._offloaded and held is not None and held[1]() is e.storage:
                    self._host_digest[e.key] = a


@dataclasses.dataclass(eq=False)
class Arrival:
    """A prefetched storage: its record, its place in the H2D queue, the event of its copy,
    and with verify on (digests done event, digests, index)."""

    entry: StateEntry
    order: int
    event: Any = None
    digest: tuple[Any, torch.Tensor, int] | None = None


@dataclasses.dataclass(eq=False)
class WriteBack:
    """Storages copied to their host slots ahead of their offload, and the digests of their
    device bytes before and after the copies (``done`` marks all of it)."""

    entries: list[StateEntry]
    done: Any
    pre: torch.Tensor
    post: torch.Tensor
