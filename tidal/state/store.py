"""Where every storage of registered state lives, and the verbs that move it.

Offload = copy the storage's bytes to its host slot, then the residency backend releases its
device memory (``tidal.state.backends``; by default ``storage.resize_(0)``); reload = the
backend restores it and the bytes are copied in. The store admits, keeps the host slots,
schedules the copies, records and recovers; it never frees device memory itself. The tensor
objects (parameters, ``.grad``, optimizer state values, views) never change, so optimizer
keys, hooks and references held by user code stay valid, and nothing is left pointing at GPU
memory (the leak that ``.data = ...`` causes).

The store is shared by every role of a timeshare, so a storage held by two roles has one
host slot, moves once, and is only freed when no resident role holds it (the caller passes
the entries that are free to go).

Host slots persist across cycles (pinned once, reused); slots whose storage has died (e.g.
gradients recreated by ``zero_grad(set_to_none=True)``) are reclaimed at the next transition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
import weakref
from typing import Any, Collection, Iterator, Sequence

import torch

from tidal.device import DeviceOps
from tidal.errors import InsufficientMemoryError, StateCorruptionError
from tidal.memory import snapshot
from tidal.state.backends import (
    ResidencyBackend,
    ResizeBackend,
    guarded,
    has_memory,
    landed,
    mark_arriving,
)
from tidal.state.collect import StateEntry
from tidal.state.digest import digest, digest_many
from tidal.state.handover import ReleaseProgress, RoomSource
from tidal.units import gbps
from tidal.transfer.arena import HostSlot
from tidal.transfer.context import TransferContext
from tidal.transfer.engine import CopyItem, Segment, TransferConfig

__all__ = ["OffloadStore", "MoveResult"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveResult:
    """What one transfer did. ``seconds`` runs from the first copy queued to the last one
    finished (host-synchronised), excluding the allocator release that follows; for a move
    that only ``queued`` its copies (a prefetch, a write-back), it is the host time spent
    queueing them, and nothing was released."""

    bytes_out: int
    bytes_in: int
    seconds: float
    release_seconds: float
    driver_free_before: int
    driver_free_after: int
    segments: int
    alloc_seconds: float = 0.0
    # Bytes released without a D2H copy: their host copy was still valid (a frozen role).
    bytes_skipped: int = 0
    # Bytes brought in whose H2D copy a prefetch had queued already (not copied again).
    bytes_prefetched: int = 0
    # The copies were queued behind compute, not waited for (prefetch, write_back).
    queued: bool = False

    @property
    def bytes_moved(self) -> int:
        return self.bytes_out + self.bytes_in

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_moved, self.seconds)


class OffloadStore:
    """Moves :class:`StateEntry` storages between a device and pinned host memory.

    Memory cost: host RAM equal to the bytes of every storage it has ever offloaded and that
    is still alive (:attr:`host_reserved_bytes`), pinned once, in the arena of its transfer
    context; device memory of at most one staging bucket per direction during a transfer.

    Args:
        ops: the device.
        config: how bytes move.
        release_to_driver: see :class:`~tidal.TimeshareConfig`.
        backend: how device memory is released and restored (default: resize and coalesce).
        context: the transfer context whose streams and arena to use (default: a private one,
            so a store alone accounts its memory alone).
        owner: the label of this store's slots in the context's host-memory account.
    """

    def __init__(
        self,
        ops: DeviceOps,
        config: TransferConfig | None = None,
        *,
        release_to_driver: bool = True,
        backend: ResidencyBackend | None = None,
        context: TransferContext | None = None,
        owner: str | None = None,
    ) -> None:
        self.ops = ops
        self.config = config or TransferConfig()
        # How device memory goes and comes back. release_to_driver=False keeps freed blocks in
        # torch's caching allocator: reusable by this process (the next role, activations),
        # invisible to others, and no driver remap on reload.
        self.backend: ResidencyBackend = backend or ResizeBackend(
            ops, coalesce=self.config.coalesce_allocations, release_to_driver=release_to_driver
        )
        self.context = context if context is not None else TransferContext(ops)
        assert self.context.ops.device == ops.device, "a store's context must be for its device"
        self.engine = self.context.engine(self.config)
        self.arena = self.engine.arena
        self.owner = owner if owner is not None else self.context.label("OffloadStore")
        self._slots: dict[int, tuple[HostSlot, weakref.ref]] = {}
        self._dead_slots: list[int] = []  # keys whose storage died since the last reclaim
        self._offloaded: dict[int, StateEntry] = {}  # strong refs keep offloaded storages alive
        self._in_flight = False  # a move is under way, or was interrupted (see recover())
        self._digests: dict[int, int] = {}  # key -> digest of its bytes at offload (verify)
        self._digest_stream: Any = None  # where verify's digests run, beside the copies
        # key -> (slot, its host tensor) for host copies handed out (host_view), until reloaded
        self._exposed: dict[int, tuple[HostSlot, torch.Tensor]] = {}
        self.last_move: MoveResult | None = None
        self._closed = False
        # The D2H event of the last storages released before their copy completed
        # (switch(wait=False)): host readers of host copies wait for it, H2D copies queue after it.
        self._departed: Any = None
        # key -> (queue order, D2H event) of each storage released that way, until a reader
        # of its host copy has been ordered behind it
        self._departing: dict[int, tuple[int, Any]] = {}
        self._departure_order = itertools.count()
        self._stalls: list[tuple[Any, Any]] = []  # see _timed_stall
        # Time the compute stream's waits for copies (for an owner that reads them: take_stalls).
        self.collect_stalls = False
        # Resident storages whose host slot still holds exactly their bytes: reloaded for an
        # owner that declared them frozen (never written). Offloading one copies nothing.
        self._host_valid: set[int] = set()
        # key -> digest of the bytes its host slot holds, for storages whose owner asks to skip
        # unchanged copies (switch(check_unchanged=...)): set once a copy has completed, dropped
        # whenever the slot may hold anything else (re-reserved, handed out, overwritten).
        self._host_digest: dict[int, int] = {}
        # key -> its prefetch (prefetch()): device memory allocated and the H2D copy queued; the
        # storage stays tracked (offloaded, holds_memory False) until a switch claims it.
        self._arriving: dict[int, _Arrival] = {}
        self._arrival_order = itertools.count()  # queue order on the H2D stream
        # Write-backs queued (write_back()) whose digests are not read yet: every verb settles
        # them first, before any host slot is reserved, released or overwritten.
        self._writing: list[_WriteBack] = []
        # Dropped without close(): its host slots go back to the (shared, longer-lived) arena
        # and its chunks are disowned, so nothing stays pinned for a store that is gone.
        self._finalizer = weakref.finalize(
            self, _give_back_slots, self.arena, self._slots, self._offloaded, self._arriving, self.owner
        )
        self._finalizer.atexit = False  # at interpreter exit the process gives everything back

    # ---- queries ----------------------------------------------------------------------------
    @property
    def interrupted(self) -> bool:
        """A move was interrupted by an exception and :meth:`recover` has not run since."""
        return self._in_flight

    def is_offloaded(self, key: int) -> bool:
        return key in self._offloaded

    def offloaded_entries(self, keys: Sequence[int]) -> list[StateEntry]:
        return [self._offloaded[k] for k in keys if k in self._offloaded]

    def resolve(self, entries: Sequence[StateEntry]) -> list[StateEntry]:
        """Live entries (collected with empty storages included) as the store sees them: an
        offloaded storage becomes the store's record (with its real size); an empty storage
        the store does not hold is not tidal's state and is dropped."""
        out: list[StateEntry] = []
        for e in entries:
            held = self._offloaded.get(e.key)
            if held is not None:
                out.append(held)
            elif e.nbytes > 0:
                out.append(e)
        return out

    def all_offloaded(self) -> list[StateEntry]:
        return list(self._offloaded.values())

    def host_view(self, key: int) -> torch.Tensor | None:
        """The host copy of the offloaded storage ``key`` (``storage_key(storage)``): a 1-D
        ``uint8`` tensor of exactly its ``nbytes``, with a storage of exactly those bytes (so
        ``torch.save`` writes them and nothing else), aliasing the store's host arena (no
        copy). None when the storage is not offloaded (its bytes are on the device, or the
        store never held it).

        Contract: the view is the storage's only copy while it is offloaded, and holds its
        bytes only until the storage is reloaded (its slot then waits for the next offload,
        which overwrites it). Treat it as read-only (e.g. to save it without a reload). The
        one sanctioned write is replacing its bytes in place with bytes of the same layout
        while it stays offloaded (a ``load_state_dict`` or checkpoint loaded into an
        offloaded role): the next reload brings back what was written. Never resize, pin or
        unpin it.
        """
        if key not in self._offloaded:
            return None
        self.wait_departures()  # the caller reads (or writes) the host copy on the host
        if key in self._arriving:
            # The caller may write the host copy, which a prefetch has read already: that
            # storage is brought in again by its reload instead.
            self.cancel_prefetch(only=(key,))
        self._host_digest.pop(key, None)  # the caller may write the host copy (a load_state_dict)
        slot = self._slots[key][0]
        held = self._exposed.get(key)
        if held is None or held[0] != slot:
            # One storage per slot while the storage stays offloaded: two views of a tied
            # weight share it, as the tensors they stand for do.
            held = self._exposed[key] = (slot, self.arena.slot_tensor(slot))
        return held[1].view(-1)

    def host_tensor(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` (a plain tensor whose storage is offloaded) as the same view (dtype, size,
        stride, storage offset) of its host copy: what ``t`` would read if it were resident.
        No copy; the :meth:`host_view` contract applies. None when ``t``'s storage is not
        offloaded in this store."""
        raw = self.host_view(t.untyped_storage()._cdata)
        if raw is None:
            return None
        return torch.empty(0, dtype=t.dtype).set_(raw.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    @property
    def offloaded_bytes(self) -> int:
        return sum(e.nbytes for e in self._offloaded.values())

    @property
    def host_reserved_bytes(self) -> int:
        """Host bytes this store's slots hold (alignment padding included)."""
        return self.arena.owner_bytes(self.owner)

    def staging_bytes(self, directions: int = 1) -> int:
        """Device bytes a transfer may need beyond the state itself."""
        return self.config.bucket_bytes * directions if self.ops.is_accelerator else 0

    # ---- host slots -------------------------------------------------------------------------
    def prepare(self, entries: Sequence[StateEntry]) -> None:
        """Reserve host slots for entries that have none (pinning happens here, once). Call
        it when a role is registered so the first transition does not pay for pinning."""
        self._check_open()
        self._settle_write_backs()  # no write-back may still be writing a slot released below
        if self._dead_slots:
            self.wait_departures()  # nor a copy of a storage released without a wait
        self._reclaim_dead_slots()
        need: list[StateEntry] = []
        seen: set[int] = set()
        for e in entries:
            # A storage shared by two roles may be listed twice; it gets one slot.
            if e.key in seen:
                continue
            seen.add(e.key)
            held = self._slots.get(e.key)
            if held is not None and held[1]() is e.storage and held[0].nbytes == e.nbytes:
                continue
            if held is not None:
                self.wait_departures()  # a queued copy may still write the slot given back here
                self.arena.release(held[0])
                del self._slots[e.key]
            self._host_valid.discard(e.key)
            self._host_digest.pop(e.key, None)
            need.append(e)
        if need:
            dead = self._dead_slots
            slots = self.arena.reserve([e.nbytes for e in need], owner=self.owner, what=_holders(need))
            for e, slot in zip(need, slots):
                # The callback notes the key when the storage dies, so reclaiming looks at the
                # dead ones only (not at every slot, at every transition).
                self._slots[e.key] = (slot, weakref.ref(e.storage, lambda _, k=e.key: dead.append(k)))

    def will_write(self, t: torch.Tensor) -> None:
        """Foreign code is about to write ``t``'s device bytes (a ``load_state_dict`` into a
        resident module): its host copy, if kept valid for a frozen owner, is stale now."""
        local = t if type(t) in (torch.Tensor, torch.nn.Parameter) else getattr(t, "_local_tensor", t)
        self._host_valid.discard(local.untyped_storage()._cdata)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OffloadStore was closed (its host slots are released); create a new one")

    def _reclaim_dead_slots(self) -> None:
        dead, self._dead_slots[:] = list(self._dead_slots), []
        for k in dead:
            held = self._slots.get(k)
            if held is not None and held[1]() is None:  # not a new storage at the same address
                self.arena.release(self._slots.pop(k)[0])
                self._host_valid.discard(k)
                self._host_digest.pop(k, None)

    def forget_unreferenced(self) -> int:
        """Drop offloaded storages that no tensor uses any more (their only holder is this
        store's record): gradients set to None, optimizer state replaced by a
        ``load_state_dict``. Keeping them would hold their host slots for ever and bring dead
        bytes back at :meth:`close`. Returns how many were dropped."""
        # _storage_Use_Count counts the holders of the storage: every tensor (view) on it,
        # plus one for the Python storage object the record holds.
        dead = [k for k, e in self._offloaded.items() if torch._C._storage_Use_Count(e.storage._cdata) <= 1]
        if any(k in self._arriving for k in dead):
            self.cancel_prefetch(only=[k for k in dead if k in self._arriving])
        for k in dead:
            del self._offloaded[k]
            self._exposed.pop(k, None)
            self._digests.pop(k, None)
            self._host_valid.discard(k)
            self._host_digest.pop(k, None)
        return len(dead)

    def _items(self, entries: Sequence[StateEntry]) -> list[CopyItem]:
        return [CopyItem(e.storage, self._slots[e.key][0], e.nbytes, e) for e in entries]

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
        return self.switch(
            entries, [], release=release, on_released=on_released, release_chunk_bytes=release_chunk_bytes, wait=wait
        )

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
        return self.switch(
            [], entries, what=what, room_source=room_source, reserve_max_bytes=reserve_max_bytes, wait=wait
        )

    def switch(
        self,
        out_entries: Sequence[StateEntry],
        in_entries: Sequence[StateEntry],
        *,
        what: str = "switch",
        headroom_bytes: int = 0,
        extra_bytes: int | None = None,
        release: bool | None = None,
        frozen: Collection[int] = (),
        check_unchanged: Collection[int] = (),
        on_released: ReleaseProgress | None = None,
        release_chunk_bytes: int = 256 << 20,
        room_source: RoomSource | None = None,
        reserve_max_bytes: int | None = None,
        wait: bool = True,
    ) -> MoveResult:
        """Offload ``out_entries`` while reloading ``in_entries``, both copy engines busy.

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

        The out-going D2H copies are all queued first. Incoming storages are allocated and
        their H2D copies queued as long as free memory allows; when it runs short, the host
        waits for the next out-going segment's copy, frees it, and goes on. So the switch
        overlaps fully when both sets fit at once and degrades gracefully when they do not.

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
        staging = self.staging_bytes(int(bool(out_todo)) + int(bool(in_todo)))
        room = before.driver_free_bytes + before.cached_free_bytes - headroom_bytes - staging
        coming = room_source.pending_bytes() if room_source is not None and in_todo else 0
        if extra_bytes is not None:
            # What may be loaded beyond what has been freed: then the held bytes never exceed
            # max(out, in) + extra_bytes.
            room = min(room, max(0, need_in - freeable) + extra_bytes)
        if need_in > room + freeable + coming:
            raise InsufficientMemoryError(
                what,
                needed_bytes=need_in + self.staging_bytes(1) + headroom_bytes,
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
        after = snapshot(self.ops)
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
        try:
            for seg in out_segs:
                out_events.append(engine.copy_out(seg))
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
            for i, seg in enumerate(in_segs):
                ta = time.perf_counter()
                if room_source is None and coalesce and i >= reserved_until:
                    # Reserve memory for the next run of segments while the copies queued so
                    # far are in flight; runs grow so the first copy starts at once.
                    reserved_until = self._reserve_device_block(in_segs, i, reserve_target)
                    reserve_target = min(2 * reserve_target, 2 << 30)
                while seg.nbytes > room and freed < len(out_segs):
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
            if verify != "off" and in_segs:
                in_digests = self._digest_segments(in_segs, in_events, verify)
            while freed < len(out_segs):
                if wait or not self._free_segment_behind(out_segs[freed], out_events[freed]):
                    self._free_segment(out_segs[freed], out_events[freed], _event(out_digests, freed))
                freed += 1
            if out_digests:  # every segment's digests were waited for before its free
                self._keep_digests(out_segs, out_digests)
        except BaseException:
            # Finish the out-going half whose copies were queued (the storages then live on
            # the host only, tracked), so a failed switch is at least a complete offload.
            self._free_queued_after_failure(engine, out_segs[: len(out_events)], freed)
            raise
        if claimed:
            self._claim(claimed, frozen, what)
        with self._timed_stall():
            engine.publish(last_in_event)
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
            landed(e.storage)  # its bytes are in: its guard goes (it is still tracked until the next line)
            del self._offloaded[e.key]
            self._came_in(e.key, frozen)
            ops.point("reload_untracked")
        return len(out_segs) + len(in_segs), alloc_seconds

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

    # ---- ahead of a transition: prefetch and write-back ----------------------------------------
    def prefetch(
        self, entries: Sequence[StateEntry], *, leave_free_bytes: int = 0, limit_bytes: int | None = None
    ) -> MoveResult:
        """Start bringing offloaded ``entries`` back behind the work queued on the current
        stream, and return without waiting for the copies.

        In the order given (give them in the order their next user reads them), as many as fit
        in the device memory that is free (driver-free plus allocator-cached, less
        ``leave_free_bytes``, at most ``limit_bytes``) are allocated and their H2D copies queued
        (direct copies, one driver call for all where the driver batches copies: see
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
        segments, alloc_seconds = 0, 0.0
        if take:
            self._in_flight = True  # cleared once every storage queued is recorded as arriving
            try:
                segments, alloc_seconds = self._queue_arrivals(take)
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
            queued=True,
        )
        return self.last_move

    def _queue_arrivals(self, take: list[StateEntry]) -> tuple[int, float]:
        """Allocate ``take`` and queue their H2D copies (see :meth:`prefetch`)."""
        engine, ops = self.engine, self.ops
        t0 = time.perf_counter()
        # Everything taken fits at once: its memory in one block where the backend can.
        self.backend.reserve([(e.storage, e.nbytes) for e in take])
        for e in take:
            # Allocated while tracked (an exception now frees it again in recover()), then
            # marked: its memory holds none of its bytes until a switch claims it.
            self.backend.restore(e.storage, e.nbytes)
            mark_arriving(e.storage, True)
            self._arriving[e.key] = _Arrival(e, next(self._arrival_order))
            ops.point("prefetch_allocated")
        alloc_seconds = time.perf_counter() - t0
        engine.begin_in()
        self._after_departures(engine.h2d_stream, take)
        # Direct copies, one driver call where the driver batches them: the host's time to
        # queue them is what a prefetch costs the phase it runs in.
        items = self._items(take)
        event = engine.queue_direct(items, to_device=True)
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
        return 1, alloc_seconds

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
        segments = 0
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
                engine.queue_direct(self._items(todo), to_device=False)  # as prefetch() does
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
            self._writing.append(_WriteBack(todo, done, pre, post))
            ops.point("write_back_queued")
        self.last_move = MoveResult(
            bytes_out=sum(e.nbytes for e in todo),
            bytes_in=0,
            seconds=time.perf_counter() - t0,
            release_seconds=0.0,
            driver_free_before=before.driver_free_bytes,
            driver_free_after=before.driver_free_bytes,
            segments=segments,
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

    def _check_unchanged(self, entries: list[StateEntry], what: str) -> None:
        """With ``verify`` on: the device bytes of storages declared frozen must still be those
        their host copy holds; raise ``ValueError`` (nothing moved) naming those that changed."""
        mode = self.config.verify
        if mode == "off":
            return
        known = [e for e in entries if e.key in self._digests]
        if not known:
            return
        got = digest_many([e.storage for e in known], mode).tolist()
        changed = [e.name for e, d in zip(known, got) if d != self._digests[e.key]]
        if changed:
            raise ValueError(
                f"{what}: {len(changed)} storage(s) of a role declared frozen were written since they were "
                f"loaded ({', '.join(changed[:5])}); their host copies are stale, so nothing was moved. Add the "
                f"role without frozen=True if it is trained or changed in place"
            )

    def _digest_segments(self, segs: Sequence[Segment], after: Sequence[Any] | None, mode: str) -> list:
        """Queue the digest of every storage of ``segs`` on the digest stream, after the
        compute stream's queued work (``after`` None: the bytes being offloaded) or after each
        segment's H2D event (the bytes just reloaded). Returns, per segment, the event that
        marks its digests done and the digests (0-d device tensors)."""
        ops = self.ops
        if self._digest_stream is None:
            self._digest_stream = ops.new_stream()
        stream = self._digest_stream
        if after is None:
            # The bytes may still be written by kernels queued on the compute stream.
            ops.wait_stream("digest_after_compute", stream, ops.current_stream())
        out = []
        with ops.on_stream(stream):
            for i, seg in enumerate(segs):
                if after is not None:
                    # A reloaded segment is read once its H2D copy has landed.
                    ops.wait_event("digest_after_h2d", stream, after[i])
                values = digest_many([it.storage for it in seg.items], mode)
                done = ops.new_event()
                if done is not None:
                    done.record(stream)
                out.append((done, values))
        return out

    def _drain_digests(self) -> None:
        if self._digest_stream is not None:
            self._digest_stream.synchronize()  # no digest reads a block about to be freed

    def _verify(self, entries: list[StateEntry], got: list[int], mode: str, what: str) -> None:
        """Compare the digests of the reloaded device bytes with those taken at offload; raise
        :class:`StateCorruptionError` naming those that differ (they are still tracked, so
        the caller's recovery frees them and they stay offloaded)."""
        bad = []
        for e, d in zip(entries, got):
            want = self._digests.get(e.key)
            if e.key in self._exposed:
                # Its host copy was handed out and may have been written legitimately (a state
                # dict or checkpoint loaded into it): check the transfer against it as it is.
                want = int(digest(self.arena.view(self._slots[e.key][0]), mode))
            if want is not None and want != d:
                bad.append(f"{e.name} ({e.kind}, {e.nbytes} bytes)")
        if bad:
            raise StateCorruptionError(what, bad)

    def recover(self) -> list[StateEntry]:
        """Make the bookkeeping true again after a move that an exception interrupted: wait
        for every copy still in flight, then free the device bytes of every tracked storage
        that has any (an incoming one whose copy did not finish, or an out-going one tracked
        but not yet freed): its host copy is complete and is the truth. Idempotent; cheap
        when nothing was interrupted. Returns the entries it freed."""
        self.engine.drain()
        self._departed = None  # drained: every copy has completed
        self._departing.clear()
        self._drain_digests()
        self._writing.clear()  # their copies have run; their host copies just do not count
        for a in self._arriving.values():
            mark_arriving(a.entry.storage, False)  # tracked and holding memory: freed below
        self._arriving.clear()
        freed = []
        for e in self._offloaded.values():
            if has_memory(e.storage):  # its bytes its own or still arriving (guarded)
                self.backend.release(e.storage)
                freed.append(e)
            elif not guarded(e.storage):
                self.backend.release(e.storage)  # released, but interrupted before its guard was set
        self.engine.release_staging()
        self._in_flight = False
        return freed

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

    def _after_departures(self, stream: Any, entries: Sequence[StateEntry]) -> None:
        """``stream`` is about to read the host copies of ``entries``: order it behind the D2H
        copies of those among them released without a host wait (:meth:`_free_segment_behind`)."""
        if not self._departing:
            return
        pending = [self._departing.pop(e.key) for e in entries if e.key in self._departing]
        if pending:
            # Their host slots may still be being written by queued D2H copies (in queue order,
            # so the last one's event covers them all).
            self.ops.wait_event("read_after_departure", stream, max(pending, key=lambda p: p[0])[1])

    @contextlib.contextmanager
    def _timed_stall(self) -> Iterator[None]:
        """Around a wait of the compute stream for copies: two timing events on the compute
        stream, whose gap is how long it waited (read by :meth:`take_stalls`)."""
        if not (self.collect_stalls and self.ops.is_accelerator):
            yield
            return
        stream = self.ops.current_stream()
        before, after = self.ops.new_event(timing=True), self.ops.new_event(timing=True)
        before.record(stream)
        yield
        after.record(stream)
        self._stalls.append((before, after))

    def take_stalls(self) -> list[tuple[Any, Any]]:
        """The (before, after) event pairs of the compute stream's waits for copies since the
        last call; the caller reads each pair's gap once both have completed."""
        taken, self._stalls = self._stalls, []
        return taken

    @property
    def departure_event(self) -> Any:
        """The D2H event of the last storages released before their copies completed
        (``switch(wait=False)``), or None once the host has waited for them."""
        return self._departed

    def is_arriving(self, key: int) -> bool:
        """A :meth:`prefetch` has allocated the storage and queued its copy in."""
        return key in self._arriving

    def wait_departures(self) -> None:
        """Block the host until every D2H copy of a storage released without a host wait has
        completed: call before reading or reusing host copies on the host."""
        if self._departed is not None:
            # The host is about to read or reuse host slots those copies write.
            self.engine.wait("host_after_departure", self._departed)
        self._departed = None
        self._departing.clear()

    def close(self) -> None:
        """Release host memory. Refuses while state is offloaded (it would be lost)."""
        if self._in_flight:
            self.recover()
        self._settle_write_backs()
        self.wait_departures()
        if self._offloaded:
            raise RuntimeError(
                f"cannot close the store: {len(self._offloaded)} storages are offloaded and "
                f"exist only on the host; reload them first"
            )
        for slot, _ in self._slots.values():
            self.arena.release(slot)
        self._slots.clear()
        self._exposed.clear()
        self._host_digest.clear()
        self._host_valid.clear()
        self._closed = True
        self._finalizer.detach()
        self.arena.disown(self.owner)
        self.context.trim()


@dataclasses.dataclass(eq=False)
class _Arrival:
    """A prefetched storage: its record, its place in the H2D queue, the event of its copy,
    and with verify on (digests done event, digests, index)."""

    entry: StateEntry
    order: int
    event: Any = None
    digest: tuple[Any, torch.Tensor, int] | None = None


@dataclasses.dataclass(eq=False)
class _WriteBack:
    """Storages copied to their host slots ahead of their offload, and the digests of their
    device bytes before and after the copies (``done`` marks all of it)."""

    entries: list[StateEntry]
    done: Any
    pre: torch.Tensor
    post: torch.Tensor


def _give_back_slots(arena: Any, slots: dict, offloaded: dict, arriving: dict, owner: str) -> None:
    """A store's finalizer (see ``OffloadStore.__init__``): runs inside the garbage collector,
    so it only queues (``HostArena.release_later``)."""
    for a in arriving.values():
        mark_arriving(a.entry.storage, False)
    if offloaded:
        warnings.warn(
            f"an OffloadStore ({owner}) was dropped while {len(offloaded)} storages existed only in its "
            f"host copies: their bytes are lost. Reload the roles and close() the timeshare before dropping it",
            ResourceWarning,
            stacklevel=1,
        )
    arena.release_later([slot for slot, _ in slots.values()], disown=owner)


def _holders(entries: Sequence[StateEntry]) -> str:
    """Who host slots are reserved for, for an error message: the roles, else the store."""
    roles = sorted({e.owner for e in entries if e.owner})
    if not roles:
        return f"reserving host copies of {len(entries)} storages"
    return f"role{'s' if len(roles) > 1 else ''} {', '.join(map(repr, roles))}"


def _event(digested: list, i: int) -> Any:
    """The event marking segment ``i``'s digests done (None when not verifying)."""
    return digested[i][0] if digested else None
