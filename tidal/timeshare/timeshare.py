"""Roles that take turns on one device.

``with ts.use("reference"):`` makes the reference role resident. If the residency budget does
not let the roles already on the device stay, the least recently used ones go out while the
new one comes in, in one overlapped switch (D2H and H2D on separate copy engines). A role
stays resident after its block until another role needs the room, so a switch happens only
when the next role is asked for.

Memory cost: host RAM equal to the state bytes of every role that has been offloaded (pinned
once, at :meth:`Timeshare.add_role`); device memory for the resident roles plus one staging
bucket per direction during a transition.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

from tidal.state.backends import RegionBackend, ResizeBackend
from tidal.state.collect import StateEntry
from tidal.state.foreign import MovedOutMessages, lock_of
from tidal.state.handover import ReleaseProgress, RoomSource
from tidal.state.result import MoveResult
from tidal.state.store import OffloadStore
from tidal.timeshare.config import TimeshareConfig
from tidal.timeshare.evict import EvictionChoice, check_keep_free_bytes
from tidal.timeshare.hooks import RoleHooks
from tidal.timeshare.lending import Lending, local_storage_key
from tidal.timeshare.optim_state import OptimizerStateMoves
from tidal.timeshare.prefetching import Prefetching
from tidal.timeshare.registration import Registration, timeshare_of
from tidal.timeshare.role import Role
from tidal.timeshare.residency import policy_for
from tidal.timeshare.threads import serialised, wait_for_room
from tidal.timeshare.telemetry import TransitionLog, TransitionRecord, format_report
from tidal.timeshare.transition import TransitionRunner
from tidal.transfer.context import TransferContext

__all__ = ["Timeshare", "TimeshareConfig", "timeshare_of"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Timeshare(Registration, Prefetching, OptimizerStateMoves, RoleHooks):
    """Roles sharing one device in turns.

    Args:
        device: the device the roles share (``"cuda:0"``; ``"cpu"`` runs the same code with
            synchronous copies, for tests).
        config: budget, thresholds and transfer settings.
        context: the transfer context (copy streams, host arena, claims) to use; default: the
            process's one for ``device``, shared with activation offload and CPUAdam.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        *,
        config: TimeshareConfig | None = None,
        context: TransferContext | None = None,
    ) -> None:
        self.config = config or TimeshareConfig()
        self.context = context if context is not None else TransferContext.of(device)
        want = torch.device(device)
        if want.type == "cpu":
            want = torch.device("cpu")  # "cpu:0" (accelerate's MULTI_CPU device) is the CPU
        have = self.context.ops.device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(f"the transfer context is for {have}, not for the timeshare's device {want}")
        self.ops = self.context.ops
        # Resize (the default) for every storage, address-stable for those of roles added with
        # region= (their region tags are registered with this backend).
        self._residency = RegionBackend(
            ResizeBackend(
                self.ops,
                coalesce=self.config.transfer.coalesce_allocations,
                release_to_driver=self.config.release_to_driver,
            ),
            describe=MovedOutMessages(self),  # what a moved-out tensor says when foreign code touches it
        )
        self.store = OffloadStore(
            self.ops,
            self.config.transfer,
            release_to_driver=self.config.release_to_driver,
            backend=self._residency,
            context=self.context,
            owner=self.context.label("Timeshare"),
        )
        self.store.collect_stalls = True  # read into the records' stall_seconds
        # Every verb runs under this lock (the store's: its state-dict hooks take it too); the
        # condition wakes use() calls waiting for another thread's use() blocks to end.
        self._lock = lock_of(self.store)
        self._idle = threading.Condition(self._lock)
        # thread -> (the role its use() waits to load, roles that load moves out, threads it yields to, ticket,
        # the bytes its switch keeps free)
        self._waiting: dict[int, tuple[str, set[str], dict[int, int], int, int | None]] = {}
        self._roles: dict[str, Role] = {}
        # Every transition's record, and the device timings read into them.
        self.log = TransitionLog(
            self.ops,
            self.store,
            measure_release=self.ops.is_accelerator and self.config.release_to_driver,
            release_tolerance_bytes=self.config.release_tolerance_bytes,
        )
        self._clock = 0
        self.closed = False
        # Runs, records and recovers every transition (its `interrupted` mark: set before a move
        # changes anything, cleared once the roles' flags agree with the store again).
        self.transitions = TransitionRunner(
            store=self.store,
            config=self.config,
            roles=self._roles,
            log=self.log,
            live=self._live,
            resident_keys=self.resident_keys,
            tick=self._tick,
        )
        # Which roles a transition moves out (the decision: evict.choose_evictions).
        self.evictions = EvictionChoice(
            ops=self.ops,
            store=self.store,
            config=self.config,
            roles=self._roles,
            device_entries=self._device_entries,
            check_evictable=self._check_evictable,
        )
        # Storages a lending() block has out while their role stays resident (what a read says).
        self.lent_keys: set[int] = set()

    @property
    def config(self) -> TimeshareConfig:
        """The timeshare's settings; setting them reaches its collaborators too."""
        return self._config

    @config.setter
    def config(self, config: TimeshareConfig) -> None:
        self._config = config
        for part in ("transitions", "evictions"):
            if hasattr(self, part):
                getattr(self, part).config = config

    # ---- registration ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device the roles share (``cuda:N`` with its index, or ``cpu``)."""
        return self.ops.device

    # ---- queries ----------------------------------------------------------------------------
    @property
    def roles(self) -> list[str]:
        """The registered roles' names, in the order they were added."""
        return list(self._roles)

    @property
    def resident_roles(self) -> list[str]:
        """The names of the roles whose state is on the device now."""
        return [n for n, r in self._roles.items() if r.resident]

    def role(self, name: str) -> Role:
        """The :class:`~tidal.timeshare.role.Role` registered as ``name`` (its state machine:
        residency, use, optimizer phase). Raises ``ValueError`` for an unknown name."""
        try:
            return self._roles[name]
        except KeyError:
            raise ValueError(f"unknown role {name!r}; registered roles: {sorted(self._roles)}") from None

    @serialised
    def role_bytes(self, name: str) -> int:
        """Bytes of the role's state that tidal moves, wherever each storage is now (shared
        storages included once)."""
        return sum(e.nbytes for e in self._entries(self.role(name)).values())

    @serialised
    def bytes_to_load(self, name: str) -> int:
        """Bytes that making ``name`` resident would copy in now: its device state on the host,
        less what a :meth:`prefetch` has brought in ahead (0 for a resident role). Raises
        ``ValueError`` for an unknown name."""
        role = self.role(name)
        if role.resident:
            return 0
        return self.evictions.to_load(role, self._device_entries(role), self.store.prefetched_keys())

    def is_resident(self, name: str) -> bool:
        """Whether the role ``name`` is on the device now. Raises ``ValueError`` for an
        unknown name."""
        return self.role(name).resident

    # ---- verbs ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, name: str, *, timeout: float | None = None, keep_free_bytes: int | None = None) -> Iterator[Role]:
        """Make ``name`` resident for the block (switching others out as the budget needs).
        The role cannot be offloaded while inside the block. It stays resident after the
        block until another role needs the room.

        ``keep_free_bytes``: this switch moves out only the roles it takes (least recently
        used first) to have ``name`` in and that many bytes free beside it, what the block
        will allocate (``evict="as_needed"`` for this switch, with this headroom): other
        roles stay resident where there is room, even if the config's ``evict="others"``
        would move them out. With it a frozen role brought in by :meth:`prefetch` can be used
        beside the role before it, which then needs no copy back in.

        From several threads: blocks of the same role may be open in several threads at once.
        A ``use()`` whose switch would move out a role that another thread is inside a block of
        waits until those blocks end (at most ``timeout`` seconds, then ``TimeoutError``;
        ``RuntimeError`` at once if that thread waits for this one). Within one thread, a
        ``use()`` that would move out a role this thread is using raises ``RuntimeError``.
        A negative ``keep_free_bytes`` raises ``ValueError``, one not an int ``TypeError``,
        before any work."""
        role = self.role(name)
        check_keep_free_bytes(keep_free_bytes)
        me = threading.get_ident()
        with self._lock:
            wait_for_room(self, role, me, timeout, keep_free_bytes)
            self.load(name, keep_free_bytes=keep_free_bytes)
            role.enter_use(me)
        try:
            yield role
        finally:
            with self._lock:
                try:
                    if role.leave_use(self._tick(), me) and not self.closed:
                        for opt in role.optimizers:
                            self._restore_groups(role, opt)
                        self._settle_optimizer(role)
                finally:
                    self._idle.notify_all()  # a use() in another thread may wait for this role

    @contextlib.contextmanager
    def lending(self, name: str) -> Iterator[Lending]:
        """For the block, ``name`` (resident, and in a :meth:`use` block of this thread) lends
        the device memory of parameters its own code will not read inside it:
        ``lend.out(tensors)`` moves their storages to the host, and every one comes back as the
        block ends, also when it raises. What it is for: an FSDP2 policy's shards while its full
        parameters are gathered for generation (:func:`tidal.distributed.gathered`'s
        ``on_unit``), so that the full copy needs room only for itself. Between ``out`` and
        the end the role still counts as resident: nothing else brings it in or out, and a
        lent tensor that foreign code reads raises the moved-out error.

        The parameters are taken as they are when the block begins (a module whose parameters
        are swapped inside, as FSDP2's gather does, still lends its shards). The block must
        free what it took in their place before it ends (FSDP2: reshard inside it).

        Memory cost: host memory for the lent storages (the role's own host copies, where it
        has been out before); the copies out and back are waited for (in the records, as an
        offload and a reload noted "lent").

        Raises ``ValueError`` before any work if ``name`` is not resident or not in use in
        this thread; from ``out``, ``ValueError`` for a tensor not the role's; at the end,
        what the reload raises (``InsufficientMemoryError`` where the lent bytes do not fit),
        the timeshare then marked interrupted so that its next verb settles the role."""
        self._check_open()
        role = self.role(name)
        if not role.resident or threading.get_ident() not in role.users:
            raise ValueError(
                f"lending({name!r}): the role must be resident and in use in this thread; call it inside "
                f"`with timeshare.use({name!r}):`"
            )
        with self._lock:
            params = {e.key: e for e in self._live(role, optim=False) if e.kind == "param" and e.nbytes > 0}
            held = {k: e for k, e in params.items() if not self.store.is_offloaded(k)}
            own = {local_storage_key(p) for m in role.modules for p in m.parameters()}
            own.update(local_storage_key(p) for p in role.loose_params())
        lend = Lending(self, name, held, own)
        try:
            yield lend
        finally:
            lend.back()

    @serialised
    def load(
        self, name: str, *, room_source: RoomSource | None = None, keep_free_bytes: int | None = None
    ) -> TransitionRecord | None:
        """Make ``name`` resident now; evicts the least recently used roles the budget cannot
        keep, overlapping their offload with this reload. Returns the transition, or None if
        nothing had to move.

        ``room_source``: memory another process is still handing over
        (:attr:`tidal.distributed.GPULease.room_source`); where the role does not fit in what
        the driver has free, the load waits for it instead of raising. ``keep_free_bytes``: as
        in :meth:`use`. Raises ``ValueError`` if it is negative."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("load")
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        check_keep_free_bytes(keep_free_bytes)
        evict = self.evictions.choose(role, room_source=room_source, keep_free_bytes=keep_free_bytes)
        if role.resident and not evict:
            role.touched(self._tick())
            return None
        return self.transitions.run(evict, None if role.resident else role, room_source=room_source)

    @serialised
    def offload(self, name: str) -> TransitionRecord | None:
        """Move ``name``'s state to the host and return its device memory to the driver.
        Storages shared with a resident role stay. Returns None if already offloaded."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("offload")
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        if not role.resident:
            return None
        self._check_evictable(role, reason=f"offload({name!r})")
        return self.transitions.run([role], None)

    @serialised
    def evict_others(self, name: str) -> int:
        """Leave ``name`` alone on the device: move out every other resident role that is not in
        use (frozen ones dropped without a copy where their host copies are valid), and give
        back the memory of every prefetch not yet claimed (its storages stay out, nothing lost).
        What a block that ran out of device memory beside the roles a ``keep_free_bytes`` switch
        kept (or a prefetch brought) does before it runs again. Returns the device bytes it
        freed (0: nothing was there to move). Raises ``ValueError`` if ``name`` is not
        resident."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("evict_others")
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        if not role.resident:
            raise ValueError(f"evict_others({name!r}): the role is not resident; load() or use() it first")
        prefetched = self.store.prefetched_keys()
        freed = sum(e.nbytes for e in self.store.offloaded_entries(sorted(prefetched)))
        others = [r for r in self._roles.values() if r.resident and r is not role and not r.in_use]
        if not others:
            self.transitions.cancel_prefetch(keep=set())
            return freed
        going, _ = self.transitions.outgoing(others, self.resident_keys(exclude=others))
        self.transitions.run(others, None)  # its move gives the prefetched memory back first
        return freed + sum(e.nbytes for e in going)

    @serialised
    def offload_all(self, *, on_released: ReleaseProgress | None = None) -> TransitionRecord | None:
        """Offload every resident role that is not in use.

        ``on_released(returned_bytes, total_bytes)``: hand the memory over as it comes free,
        ``config.handover_chunk_bytes`` at a time, each chunk back with the driver before it
        is reported (:meth:`tidal.distributed.GPULease.report_released` passes it to the next
        holder). Without it the memory goes back once, at the end."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("offload_all")
        self.transitions.recover_if_interrupted()
        out = [r for r in self._roles.values() if r.resident]
        for r in out:
            self._check_evictable(r, reason="offload_all()")
        if on_released is not None and not self.config.release_to_driver:
            raise ValueError(
                "offload_all(on_released=...) hands memory to another process, but this Timeshare "
                "keeps freed memory in torch's cache (TimeshareConfig(release_to_driver=False))"
            )
        return self.transitions.run(out, None, on_released=on_released) if out else None

    @serialised
    def report(self, *, detail: bool = False) -> str:
        """Roles and transitions on this device: a summary per kind of transition and roles
        (count, bytes, seconds, GB/s); ``detail=True`` lists every transition."""
        with self._lock:
            self.log.settle()  # what has run on the device is read: one measure where it can be
        rows = []
        for n, r in self._roles.items():
            total = self.role_bytes(n)
            rows.append((n, "device" if r.resident else "host", total if r.resident else 0, total))
        notes = [
            f"role {r.name!r}: optimizer state of {', '.join(r.host_optimizers())} lives on the host; "
            f"switches do not move it"
            for r in self._roles.values()
            if r.host_optimizers()
        ]
        return format_report(
            self.records,
            rows,
            self.store.host_reserved_bytes,
            self.store.offloaded_bytes,
            notes=notes,
            device=str(self.device),
            detail=detail,
        )

    @serialised
    def close(self) -> None:
        """Bring every offloaded storage back, remove tidal's hooks and free the host memory.
        Raises (and changes nothing) if they do not all fit on the device."""
        if self.closed:
            return
        if self.transitions.interrupted:
            self.store.recover()  # no roll-forward: everything comes back just below
        self.store.forget_unreferenced()
        parked = self.store.all_offloaded()
        if parked:
            self.store.reload(parked, what="close() bringing every role back")
        for r in self._roles.values():
            r.found(True)
            for h in r.hooks:
                h.remove()
            for opt in r.optimizers:
                self.context.release(opt)
        self.store.close()
        self.closed = True
        self._idle.notify_all()  # waiting use() calls find it closed

    def __enter__(self) -> "Timeshare":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Timeshare was closed; create a new one")

    def _check_not_in_backward(self, verb: str) -> None:
        if _in_backward():
            raise RuntimeError(
                f"{verb} was called while a backward pass is running; moving state now would pull "
                f"parameters or gradients from under autograd. Call it after backward() returns"
            )

    def _check_evictable(self, role: Role, *, reason: str) -> None:
        if role.in_use:
            raise RuntimeError(
                f"{reason} would move role {role.name!r} out while it is in use (inside its "
                f"`with ts.use({role.name!r})` block); exit that block first, or raise "
                f"TimeshareConfig.budget_bytes so both roles can stay resident"
            )

    @property
    def records(self) -> list[TransitionRecord]:
        """Every transition so far, in order (:class:`~tidal.timeshare.telemetry.TransitionRecord`)."""
        return self.log.records

    def _start_clock(self) -> None:
        """A verb starts: its records' host time (and device gap) count from here."""
        self.log.start_clock()

    def settle_stalls(self, *, wait: bool = False) -> None:
        """Fill in the records' ``stall_seconds`` (how long the compute stream waited for
        their copies) and ``gap_seconds`` for the waits and windows that have run on the
        device; ``wait``: block the host until all of them have (call it after synchronising,
        or before reading the figures). Cheap: a query of one event per record not yet read,
        and of two per wait."""
        if wait:
            with self._lock:
                ends = self.log.pending_ends()
            for end in ends:  # outside the lock: another thread's verbs need not wait for this
                end.synchronize()  # the figures are read now: the waits and windows must have run
        with self._lock:
            self.log.settle()

    def record_move(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord:
        """Add a store move to the timeshare's records (:class:`~tidal.timeshare.telemetry.TransitionLog`;
        it warns if the driver did not get the freed memory back). For optimizer residency
        strategies, which move state themselves. The record's host time runs from the verb's
        start, or the previous record of the same verb, to now."""
        return self.transitions.record(kind, roles_out, role_in, move, note)

    def _tick(self) -> int:
        """The next value of the clock that orders eviction (least recently used first)."""
        self._clock += 1
        return self._clock

    def _live(self, role: Role, *, optim: bool = True) -> list[StateEntry]:
        """The role's storages now, from its live tensors, as the store sees them (offloaded
        ones with their real size)."""
        min_b = self.config.min_offload_bytes
        live = role.model_entries(self.device, min_b)
        if optim:
            live += role.optim_entries(self.device, min_b)
        return self.store.resolve(live)

    def _entries(self, role: Role) -> dict[int, StateEntry]:
        return {e.key: e for e in self._live(role)}

    def _device_entries(self, role: Role) -> dict[int, StateEntry]:
        """What ``role`` holds on the device while resident: its module state, and its
        optimizer state where the residency keeps it with the role (or a step left it there).
        Optimizer state kept on the host between steps ("step", "stream") does not count
        against the budget."""
        optim = policy_for(role.optimizer_residency).moves_with_role or role.optim_unsettled
        return {e.key: e for e in self._live(role, optim=optim)}

    @serialised
    def resident_keys(self, *, exclude: Sequence[Role] = ()) -> set[int]:
        """Keys of the storages resident roles (but those in ``exclude``) hold on the device:
        what a move must not take out. For optimizer residency strategies."""
        keys: set[int] = set()
        for r in self._roles.values():
            if r.resident and r not in exclude:
                keys.update(e.key for e in self._live(r) if not self.store.is_offloaded(e.key))
        return keys
