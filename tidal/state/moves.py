"""The store's moves and what undoes them: :class:`StoreMoves`, the part of
:class:`~tidal.state.store.OffloadStore` that offloads, reloads and switches storages (the
copies, the releases and restores through the residency backend, the order of both copy
engines), and frees what a failed move had queued."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Collection, Sequence

import torch

from tidal.errors import InsufficientMemoryError
from tidal.memory import snapshot
from tidal.state.backends import landed
from tidal.state.collect import StateEntry
from tidal.state.digest import digest_many
from tidal.state.handover import ReleaseProgress, RoomSource
from tidal.state.result import MoveResult
from tidal.transfer.engine import Segment

__all__ = ["StoreMoves", "SwitchOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchOptions:
    """How :meth:`StoreMoves.switch` moves (each field's effect is in its docstring): ``what``
    names the move in errors; ``headroom_bytes`` stay free beside what comes in; ``extra_bytes``
    caps the overlap of the two sides (None: what is free); ``release`` gives the freed memory
    back (None: the backend's default; False: keep it for the next move); ``frozen`` and
    ``check_unchanged`` are storage keys (incoming ones never written; out-going ones released
    without a copy where unchanged); ``on_released`` with ``release_chunk_bytes`` gives an
    offload's memory back chunk by chunk; ``room_source`` with ``reserve_max_bytes`` waits for
    memory another process is handing over; ``wait=False``: the host waits for no copy the move
    does not need. The defaults: a plain switch that waits for its copies."""

    what: str = "switch"
    headroom_bytes: int = 0
    extra_bytes: int | None = None
    release: bool | None = None
    frozen: Collection[int] = ()
    check_unchanged: Collection[int] = ()
    on_released: ReleaseProgress | None = None
    release_chunk_bytes: int = 256 << 20
    room_source: RoomSource | None = None
    reserve_max_bytes: int | None = None
    wait: bool = True


class StoreMoves:
    """Offload, reload and switch, a mixin of :class:`~tidal.state.store.OffloadStore`, whose
    ``__init__`` sets the bookkeeping these methods read (entries offloaded and arriving, host
    slots, the transfer engine, the backend)."""

    # ---- verbs --------------------------------------------------------------------------------
    def offload(
        self,
        entries: Sequence[StateEntry],
        *,
        release: bool | None = None,
        on_released: ReleaseProgress | None = None,
        release_chunk_bytes: int = 256 << 20,
        wait: bool = True,
    ) -> MoveResult:
        """Copy ``entries`` to host and free their device memory. Already-offloaded entries
        are skipped. Blocks until the copies are done (``wait=False``: see :meth:`switch`) and
        (unless ``release`` is False) the backend has settled the freed memory (by default:
        back with the driver). ``on_released``: give the memory back chunk by chunk and report
        it (see :meth:`switch`)."""
        how = SwitchOptions(
            release=release, on_released=on_released, release_chunk_bytes=release_chunk_bytes, wait=wait
        )
        return self.switch(entries, [], how)

    def reload(
        self,
        entries: Sequence[StateEntry],
        *,
        what: str = "reload",
        room_source: RoomSource | None = None,
        reserve_max_bytes: int | None = None,
        wait: bool = True,
    ) -> MoveResult:
        """Bring offloaded ``entries`` back (others are skipped). Raises
        :class:`InsufficientMemoryError` before moving anything if they cannot fit, counting
        what ``room_source`` says is still coming (see :meth:`switch`; ``wait=False``: the
        compute stream waits for the copies, the host does not)."""
        how = SwitchOptions(what=what, room_source=room_source, reserve_max_bytes=reserve_max_bytes, wait=wait)
        return self.switch([], entries, how)

    def switch(
        self,
        out_entries: Sequence[StateEntry],
        in_entries: Sequence[StateEntry],
        options: SwitchOptions | None = None,
    ) -> MoveResult:
        """Offload ``out_entries`` while reloading ``in_entries``, both copy engines busy, as
        ``options`` (:class:`SwitchOptions`; None: its defaults) say; their fields below.

        ``check_unchanged``: keys of out-going storages to release without a copy if their
        device bytes are still those their host slot holds. A digest of the device bytes
        (``tidal.state.digest``, every byte, on the device, at HBM bandwidth) is compared with
        the digest taken when the host copy was made; any write, through any path (optimizer
        kernels, ``.data``, in-place ops, raw pointers, NCCL), changes the bytes and so the
        digest, and the storage is copied as usual. Cost: one read of those bytes on the device
        and one host synchronisation per move; it saves their D2H copy when nothing changed.

        ``frozen``: keys of incoming storages their owner declares never written. Their host
        copy stays valid after the reload, so offloading them later copies nothing (the device
        memory is only released; ``MoveResult.bytes_skipped``). With ``verify`` on, such an
        offload first checks the device bytes against the digest taken when they went out, and
        raises ``ValueError`` (nothing moved) if they were written.

        The out-going D2H copies are queued in step with the incoming H2D ones (by their share
        of each side's bytes), so both copy engines start at once; with ``verify`` on, all
        out-going copies first (their digests read beside them). Incoming storages are
        allocated and their H2D copies queued as long as free memory allows; when it runs
        short, the host waits for the next out-going segment's copy, frees it, and goes on. So
        the switch overlaps fully when both sets fit at once and degrades gracefully when they
        do not. With ``wait``, each incoming segment's storages count as resident once its copy
        has landed, while the later ones still copy.

        Incoming storages that a :meth:`prefetch` has allocated and queued already are not
        copied again: the current stream waits for their copies (no host wait) and they count
        as resident (``MoveResult.bytes_prefetched``). Out-going storages whose host copy a
        :meth:`write_back` made are checked as with ``check_unchanged``.

        ``extra_bytes`` caps the overlap: at no point do the two sides hold more than the
        larger of them plus ``extra_bytes`` (None: as much as is free). The copies still run
        on both engines, one segment apart, since freeing waits only for one D2H segment.

        Atomic per storage under any exception (``KeyboardInterrupt`` included), wherever it
        lands: an out-going storage becomes tracked only once its D2H copy has completed, and
        is freed after; an incoming one stays tracked until its H2D copy has completed. So
        every storage is always either resident (valid bytes on the device) or tracked (valid
        bytes on the host). On an exception the store waits for the copies in flight,
        finishes the out-going storages whose copies were queued (tracked, then freed), frees
        the incoming ones (their host copies stay the truth) and re-raises. Should a second
        exception land in that handling, the rule still holds: :meth:`recover` (run by the
        next move, or by the caller) finishes it. The caller learns where each storage is from
        :meth:`is_offloaded`.

        Hand-over between processes (:mod:`tidal.state.handover`), the two ends:

        * ``on_released`` (an offload only): the storages go out in chunks of about
          ``release_chunk_bytes``; each chunk's memory goes back to the driver as soon as its
          D2H copies have completed (while the next chunk's copies run), and
          ``on_released(returned_bytes, total_bytes)`` reports the bytes given back so far.
          Costs one device synchronisation per chunk (the allocator's ``empty_cache``).
        * ``room_source`` (a reload): when the next storages do not fit in what the driver has
          free, wait for ``room_source`` (memory another process is still giving back) and read
          the driver again, instead of failing; the up-front check counts
          ``room_source.pending_bytes()`` as coming. Should the memory not come after all,
          :class:`InsufficientMemoryError` is raised mid-move (nothing lost: the storages not
          yet in stay offloaded). The storages are allocated in runs of at most what has
          arrived and at most ``reserve_max_bytes``, so that their next chunked offload can
          give memory back run by run (the allocator returns only whole runs). Its room is
          what the driver and this process's cache have free (``extra_bytes`` does not apply).

        ``wait=False``: the host waits for no copy that the move does not need to make room.
        The compute stream waits for the incoming copies (as it does anyway) and the host goes
        on at once; out-going storages whose memory the move does not need are tracked and
        released as soon as their copies are queued, the allocator being told to hand their
        blocks out again only after the D2H stream has read them
        (:meth:`~tidal.state.backends.ResidencyBackend.release_after`; a backend that cannot,
        such as an address-stable region, gets its storages after a host wait as usual).
        Every later reader of those host copies waits for them: a reload's H2D copies on the
        device, the host (:meth:`host_view`, checkpoints, slots reused) before it reads. The
        move's ``seconds`` is then the host time and ``queued`` is set. With ``verify`` on,
        the move waits as usual (its digests are read on the host).

        Raises ``ValueError`` (before anything moves) for ``on_released`` with incoming
        entries or with ``release=False``, or a ``release_chunk_bytes`` below 1.
        """
        o = options or SwitchOptions()
        what, headroom_bytes, extra_bytes, release = o.what, o.headroom_bytes, o.extra_bytes, o.release
        frozen, check_unchanged, on_released = o.frozen, o.check_unchanged, o.on_released
        release_chunk_bytes, room_source, reserve_max_bytes, wait = (
            o.release_chunk_bytes,
            o.room_source,
            o.reserve_max_bytes,
            o.wait,
        )
        if on_released is not None and (in_entries or release is False):
            raise ValueError(
                "on_released reports memory given back by an offload: pass no incoming entries "
                "and leave release on (load the next role after, or in the other process)"
            )
        if release_chunk_bytes < 1:
            raise ValueError(f"release_chunk_bytes must be >= 1, got {release_chunk_bytes}")
        if reserve_max_bytes is not None and (room_source is None or reserve_max_bytes < 1):
            raise ValueError(
                f"reserve_max_bytes={reserve_max_bytes} bounds the allocation runs of a load with a "
                f"room_source: pass one with it, and a value >= 1"
            )
        self._check_open()
        if self._in_flight:
            self.recover()
        self._settle_write_backs()
        self.forget_unreferenced()
        engine = self.engine
        # Dedup by key: entries of several roles may list a shared storage more than once; it
        # must move (and be counted) once.
        out_todo = list({e.key: e for e in out_entries if e.key not in self._offloaded}.values())
        in_todo = list({e.key: self._offloaded[e.key] for e in in_entries if e.key in self._offloaded}.values())
        claimed = [e for e in in_todo if e.key in self._arriving]  # allocated and queued by a prefetch
        if claimed:
            in_todo = [e for e in in_todo if e.key not in self._arriving]
        skip = [e for e in out_todo if e.key in self._host_valid]
        if skip:
            self._check_unchanged(skip, what)
            out_todo = [e for e in out_todo if e.key not in self._host_valid]
        digested: dict[int, int] = {}
        # Those the owner asks to check, and those with a host copy a write-back made.
        checked = [e for e in out_todo if e.key in check_unchanged or e.key in self._host_digest]
        t_check = time.perf_counter()
        if checked:
            # Read after the compute stream's queued work (the current stream), then on the host.
            got = digest_many([e.storage for e in checked]).tolist()
            same = {e.key for e, d in zip(checked, got) if self._host_digest.get(e.key) == d}
            skip += [e for e in checked if e.key in same]
            out_todo = [e for e in out_todo if e.key not in same]
            digested = {e.key: d for e, d in zip(checked, got) if e.key not in same and e.key in check_unchanged}
        for e in out_todo:
            self._host_digest.pop(e.key, None)  # its slot is about to be overwritten
        check_seconds = time.perf_counter() - t_check  # part of the move's time
        need_in = sum(e.nbytes for e in in_todo)
        skipped = sum(e.nbytes for e in skip)
        freeable = sum(e.nbytes for e in out_todo) + skipped
        before = snapshot(self.ops)
        staging = self.staging_bytes(int(bool(out_todo)) + 2 * int(bool(in_todo)))  # two buckets in
        room = before.driver_free_bytes + before.cached_free_bytes - headroom_bytes - staging
        coming = room_source.pending_bytes() if room_source is not None and in_todo else 0
        if extra_bytes is not None:
            # What may be loaded beyond what has been freed: then the held bytes never exceed
            # max(out, in) + extra_bytes.
            room = min(room, max(0, need_in - freeable) + extra_bytes)
        if need_in > room + freeable + coming:
            raise InsufficientMemoryError(
                what,
                needed_bytes=need_in + self.staging_bytes(2) + headroom_bytes,
                free_bytes=before.driver_free_bytes + before.cached_free_bytes + freeable + coming,
                hint="Offload another role first, lower the residency budget, or free tensors "
                "that are not part of any role (activations, caches).",
            )
        self.prepare(out_todo)
        # Reserving ahead only when everything incoming fits at once (else blocks are freed and
        # reused one segment at a time, and a reservation would only get in the way).
        coalesce = need_in <= room
        wait = wait or self.config.verify != "off" or on_released is not None
        t0 = time.perf_counter()
        self._in_flight = True  # cleared once every storage is where the bookkeeping says
        try:
            for e in skip:
                # Tracked first (its host copy is whole already), then released: no copy.
                self._offloaded[e.key] = e
                self._host_valid.discard(e.key)
                self.ops.point("offload_skipped")
                self.backend.release(e.storage)
            if on_released is not None:
                segments, alloc_seconds = self._offload_in_chunks(out_todo, release_chunk_bytes, on_released, freeable)
            else:

                def room_now() -> int:
                    # The driver's reading now, this move's own allocations included.
                    s = snapshot(self.ops)
                    return s.driver_free_bytes + s.cached_free_bytes - headroom_bytes - staging

                segments, alloc_seconds = self._move(
                    out_todo,
                    in_todo,
                    room,
                    coalesce,
                    what,
                    set(frozen),
                    claimed,
                    room_source=room_source if in_todo else None,
                    room_now=room_now,
                    reserve_max_bytes=reserve_max_bytes,
                    wait=wait,
                )
        except BaseException:
            self.recover()
            if room_source is not None and in_todo:
                # What the failed load took of memory handed over goes back to the driver, where
                # the next holder counts on it (not into this process's cache).
                self.backend.settle()
            raise
        finally:
            engine.release_staging()
        seconds = time.perf_counter() - t0 + check_seconds
        self._in_flight = False
        # Their copies have completed: the host slots hold exactly the digested bytes.
        for key, d in digested.items():
            if key in self._offloaded:
                self._host_digest[key] = d
        t1 = time.perf_counter()
        if (out_todo or skip) and release is not False:
            self.backend.settle()
        # A move told to release nothing (a streamed step's chunk) is not read again: a driver
        # reading costs the host a call per chunk, and its "after" is the reading before.
        after = snapshot(self.ops) if release is not False else before
        self.last_move = MoveResult(
            bytes_out=freeable - skipped,
            bytes_in=need_in,
            bytes_skipped=skipped,
            bytes_prefetched=sum(e.nbytes for e in claimed),
            seconds=seconds,
            release_seconds=time.perf_counter() - t1,
            driver_free_before=before.driver_free_bytes,
            driver_free_after=after.driver_free_bytes,
            segments=segments,
            alloc_seconds=alloc_seconds,
            queued=not wait and bool(out_todo or in_todo),
            released=release is not False,
        )
        return self.last_move

    def _move(
        self,
        out_todo: list[StateEntry],
        in_todo: list[StateEntry],
        room: int,
        coalesce: bool,
        what: str,
        frozen: set[int],
        claimed: Sequence[StateEntry] = (),
        *,
        room_source: RoomSource | None = None,
        room_now: Any = None,
        reserve_max_bytes: int | None = None,
        wait: bool = True,
    ) -> tuple[int, float]:
        """The copies of :meth:`switch`, in an order where an exception at any point leaves
        every storage resident or tracked. Returns (segments, seconds spent allocating)."""
        # Interrupted: a storage is tracked only once its D2H copy has completed (so its host
        # copy is whole), and an incoming one stays tracked until its H2D copy has completed.
        engine, ops = self.engine, self.ops
        out_segs = engine.plan(self._items(out_todo))
        in_segs = engine.plan(self._items(in_todo))
        ops.point("planned")
        verify = self.config.verify
        engine.begin_out()
        out_events: list = []
        out_digests: list = []  # per out segment: (digests done event, digests)
        in_digests: list = []
        freed = 0
        out_total = sum(seg.nbytes for seg in out_segs)
        in_total = sum(seg.nbytes for seg in in_segs)
        out_queued = 0

        def queue_next_out() -> None:
            nonlocal out_queued
            seg = out_segs[len(out_events)]
            out_events.append(engine.copy_out(seg))
            out_queued += seg.nbytes

        def queue_out(fraction: float) -> None:
            # The out-going segments queued until ``fraction`` of their bytes are.
            while len(out_events) < len(out_segs) and out_queued < fraction * out_total:
                queue_next_out()

        try:
            if verify != "off" or not in_segs:
                queue_out(1.0)
            if verify != "off":
                # On their own stream, reading the bytes while the copy engine does: queued
                # after the copies so the first copy starts at once.
                out_digests = self._digest_segments(out_segs, None, verify)
            engine.begin_in()
            self._after_departures(engine.h2d_stream, in_todo)
            last_in_event = None
            in_events: list = []
            reserved_until, reserve_target = 0, 64 << 20
            alloc_seconds = 0.0
            in_queued = 0
            for i, seg in enumerate(in_segs):
                # Both copy engines busy from the start: the out-going copies are queued in step
                # with the incoming ones (by bytes), so neither direction's first copy waits for
                # the host to have queued all of the other's.
                in_queued += seg.nbytes
                queue_out(in_queued / in_total if in_total else 1.0)
                ta = time.perf_counter()
                if room_source is None and coalesce and i >= reserved_until:
                    # Reserve memory for the next run of segments while the copies queued so
                    # far are in flight; runs grow so the first copy starts at once.
                    reserved_until = self._reserve_device_block(in_segs, i, reserve_target)
                    reserve_target = min(2 * reserve_target, 2 << 30)
                while seg.nbytes > room and freed < len(out_segs):
                    if freed == len(out_events):
                        queue_next_out()  # the next one to free is not queued yet
                    room += self._free_segment(out_segs[freed], out_events[freed], _event(out_digests, freed))
                    freed += 1
                if room_source is not None:
                    while seg.nbytes > room:
                        # Another process gives memory back: the H2D copies queued so far run
                        # while it goes on giving. Read again even when it has finished (it may
                        # have done so since the last reading).
                        more = room_source.wait()
                        room = room_now()
                        ops.point("reload_room_arrived")
                        if not more:
                            break
                    if seg.nbytes > room:
                        raise InsufficientMemoryError(
                            what,
                            needed_bytes=sum(sg.nbytes for sg in in_segs[i:]),
                            free_bytes=max(0, room),
                            hint="The process handing the memory over gave back less than it announced "
                            "(memory it could not release, or a third process took it).",
                        )
                    if i >= reserved_until:
                        # One allocation for the run of storages that fits in what has arrived.
                        cap = min(reserve_target, room, reserve_max_bytes or room)
                        reserved_until = self._reserve_device_block(in_segs, i, cap, within=True)
                        reserve_target = min(2 * reserve_target, 2 << 30)
                # The storages stay tracked (offloaded) while they are allocated and written:
                # an exception before their copy completed frees them again in recover().
                for item in seg.items:
                    self.backend.restore(item.storage, item.nbytes)
                ops.point("reload_allocated")
                alloc_seconds += time.perf_counter() - ta
                room -= seg.nbytes
                last_in_event = engine.copy_in(seg)
                in_events.append(last_in_event)
            queue_out(1.0)
            if verify != "off" and in_segs:
                in_digests = self._digest_segments(in_segs, in_events, verify)
            while freed < len(out_segs):
                if wait or not self._free_segment_behind(out_segs[freed], out_events[freed]):
                    self._free_segment(out_segs[freed], out_events[freed], _event(out_digests, freed))
                freed += 1
            if out_digests:  # every segment's digests were waited for before its free
                self._keep_digests(out_segs, out_digests)
        except BaseException:
            # Finish the out-going half (the storages then live on the host only, tracked), so
            # a failed switch is at least a complete offload; should queueing its rest fail too,
            # what was queued still ends up tracked and freed.
            try:
                queue_out(1.0)
            finally:
                self._free_queued_after_failure(engine, out_segs[: len(out_events)], freed)
            raise
        if claimed:
            self._claim(claimed, frozen, what)
        with self._timed_stall():
            engine.publish(last_in_event)
        if wait and not in_digests:
            for seg, event in zip(in_segs, in_events):
                # A segment's bytes must have landed before its storages count as resident; the
                # storages of each are untracked while the later segments still copy.
                engine.wait("reload_done", event)
                for item in seg.items:
                    self._untrack_arrived(item.tag, frozen)
            return len(out_segs) + len(in_segs), alloc_seconds
        if wait:
            # The bytes must have landed before the storages count as resident (without wait,
            # the compute stream's wait published above orders every reader behind them).
            engine.wait("reload_done", last_in_event)
        if in_digests:
            self._verify(
                [it.tag for seg in in_segs for it in seg.items],
                torch.cat([ds for _, ds in in_digests]).tolist(),
                verify,
                what,
            )
        for e in in_todo:
            self._untrack_arrived(e, frozen)
        return len(out_segs) + len(in_segs), alloc_seconds

    def _untrack_arrived(self, e: StateEntry, frozen: set[int]) -> None:
        """An incoming storage whose bytes have landed becomes resident."""
        landed(e.storage)  # its bytes are in: its guard goes (it is still tracked until the next line)
        del self._offloaded[e.key]
        self._came_in(e.key, frozen)
        self.ops.point("reload_untracked")

    def _offload_in_chunks(
        self, out_todo: list[StateEntry], chunk_bytes: int, on_released: ReleaseProgress, total_bytes: int
    ) -> tuple[int, float]:
        """The copies of an offload whose memory goes back to the driver chunk by chunk
        (:meth:`switch` with ``on_released``). Chunks are at most ``chunk_bytes`` (at least
        one segment). The settle synchronises the device (the allocator's ``empty_cache``), so
        queueing every copy first would hold all the memory until the last one; instead chunk
        ``g + 1`` is queued before chunk ``g`` is settled (its copies run meanwhile, so chunk
        ``g``'s memory comes back once chunk ``g + 1`` is copied too), and chunk ``g + 2`` right
        after, before the report. Memory this process's allocator held beyond the state
        (cached activations) goes back first, reported at once and counted in the total. Same atomicity as
        :meth:`_move`: a storage is tracked once its copy has completed, then released."""
        engine, ops, verify = self.engine, self.ops, self.config.verify
        segs = engine.plan(self._items(out_todo))
        ops.point("planned")
        chunks: list[list[Segment]] = []
        size = chunk_bytes
        for seg in segs:
            if size + seg.nbytes > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(seg)
            size += seg.nbytes
        ends = list(itertools.accumulate(len(c) for c in chunks))
        engine.begin_out()
        queued: list[Segment] = []
        events: list = []
        digests: list = []  # per queued segment: (digests done event, digests)
        freed = 0
        returned = 0

        def queue(chunk: list[Segment]) -> None:
            for seg in chunk:
                events.append(engine.copy_out(seg))
                queued.append(seg)
            if verify != "off":
                # Beside the copies, on the digest stream (see _move).
                digests.extend(self._digest_segments(chunk, None, verify))

        try:
            # What the allocator held besides the state (a phase's cached activations) goes
            # first, before any copy is queued (its device sync waits only for the compute
            # queued now), announced with the rest: the next holder can start on it at once.
            returned = self.backend.settle(final=False)
            total_bytes += returned
            if returned:
                on_released(returned, total_bytes)
            for chunk in chunks[:2]:
                queue(chunk)
            last = max(1, len(chunks)) - 1
            for g in range(last + 1):
                while freed < (ends[g] if chunks else 0):
                    self._free_segment(queued[freed], events[freed], _event(digests, freed))
                    freed += 1
                # Waits for chunk g + 1's copies too (a device sync).
                returned += self.backend.settle(final=g == last)
                if g + 2 < len(chunks):
                    queue(chunks[g + 2])  # before the report: the copy engine idles only while memory is freed
                ops.point("offload_chunk_returned")
                on_released(min(returned, total_bytes), total_bytes)
            if digests:  # every segment's digests were waited for before its free
                self._keep_digests(queued, digests)
        except BaseException:
            # As in _move: the storages whose copies were queued end up tracked and freed.
            self._free_queued_after_failure(engine, queued, freed)
            raise
        return len(segs), 0.0

    def _keep_digests(self, segs: list, digests: list) -> None:
        """Keep the digests taken at offload (one tensor per segment of ``segs``, in order, all
        waited for already) per storage."""
        values = torch.cat([ds for _, ds in digests]).tolist()
        for item, d in zip((it for seg in segs for it in seg.items), values):
            self._digests[item.tag.key] = d

    def _free_queued_after_failure(self, engine: Any, queued: list, freed: int) -> None:
        """After an exception: the copies of the ``queued`` out-going segments complete, and
        those not freed yet (from index ``freed`` on) are freed, their storages tracked as
        offloaded (on the host only)."""
        engine.drain()
        self._drain_digests()
        for seg in queued[freed:]:
            self._free_segment(seg, None)

    def _came_in(self, key: int, frozen: set[int]) -> None:
        # A frozen storage's host copy stays the truth (and its digest the check), unless it
        # was handed out (a state dict may have been loaded into it since).
        if key in frozen and key not in self._exposed:
            self._host_valid.add(key)
        else:
            self._digests.pop(key, None)
        self._exposed.pop(key, None)

    def _reserve_device_block(
        self, segs: Sequence[Segment], first: int, target_bytes: int, *, within: bool = False
    ) -> int:
        """Tell the backend that the storages of ``segs[first:j]`` (about ``target_bytes``;
        ``within``: at most that, but at least one segment) are about to be restored, so it
        can take their memory in one piece; returns ``j``."""
        items, total, j = [], 0, first
        while j < len(segs) and total < target_bytes:
            if within and j > first and total + segs[j].nbytes > target_bytes:
                break
            items += [(it.storage, it.nbytes) for it in segs[j].items]
            total += segs[j].nbytes
            j += 1
        self.backend.reserve(items)
        return j

    def _free_segment(self, seg: Segment, event: object, digested: object = None) -> int:
        # The D2H copy must have read the bytes (and written the host copy) before the storage
        # counts as offloaded and the allocator may hand its block out.
        self.engine.wait("free_after_d2h", event)
        if digested is not None:
            # So must the digest of those bytes (verify), read on its own stream.
            self.engine.wait("free_after_digest", digested)
        for item in seg.items:
            self._offloaded[item.tag.key] = item.tag  # tracked first: the host copy is complete
            self.ops.point("offload_tracked")
            self.backend.release(item.storage)
        return seg.nbytes

    def _free_segment_behind(self, seg: Segment, event: object) -> bool:
        """Track and release the storages of an out-going segment whose D2H copy is queued
        (``event``) without waiting for it: the backend hands their memory out again only
        after the copy has read it. Returns False (nothing done) if the backend cannot defer
        a storage's reuse; the caller then waits and frees as usual."""
        if event is None or not all(self.backend.can_release_after(it.storage) for it in seg.items):
            return False
        order = next(self._departure_order)
        for item in seg.items:
            self._offloaded[item.tag.key] = item.tag  # tracked: its host copy is complete once `event` is
            # Readers of this host copy wait for `event` (the D2H stream runs its copies in order).
            self._departing[item.tag.key] = (order, event)
            self.ops.point("offload_tracked")
            self.backend.release_after(item.storage, self.engine.d2h_stream)
        self._departed = event
        return True


def _event(digested: list, i: int) -> Any:
    """The event marking segment ``i``'s digests done (None when not verifying)."""
    return digested[i][0] if digested else None
