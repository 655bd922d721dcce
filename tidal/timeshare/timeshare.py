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
import dataclasses
import itertools
import threading
import time
import warnings
import weakref
from typing import Iterator, Sequence

import torch

from tidal.units import format_bytes
from tidal.state.backends import RegionBackend, ResizeBackend
from tidal.state.collect import GradPolicy, StateEntry, storage_key
from tidal.state.foreign import MovedOutMessages, install_optimizer_hooks, lock_of, moved_out
from tidal.guard import address
from tidal.state.handover import ReleaseProgress, RoomSource
from tidal.state.sources import ModuleSource, StateSource
from tidal.state.store import MoveResult, OffloadStore
from tidal.timeshare.config import TimeshareConfig
from tidal.timeshare.role import OptimizerResidency, Role
from tidal.timeshare.residency import policy_for
from tidal.timeshare.stream import restore_groups
from tidal.timeshare.threads import serialised, wait_for_room
from tidal.timeshare.telemetry import TransitionRecord, format_report
from tidal.transfer.context import TransferContext
from tidal.vmm import RegionTag

__all__ = ["Timeshare", "TimeshareConfig", "timeshare_of"]


@dataclasses.dataclass(frozen=True, eq=False)
class RoleClaim:
    """The claim a timeshare role holds on an optimizer in its transfer context, so
    ``offload_optimizer()`` defers to the role instead of keeping a second record."""

    timeshare: "weakref.ref[Timeshare]"
    role: str

    def __repr__(self) -> str:
        return f"role {self.role!r} of a Timeshare"


def timeshare_of(
    optimizer: torch.optim.Optimizer, context: TransferContext | None = None
) -> tuple["Timeshare", str] | None:
    """The open timeshare and role an optimizer was registered with, if any, found in
    ``context`` (default: the process's context for the optimizer's device)."""
    if context is None:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if device is None:
            return None
        context = TransferContext.of(device)
    claim = context.owner_of(optimizer)
    if not isinstance(claim, RoleClaim):
        return None
    ts = claim.timeshare()
    return (ts, claim.role) if ts is not None and not ts.closed else None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _as_list(obj, cls, what: str) -> list:
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for x in items:
        if not isinstance(x, cls):
            raise TypeError(
                f"{what} must be a {cls.__module__}.{cls.__qualname__} (or a list of them), got {type(x).__name__}"
            )
    return items


