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
import itertools
import warnings
import weakref
from typing import Any, Iterator, Sequence

import torch

from tidal.device import DeviceOps
from tidal.errors import StateCorruptionError
from tidal.state.backends import (
    ResidencyBackend,
    ResizeBackend,
    guarded,
    has_memory,
    mark_arriving,
)
from tidal.state.collect import StateEntry
from tidal.state.digest import digest, digest_many
from tidal.state.ahead import Arrival, StoreAhead, WriteBack
from tidal.state.moves import StoreMoves
from tidal.state.result import MoveResult
from tidal.transfer.arena import HostSlot
from tidal.transfer.context import TransferContext
from tidal.transfer.engine import CopyItem, Segment, TransferConfig

__all__ = ["MoveResult", "OffloadStore"]


class OffloadStore(StoreMoves, StoreAhead):
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
        # (SwitchOptions(wait=False)): host readers of host copies wait for it, H2D copies queue after it.
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
        # unchanged copies (SwitchOptions(check_unchanged=...)): set once a copy has completed, dropped
        # whenever the slot may hold anything else (re-reserved, handed out, overwritten).
        self._host_digest: dict[int, int] = {}
        # key -> its prefetch (prefetch()): device memory allocated and the H2D copy queued; the
        # storage stays tracked (offloaded, holds_memory False) until a switch claims it.
        self._arriving: dict[int, Arrival] = {}
        self._arrival_order = itertools.count()  # queue order on the H2D stream
        # Write-backs queued (write_back()) whose digests are not read yet: every verb settles
        # them first, before any host slot is reserved, released or overwritten.
        self._writing: list[WriteBack] = []
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
        (``SwitchOptions(wait=False)``), or None once the host has waited for them."""
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