class Timeshare:
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
        # thread -> (the role its use() waits to load, roles that load moves out, threads it yields to, ticket)
        self._waiting: dict[int, tuple[str, set[str], set[int], int]] = {}
        self._roles: dict[str, Role] = {}
        self.records: list[TransitionRecord] = []
        self._warned_unreleased: set[str] = set()  # transition kinds warned about unreleased memory
        self._clock = 0
        self._verb_t0 = time.perf_counter()  # see _start_clock
        # (record index, compute-stream wait event pairs) not yet read (see settle_stalls)
        self._stalls: list[tuple[int, list]] = []
        self.closed = False
        # Set before a transition changes anything and cleared once the roles' flags agree with
        # the store again: if it is still set, an exception interrupted one (see _recover).
        self._interrupted = False

    # ---- registration ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.ops.device

    @serialised
    def add_role(
        self,
        name: str,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        source: StateSource | Sequence[StateSource] | None = None,
        grads: GradPolicy = "offload",
        optimizer_residency: OptimizerResidency = "step",
        frozen: bool = False,
        skip_unchanged: bool = False,
        region: RegionTag | None = None,
    ) -> Role:
        """Register a role. Nothing moves; host memory for the role's current state is reserved
        and pinned here (once), so the first transition runs at line rate. Roles may share
        modules: a shared storage is counted once and stays resident while any role holding
        it is resident. A role whose state is partly offloaded already (it shares a module with
        an offloaded role) starts as not resident; ``use()`` brings it in.

        ``model`` (modules) and ``source`` (anything implementing
        :class:`~tidal.state.sources.StateSource`, e.g. a DeepSpeed engine's) say what the role
        holds besides its optimizers' state. Raises ``ValueError``/``TypeError`` for a role
        with nothing to move or state tidal cannot move, before anything is registered.

        ``frozen=True`` declares that nothing writes the role's parameters and buffers (a
        reference or reward model): once they have gone out, their host copy stays valid, so
        every later offload of the role releases its device memory without copying (only the
        reload moves bytes). With ``TransferConfig(verify=...)`` on, each such offload first
        checks the bytes and refuses (``ValueError``, nothing moved) if they changed. A
        ``load_state_dict`` into the role's modules is seen and handled. A frozen role has no
        optimizer (``ValueError``).

        ``skip_unchanged=True`` is the check without the promise: every offload of the role
        digests its parameters and buffers on the device (one read of their bytes, at HBM
        bandwidth, and one host synchronisation) and copies only those whose bytes differ from
        their host copy; the others are released without a copy (``bytes_skipped`` in the
        records). For a role that is often not written between its turns (a reference or reward
        model updated now and then, a rollout copy of the policy while the policy trains
        elsewhere); a role written every turn pays the digest for nothing.

        ``region`` (a :class:`~tidal.vmm.RegionTag` with policy ``"discard"``) makes the role's
        storages that were allocated in that tag address-stable: an offload copies them out as
        usual, then unmaps the tag's memory in place; a reload maps it again at the same
        addresses before copying the bytes back, so CUDA graphs and raw pointers into the role
        stay valid. Its other storages (gradients, optimizer state made outside the tag) move by
        resizing. Raises ``ValueError`` if none of the role's storages lies in the tag (build
        the model inside ``with region.allocate(tag):``) or the tag's policy is ``"backup"``.
        """
        self._check_open()
        self._recover_if_interrupted()
        if not isinstance(name, str) or not name:
            raise ValueError(f"role name must be a non-empty string, got {name!r}")
        if name in self._roles:
            raise ValueError(
                f"a role named {name!r} already exists; role names must be unique (registered: {sorted(self._roles)})"
            )
        modules = _as_list(model, torch.nn.Module, "model")
        optimizers = _as_list(optimizer, torch.optim.Optimizer, "optimizer")
        sources = list(source) if isinstance(source, (list, tuple)) else ([source] if source is not None else [])
        for s in sources:
            if not all(callable(getattr(s, m, None)) for m in ("tensors", "install", "before_copy")):
                raise TypeError(
                    f"source must implement tidal.state.sources.StateSource (tensors, install, before_copy), "
                    f"got {type(s).__name__}"
                )
        if modules:
            sources.insert(0, ModuleSource(modules, verify=self.config.verify_storage_sets))
        if not sources and not optimizers:
            raise ValueError(f"role {name!r} needs a model, a source or an optimizer")
        if frozen and optimizers:
            raise ValueError(
                f"role {name!r}: frozen=True declares its state is never written, but it has an optimizer "
                f"that updates it; drop frozen=True for a trained role"
            )
        for opt in optimizers:
            owner = timeshare_of(opt, self.context)
            if owner is not None:
                raise ValueError(
                    f"this optimizer already belongs to role {owner[1]!r}; an optimizer "
                    f"can belong to one role only (its step hooks move its state)"
                )
            held = self.context.owner_of(opt)
            if isinstance(held, OffloadStore) and held.offloaded_bytes:
                raise ValueError(
                    f"role {name!r}: this optimizer's state is still on the host from an "
                    f"offload_optimizer() block that could not bring it back; run its step() (which "
                    f"reloads it) before adding it to a role"
                )
        role = Role(
            name,
            sources,
            optimizers,
            grads=grads,
            optimizer_residency=optimizer_residency,
            frozen=frozen,
            skip_unchanged=skip_unchanged,
        )
        # A region tag is served from here on (its storages may be non-resizable), and no
        # longer if the role is refused below.
        added = self._residency.add(region) if region is not None else False
        try:
            # Collect now: validates the state (raises TypeError for unsupported tensors) before
            # anything else is registered, and sizes the host slots.
            model_live = role.model_entries(self.device, self.config.min_offload_bytes)
            entries = self.store.resolve(model_live) + self.store.resolve(
                role.optim_entries(self.device, self.config.min_offload_bytes)
            )
            if not entries:
                raise ValueError(f"role {name!r} has {self._why_no_state(role)}")
            if region is not None and not any(region.find(address(e.storage)) is not None for e in entries):
                raise ValueError(
                    f"role {name!r}: none of its storages lies in region {region.region.name!r}, tag {region.name!r}; "
                    f"build the model inside `with region.allocate({region.name!r}, policy='discard'):`"
                )
        except BaseException:
            if added:
                self._residency.remove(region)
            raise
        role.found(not any(self.store.is_offloaded(e.key) for e in entries))
        self.store.prepare([e for e in entries if not self.store.is_offloaded(e.key)])
        guard = self._make_guard(role)
        for s in sources:
            role.hooks += s.install(self.store, guard)
        for opt in optimizers:
            role.hooks.append(opt.register_step_pre_hook(self._make_step_pre_hook(role)))
            role.hooks.append(opt.register_step_post_hook(self._make_step_post_hook(role)))
            role.hooks += install_optimizer_hooks(self.store, opt, after_load=self._make_after_load(role))
            # The role takes the claim over from offload_optimizer()'s own store (idle, checked above).
            if isinstance(self.context.owner_of(opt), OffloadStore):
                self.context.release(opt)
            self.context.claim(opt, RoleClaim(weakref.ref(self), name), what="optimizer")
        self._roles[name] = role
        role.touched(self._tick())
        if optimizer_residency != "step" and optimizers and not role.device_optimizers():
            warnings.warn(
                f"role {name!r}: optimizer_residency={optimizer_residency!r} ignored: "
                f"{', '.join(role.host_optimizers())} keeps its state on the host already, so "
                f"there is no device state to place",
                stacklevel=2,
            )
        return role

    def _why_no_state(self, role: Role) -> str:
        tensors = [t for m in role.modules for t in itertools.chain(m.parameters(), m.buffers())]
        tensors += [p for o in role.optimizers for g in o.param_groups for p in g["params"]]
        elsewhere = sorted({str(t.device) for t in tensors if t.device != self.device})
        if elsewhere:
            return (
                f"no state on {self.device}: its tensors are on {', '.join(elsewhere)}. Move the model "
                f"to {self.device} before adding the role"
            )
        if not tensors:
            return "no tensors at all (no parameters, buffers or optimizer parameters)"
        return (
            f"no state to move: its {len(tensors)} tensors are empty or smaller than "
            f"min_offload_bytes={self.config.min_offload_bytes}, so they stay where they are"
        )

    # ---- queries ----------------------------------------------------------------------------
    @property
    def roles(self) -> list[str]:
        return list(self._roles)

    @property
    def resident_roles(self) -> list[str]:
        return [n for n, r in self._roles.items() if r.resident]

    def role(self, name: str) -> Role:
        try:
            return self._roles[name]
        except KeyError:
            raise ValueError(f"unknown role {name!r}; registered roles: {sorted(self._roles)}") from None

    @serialised
    def role_bytes(self, name: str) -> int:
        """Bytes of the role's state that tidal moves, wherever each storage is now (shared
        storages included once)."""
        return sum(e.nbytes for e in self._entries(self.role(name)).values())

    def is_resident(self, name: str) -> bool:
        return self.role(name).resident

    # ---- verbs ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, name: str, *, timeout: float | None = None) -> Iterator[Role]:
        """Make ``name`` resident for the block (switching others out as the budget needs).
        The role cannot be offloaded while inside the block. It stays resident after the
        block until another role needs the room.

        From several threads: blocks of the same role may be open in several threads at once.
        A ``use()`` whose switch would move out a role that another thread is inside a block of
        waits until those blocks end (at most ``timeout`` seconds, then ``TimeoutError``;
        ``RuntimeError`` at once if that thread waits for this one). Within one thread, a
        ``use()`` that would move out a role this thread is using raises ``RuntimeError``."""
        role = self.role(name)
        me = threading.get_ident()
        with self._lock:
            wait_for_room(self, role, me, timeout)
            self.load(name)
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

    @serialised
    def load(self, name: str, *, room_source: RoomSource | None = None) -> TransitionRecord | None:
        """Make ``name`` resident now; evicts the least recently used roles the budget cannot
        keep, overlapping their offload with this reload. Returns the transition, or None if
        nothing had to move.

        ``room_source``: memory another process is still handing over
        (:attr:`tidal.distributed.GPULease.room_source`); where the role does not fit in what
        the driver has free, the load waits for it instead of raising."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("load")
        self._recover_if_interrupted()
        role = self.role(name)
        evict = self._choose_evictions(role, room_source=room_source)
        if role.resident and not evict:
            role.touched(self._tick())
            return None
        return self._transition(evict, None if role.resident else role, room_source=room_source)

    @serialised
    def prefetch(
        self,
        name: str,
        *,
        leave_free_bytes: int | None = None,
        limit_bytes: int | None = None,
        write_back: bool = True,
    ) -> TransitionRecord | None:
        """Start making ``name`` resident behind the work queued now, so that the ``use(name)``
        (or ``load(name)``) that follows finds its state arrived and its switch costs next to
        nothing. Returns without waiting for any copy; call it at the start of the phase before
        (its compute hides the copies).

        Both halves are queued behind the current stream, one per copy engine:

        * in: the role's offloaded storages, in the order its modules list them (the order a
          forward uses them), as many as fit in free device memory less ``leave_free_bytes``
          (default ``TimeshareConfig.headroom_bytes``: leave what the phase running now still
          needs), within ``budget_bytes`` next to the resident roles if a budget is set, and at
          most ``limit_bytes``. The role stays out meanwhile: its forwards are refused and
          ``state_dict()`` reads its host copies. ``use``/``load`` then makes the current stream
          wait for those copies (no host wait) and moves whatever did not fit as usual.
        * out (``write_back``): the storages of the roles that ``load(name)`` would move out
          (without a budget every other resident role; with one, the least recently used ones
          it cannot keep) are copied to their host slots now, nothing released, so that switch
          releases those not written in between without a copy (one digest of their bytes on
          the device decides, see :meth:`OffloadStore.write_back`). With ``evict="as_needed"``
          they are those the free memory now cannot keep beside it. A role in use (the phase
          running now) is written back too: what it writes after this call is caught by the
          digest and copied by the switch.

        A prefetch lasts until the next transition: ``use``/``load`` of ``name`` claims it, any
        other transition first gives its memory back (nothing lost).

        Memory cost: the device memory of the storages brought in, from this call on (the
        overlap the budget, ``leave_free_bytes`` and ``limit_bytes`` bound); no host memory
        beyond the roles' slots.

        Raises ``ValueError`` for an unknown role or a negative byte count, ``RuntimeError``
        inside a backward pass or after :meth:`close`. Returns the record (kind
        ``"prefetch"``: ``bytes_in`` queued, ``bytes_out`` written back, ``seconds`` the host
        time spent queueing), or None when nothing was queued (the role is resident, or
        nothing fits).
        """
        role, leave = self._begin_prefetch("prefetch", name, leave_free_bytes, limit_bytes)
        if role.resident:
            return None
        evict = self._choose_evictions(role, ignore_use=True)
        budget = self.config.budget_bytes
        if budget is not None:
            # Nothing goes out before use(): what comes in shares the budget with every resident role.
            resident = {e.key: e.nbytes for r in self._roles.values() if r.resident for e in self._live(r)}
            room = max(0, budget - sum(n for k, n in resident.items() if not self.store.is_offloaded(k)))
            limit_bytes = room if limit_bytes is None else min(limit_bytes, room)
        in_entries, inc = self._incoming(role)
        self._cancel_prefetch(keep={e.key for e in in_entries})
        t0 = time.perf_counter()
        inn = self.store.prefetch(in_entries, leave_free_bytes=leave, limit_bytes=limit_bytes)
        out = None
        if write_back:
            for r in evict:
                r.before_copy()  # the write-back waits for the current stream: it waits for the sources' own work
            out_entries = self._outgoing(evict, self.resident_keys(exclude=evict) | {e.key for e in inc})[0]
            out = self.store.write_back(out_entries) if out_entries else None
        if not (inn.bytes_in or (out is not None and out.bytes_out)):
            return None
        move = dataclasses.replace(
            inn,
            bytes_out=out.bytes_out if out is not None else 0,
            seconds=time.perf_counter() - t0,
            segments=inn.segments + (out.segments if out is not None else 0),
        )
        return self.record_move("prefetch", tuple(r.name for r in evict) if out else (), name, move)

    @serialised
    def prefetch_optimizer(
        self, name: str, *, leave_free_bytes: int | None = None, limit_bytes: int | None = None
    ) -> TransitionRecord | None:
        """Start bringing the optimizer state of ``name`` in ahead of its ``step()``, behind the
        work queued now, and return without waiting: call it before the backward whose
        gradients the step consumes, so the copies run while the backward computes.

        For a role whose optimizer state lives on the host between steps (``"step"`` or
        ``"stream"`` residency). The state comes in the order ``step()`` uses it (a streamed
        step's first chunks first), as much as fits in the device's free memory less
        ``leave_free_bytes`` (default ``TimeshareConfig.headroom_bytes``: what the backward
        still needs, its gradients included) and at most ``limit_bytes``. ``step()`` then
        finds it arrived (the compute stream waits for the copies; nothing is copied again)
        and brings the rest in as usual. Like :meth:`prefetch`, it lasts until claimed; any
        transition before the step gives its memory back first (nothing lost).

        Memory cost: the device memory of the state brought in, from this call to the step.
        Returns the record (kind ``"optim-prefetch"``), or None when nothing was queued (no
        state on the host, the residency keeps it with the role, or nothing fits). Raises
        ``ValueError`` for an unknown role or a negative byte count, ``RuntimeError`` inside
        a backward pass or after :meth:`close`."""
        role, leave = self._begin_prefetch("prefetch_optimizer", name, leave_free_bytes, limit_bytes)
        if policy_for(role.optimizer_residency).moves_with_role or not role.resident:
            return None
        live = role.optim_entries(self.device, self.config.min_offload_bytes)
        entries = [e for e in self.store.resolve(live) if self.store.is_offloaded(e.key)]
        if not entries:
            return None
        move = self._guarded(
            lambda: self.store.prefetch(entries, leave_free_bytes=leave, limit_bytes=limit_bytes), touches_model=False
        )
        if not move.bytes_in:
            return None
        return self.record_move("optim-prefetch", (), name, move, note="optimizer state, ahead of step()")

    def _begin_prefetch(
        self, verb: str, name: str, leave_free_bytes: int | None, limit_bytes: int | None
    ) -> tuple[Role, int]:
        """The checks both prefetches make before any work; returns the role and the bytes to
        leave free."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward(verb)
        self._recover_if_interrupted()
        role = self.role(name)
        leave = self.config.headroom_bytes if leave_free_bytes is None else leave_free_bytes
        for what, v in (("leave_free_bytes", leave), ("limit_bytes", limit_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{what} must be >= 0, got {v}")
        return role, leave

    @serialised
    def offload(self, name: str) -> TransitionRecord | None:
        """Move ``name``'s state to the host and return its device memory to the driver.
        Storages shared with a resident role stay. Returns None if already offloaded."""
        self._check_open()
        self._start_clock()
        self._check_not_in_backward("offload")
        self._recover_if_interrupted()
        role = self.role(name)
        if not role.resident:
            return None
        self._check_evictable(role, reason=f"offload({name!r})")
        return self._transition([role], None)

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
        self._recover_if_interrupted()
        out = [r for r in self._roles.values() if r.resident]
        for r in out:
            self._check_evictable(r, reason="offload_all()")
        if on_released is not None and not self.config.release_to_driver:
            raise ValueError(
                "offload_all(on_released=...) hands memory to another process, but this Timeshare "
                "keeps freed memory in torch's cache (TimeshareConfig(release_to_driver=False))"
            )
        return self._transition(out, None, on_released=on_released) if out else None

    @serialised
    def report(self, *, detail: bool = False) -> str:
        """Roles and transitions on this device: a summary per kind of transition and roles
        (count, bytes, seconds, GB/s); ``detail=True`` lists every transition."""
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
        if self._interrupted:
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

    # ---- optimizer state (used by the step hooks and offload_optimizer) ---------------------
    @serialised
    def offload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-out"
    ) -> TransitionRecord | None:
        """Move the role's optimizer state (and its params' grads if ``grads``) to the host;
        its params stay. Storages another resident role holds stay too."""
        self._start_clock()
        self._recover_if_interrupted()
        role = self.role(name)
        if grads:
            role.before_copy()  # grads come from the sources, which may still write them
        live = self._optimizer_live(role, grads)
        others = self.resident_keys(exclude=(role,))
        entries = [e for e in live if e.nbytes > 0 and e.key not in others]
        if not entries:
            return None
        wait = self.config.wait_for_copies
        move = self._guarded(lambda: self.store.offload(entries, wait=wait), touches_model=grads)
        return self.record_move(kind, (name,), None, move, note="optimizer state" + (" + grads" if grads else ""))

    @serialised
    def reload_optimizer_state(
        self, name: str, *, grads: bool = False, kind: str = "optim-in"
    ) -> TransitionRecord | None:
        """Bring the role's offloaded optimizer state (and grads if ``grads``) back."""
        self._start_clock()
        self._recover_if_interrupted()
        role = self.role(name)
        role.optimizer_touched()
        live = self._optimizer_live(role, grads)
        entries = [e for e in self.store.resolve(live) if self.store.is_offloaded(e.key)]
        if not entries:
            return None
        move = self._guarded(
            lambda: self.store.reload(
                entries, what=f"reloading the optimizer state of role {name!r}", wait=self.config.wait_for_copies
            ),
            touches_model=grads,
        )
        return self.record_move(kind, (), name, move, note="optimizer state" + (" + grads" if grads else ""))

    def _optimizer_live(self, role: Role, grads: bool) -> list[StateEntry]:
        """The role's optimizer state tensors (and its params' grads if ``grads``), live."""
        min_b = self.config.min_offload_bytes
        live = role.optim_entries(self.device, min_b)
        if grads:
            live = [e for e in role.model_entries(self.device, min_b, grads=True) if e.kind == "grad"] + live
        return live

    def _settle_optimizer(self, role: Role) -> None:
        # With step residency the state belongs on the host outside step(); a step that
        # raised skipped the post-hook and left it on the device. A role that is out keeps
        # none of it on the device (a load_state_dict may have created it there).
        # Walking the optimizer state costs milliseconds for a large model: only after something
        # may have put state on the device (a step, a load, a reload) since it last settled.
        off_device = not role.resident or not policy_for(role.optimizer_residency).moves_with_role
        if off_device and role.optim_unsettled:
            if any(e.nbytes > 0 for e in role.optim_entries(self.device, self.config.min_offload_bytes)):
                self.offload_optimizer_state(role.name)
            role.optimizer_settled()

    def _restore_groups(self, role: Role, opt: torch.optim.Optimizer) -> None:
        # A streamed step empties the param groups for the outer step(); its post-hook puts
        # them back. Should that step have raised after the streamed update (another hook),
        # the next step or the end of the use() block puts them back instead.
        groups = role.take_hidden(opt)
        if groups is not None:
            restore_groups(opt, groups)

    def _make_after_load(self, role: Role):
        def after_load(opt):
            # torch's load_state_dict replaced the state tensors it could not load in place
            # with new ones on the device: the old ones' host copies are dead, the new ones
            # go where this role keeps its optimizer state now.
            with self._lock:
                self.store.forget_unreferenced()
                role.optimizer_touched()
                if role.in_use == 0 or policy_for(role.optimizer_residency).moves_with_role:
                    self._settle_optimizer(role)

        return after_load

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

    def _start_clock(self) -> None:
        """A verb starts: the host time of the records it makes counts from here."""
        self._verb_t0 = time.perf_counter()

    def settle_stalls(self, *, wait: bool = False) -> None:
        """Fill in the records' ``stall_seconds`` (how long the compute stream waited for
        their copies) for the waits that have run on the device; ``wait``: block the host
        until all of them have (call it after synchronising, or before reading the figures).
        Cheap: a query of two events per transition that made the compute stream wait."""
        if wait:
            for _, pairs in self._stalls:
                for _, after in pairs:
                    after.synchronize()  # the figures are read now: the waits must have run
        self._settle_stalls()

    def _settle_stalls(self) -> None:
        pending = []
        for index, pairs in self._stalls:
            if not all(after.query() for _, after in pairs):
                pending.append((index, pairs))
                continue
            stall = sum(before.elapsed_time(after) for before, after in pairs) / 1e3
            self.records[index] = dataclasses.replace(self.records[index], stall_seconds=stall)
        self._stalls = pending

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

    def _choose_evictions(
        self, role: Role, *, ignore_use: bool = False, room_source: RoomSource | None = None
    ) -> list[Role]:
        """The resident roles that bringing ``role`` in moves out. ``ignore_use``: as if no
        role were in use (what ``prefetch`` writes back ahead of the switch); no error then.
        ``room_source``: memory another process is still handing over counts as free."""
        others = [r for r in self._roles.values() if r.resident and r is not role]
        budget = self.config.budget_bytes
        as_needed = self.config.evict == "as_needed"
        if budget is None and not as_needed:
            for r in others:
                if not ignore_use:
                    self._check_evictable(r, reason=f"use({role.name!r})")
            return others
        incoming = self._device_entries(role)
        incoming_bytes = sum(e.nbytes for e in incoming.values())
        if budget is not None and incoming_bytes > budget:
            raise ValueError(
                f"role {role.name!r} holds {format_bytes(incoming_bytes)} of state, more than "
                f"budget_bytes={budget} ({format_bytes(budget)}); raise the budget or shrink the role"
            )
        entries = {r.name: self._device_entries(r) for r in others}
        staying = sorted(others, key=lambda r: r.last_used)

        def resident_bytes(roles: list[Role]) -> int:
            keys = {k: e.nbytes for k, e in incoming.items()}
            for r in roles:
                keys.update((k, e.nbytes) for k, e in entries[r.name].items())
            return sum(keys.values())

        # What must still come in: the incoming role's storages that are out, but those a
        # prefetch has allocated already (the driver's reading counts them as used). A resident
        # role brings nothing in (load() only makes room next to it).
        prefetched = self.store.prefetched_keys()
        coming = 0
        if not role.resident:
            coming = sum(e.nbytes for k, e in incoming.items() if self.store.is_offloaded(k) and k not in prefetched)
        free = 0
        if as_needed and coming:
            free = self.ops.driver_free_bytes()[0] + self.ops.cached_free_bytes() - self.config.headroom_bytes
            # Another role's prefetch is cancelled before the move: its memory counts as free.
            free += sum(e.nbytes for e in self.store.offloaded_entries(sorted(prefetched - set(incoming))))
            if room_source is not None:
                free += room_source.pending_bytes()  # the load waits for it

        def freed_by_evicting(roles: list[Role]) -> int:
            """Device bytes moving out with everything resident but ``roles`` and ``role``."""
            keep = set(incoming).union(*(entries[r.name] for r in roles))
            gone = {
                k: e.nbytes
                for r in others
                if r not in roles
                for k, e in entries[r.name].items()
                if k not in keep and not self.store.is_offloaded(k)
            }
            return sum(gone.values())

        def short(roles: list[Role]) -> bool:
            over_budget = budget is not None and resident_bytes(roles) > budget
            if over_budget or not as_needed or not coming:
                return over_budget
            # A staging bucket for the copies in, and one for those out if anything goes out.
            staging = self.store.staging_bytes(1 + int(len(roles) < len(others)))
            return coming > free - staging + freed_by_evicting(roles)

        def gains(rest: list[Role]) -> bool:
            return resident_bytes(rest) < resident_bytes(staying) or freed_by_evicting(rest) > freed_by_evicting(
                staying
            )

        evictable = lambda r: not r.in_use or ignore_use  # noqa: E731
        evict: list[Role] = []
        changed = True
        while changed and short(staying):
            changed = False
            for r in [x for x in staying if evictable(x)]:  # least recently used first
                if not short(staying):
                    break
                rest = [x for x in staying if x is not r]
                if not gains(rest):
                    # It frees nothing alone (its storages are shared): with the evictable roles
                    # sharing them, it may (a policy's rollout and training roles).
                    group = {r.name} | {
                        x.name for x in staying if evictable(x) and set(entries[x.name]) & set(entries[r.name])
                    }
                    rest = [x for x in staying if x.name not in group]
                    if not gains(rest):
                        continue  # evicting it frees nothing
                evict += [x for x in staying if x not in rest]
                staying, changed = rest, True
        busy = [r.name for r in staying if r.in_use]
        if budget is not None and resident_bytes(staying) > budget and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} does not fit in budget_bytes={budget} next to the roles in "
                f"use {busy}; exit their use() blocks first or raise the budget"
            )
        if as_needed and busy and short(staying) and not ignore_use:
            raise RuntimeError(
                f"role {role.name!r} ({format_bytes(coming)} to load) does not fit in the device's free memory "
                f"({format_bytes(max(0, free))} less headroom_bytes={self.config.headroom_bytes}) next to the "
                f"roles in use {busy}; exit their use() blocks first or lower headroom_bytes"
            )
        # Short with every evictable role out: the move itself raises, naming the bytes.
        return evict

    def _transition(
        self,
        evict: list[Role],
        incoming: Role | None,
        *,
        recovering: bool = False,
        on_released: ReleaseProgress | None = None,
        room_source: RoomSource | None = None,
    ) -> TransitionRecord | None:
        for r in [*evict, *([incoming] if incoming is not None else [])]:
            r.before_copy()  # the copies wait for the current stream: it waits for the sources' own work
        keep = self.resident_keys(exclude=evict)
        in_entries: list[StateEntry] = []
        if incoming is not None:
            in_entries, inc = self._incoming(incoming)
            keep.update(e.key for e in inc)
        out_entries, check = self._outgoing(evict, keep)
        what = f"loading role {incoming.name!r}" if incoming else "offload"
        frozen: set[int] = set()
        if incoming is not None and incoming.frozen:
            # Its parameters and buffers, but none a trained role also holds (a shared module).
            trained = {e.key for r in self._roles.values() if not r.frozen for e in self._live(r, optim=False)}
            frozen = {e.key for e in in_entries if e.kind != "grad" and e.key not in trained}

        def move_state() -> MoveResult:
            # A prefetch of another role gives its memory back first (its storages stay out).
            self._cancel_prefetch(keep={e.key for e in in_entries}, guarded=False)
            return self.store.switch(
                out_entries,
                in_entries,
                what=what,
                headroom_bytes=self.config.headroom_bytes,
                extra_bytes=self.config.switch_extra_bytes,
                frozen=frozen,
                check_unchanged=check,
                on_released=on_released,
                release_chunk_bytes=self.config.handover_chunk_bytes,
                room_source=room_source,
                wait=self.config.wait_for_copies,
                # Runs no larger than a hand-over chunk: the next chunked offload returns them one by one.
                reserve_max_bytes=self.config.handover_chunk_bytes if room_source is not None else None,
            )

        move = self._guarded(
            move_state,
            touches_model=True,
            recovering=recovering,
            settled_by_caller=True,
        )
        # Still marked interrupted (write-ahead) until the flags below are all set.
        for r in evict:
            r.went_out()
            self._drop_grads(r, keep)
        if incoming is not None:
            incoming.came_in(self._tick())
        if not recovering:  # a recovery clears the mark once all of it is done
            self._interrupted = False
        kind = "switch" if evict and incoming else ("reload" if incoming else "offload")
        return self.record_move(kind, tuple(r.name for r in evict), incoming.name if incoming else None, move)

    def _incoming(self, role: Role) -> tuple[list[StateEntry], list[StateEntry]]:
        """(the role's storages that are out, all it brings in) for a transition loading it.
        Optimizer state comes in with the role only under "role" residency; otherwise it stays
        where it is (the step hooks move it), so it need not be looked at."""
        inc = self._live(role, optim=policy_for(role.optimizer_residency).moves_with_role)
        return [e for e in inc if self.store.is_offloaded(e.key)], inc

    def _outgoing(self, evict: Sequence[Role], keep: set[int]) -> tuple[list[StateEntry], set[int]]:
        """(the storages moving out with ``evict`` but those in ``keep``, the keys among them
        to copy only if changed: the parameters and buffers of skip_unchanged roles)."""
        out_entries: list[StateEntry] = []
        check: set[int] = set()
        for r in evict:
            # A role's optimizer state under step residency is on the host unless something
            # put it on the device since it last settled; then it goes out with the role.
            live = self._live(r, optim=policy_for(r.optimizer_residency).moves_with_role or r.optim_unsettled)
            going = [e for e in live if e.key not in keep and not self.store.is_offloaded(e.key)]
            out_entries += going
            if r.skip_unchanged:
                check.update(e.key for e in going if e.kind in ("param", "buffer"))
        return out_entries, check

    def _cancel_prefetch(self, *, keep: set[int], guarded: bool = True) -> None:
        """Give back the memory of prefetched storages but those in ``keep``."""
        gone = self.store.prefetched_keys() - keep
        if gone:
            cancel = lambda: self.store.cancel_prefetch(only=gone)  # noqa: E731
            self._guarded(cancel, touches_model=True) if guarded else cancel()

    # ---- recovery from an interrupted transition ------------------------------------------
    def _guarded(self, move, *, touches_model: bool, recovering: bool = False, settled_by_caller: bool = False):
        """Run a store move. If it raises (anything, ``KeyboardInterrupt`` included), the store
        has already made every storage resident or tracked; when the move touched model state
        (params, buffers, grads) the roles' flags are then brought in line with the store
        (:meth:`_recover`) before the exception goes on. ``settled_by_caller``: the caller
        still has flags to set after the move and clears the interrupted mark itself."""
        if touches_model:
            self._interrupted = True  # write-ahead: cleared only when the flags are right again
        try:
            result = move()
        except BaseException:
            if touches_model and not recovering:
                self._recover()
            raise
        if touches_model and not recovering and not settled_by_caller:
            self._interrupted = False
        return result

    def _recover_if_interrupted(self) -> None:
        if self._interrupted or self.store.interrupted:
            self._recover()

    def _recover(self) -> None:
        """Bring every role to a state its flag describes after an interrupted transition.

        The store first frees whatever it tracked but had not freed (its host copies are the
        truth). Then per role, from where its parameters and buffers actually are: all on the
        device -> resident; all on the host -> not resident (what it still holds on the device,
        its grads or optimizer state, goes out too); part-way -> finished the way that needs
        no new device memory (out), unless the role is in use (then brought back in). A
        resident role whose grads are out (outside ``offload_optimizer(grads=True)``) gets
        them back, since a backward would accumulate into them. If that work raises too, the
        timeshare stays marked interrupted and the next verb tries again; the flags are
        already safe (a role counts as resident only when all of it is).
        """
        self._interrupted = True
        self.store.recover()
        out, back = [], []
        for r in self._roles.values():
            model = self._live(r, optim=False)
            held = [e for e in model if e.kind != "grad"]
            n_out = sum(self.store.is_offloaded(e.key) for e in held)
            grads_out = any(self.store.is_offloaded(e.key) for e in model if e.kind == "grad")
            r.found(n_out == 0 and (not grads_out or r.optimizer_locked))
            if r.resident:
                continue
            if r.in_use or (n_out == 0 and grads_out):
                back.append(r)
            elif any(not self.store.is_offloaded(e.key) and e.nbytes > 0 for e in model):
                out.append(r)
        if out:
            self._transition(out, None, recovering=True)
        for r in back:
            self._transition([], r, recovering=True)
        self._interrupted = False

    def _drop_grads(self, role: Role, keep: set[int]) -> None:
        # grads="drop": free the role's grads once it is out, but never a grad that a role
        # staying (or coming) on the device holds.
        if role.grads != "drop":
            return
        for p, storage in role.grad_storages():
            if storage_key(storage) not in keep:
                p.grad = None

    def record_move(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord:
        """Add a store move to the timeshare's records (and warn if the driver did not get the
        freed memory back). For optimizer residency strategies, which move state themselves.
        The record's host time runs from the verb's start, or the previous record of the
        same verb, to now."""
        now = time.perf_counter()
        host_seconds, self._verb_t0 = now - self._verb_t0, now
        self._settle_stalls()
        stalls = self.store.take_stalls()
        if stalls:
            self._stalls.append((len(self.records), stalls))
        rec = TransitionRecord.from_move(
            len(self.records),
            kind,
            roles_out,
            role_in,
            move,
            self.store.host_reserved_bytes,
            measure_release=self.ops.is_accelerator and self.config.release_to_driver,
            note=note,
            host_seconds=host_seconds,
        )
        self.records.append(rec)
        if rec.unreleased_bytes > self.config.release_tolerance_bytes and kind not in self._warned_unreleased:
            # Once per kind of transition: a loop repeats the same cause every step; the records
            # (and report()) keep every transition's figure.
            self._warned_unreleased.add(kind)
            warnings.warn(
                f"transition {rec.index} ({kind}) freed {format_bytes(move.bytes_out)} but the driver "
                f"got back {format_bytes(rec.unreleased_bytes)} less than expected: caching-allocator "
                f"segments are shared with tensors outside the roles (activations, caches) and "
                f"cannot be released. Free those tensors before switching, or set "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Later {kind} transitions are not "
                f"warned about; each record's unreleased_bytes has its figure",
                stacklevel=3,
            )
        return rec

    # ---- hooks ------------------------------------------------------------------------------
    def _make_guard(self, role: Role):
        def guard(where, tensors):
            # Called by the role's sources before their state is used (a module's forward).
            if self._interrupted:
                with self._lock:
                    if self._interrupted:
                        self._recover()
            if role.resident:
                return
            # The role is out; a module may still run if its own tensors are on the device
            # (shared with a resident role, or too small to move). Its children check theirs.
            if tensors is not None and not any(moved_out(t) for t in tensors):
                return
            what = f"{type(where).__name__}" if where is not None else "its state"
            raise RuntimeError(
                f"role {role.name!r} is offloaded: {what} has no device memory (its bytes are on the host). "
                f"Run it inside `with ts.use({role.name!r}):`, or call ts.load({role.name!r}) first. To read "
                f"its values without loading it, use state_dict()"
            )

        return guard

    def _make_step_pre_hook(self, role: Role):
        def pre(opt, args, kwargs):
            if role.streaming:  # one chunk of a streamed step: its state is in already
                return
            with self._lock:
                step_pre(opt)

        def step_pre(opt):
            self._start_clock()
            self._recover_if_interrupted()
            self._restore_groups(role, opt)
            if role.optimizer_locked:
                raise RuntimeError(
                    f"optimizer.step() of role {role.name!r} was called inside offload_optimizer(): "
                    f"its state is on the host. Step after the `with` block ends"
                )
            if not role.resident:
                raise RuntimeError(
                    f"optimizer.step() of role {role.name!r} was called while the role is "
                    f"offloaded; step inside `with ts.use({role.name!r}):`"
                )
            role.optimizer_touched()  # the step reloads or creates state on the device
            policy_for(role.optimizer_residency).before_step(self, role, opt)

        return pre

    def _make_step_post_hook(self, role: Role):
        def post(opt, args, kwargs):
            if role.streaming:
                return
            with self._lock:
                policy_for(role.optimizer_residency).after_step(self, role, opt)

        return post
