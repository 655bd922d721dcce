"""A transition and its undo: :class:`TransitionRunner`, the collaborator of
:class:`~tidal.Timeshare` that runs a store move for a set of roles, records it, and brings every
role's flags back in line with its storages when an exception (``KeyboardInterrupt`` included)
stopped a move."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from tidal.state.collect import StateEntry, storage_key
from tidal.state.handover import ReleaseProgress, RoomSource
from tidal.state.moves import SwitchOptions
from tidal.state.result import MoveResult
from tidal.state.store import OffloadStore
from tidal.timeshare.config import TimeshareConfig
from tidal.timeshare.role import Role
from tidal.timeshare.residency import policy_for
from tidal.timeshare.telemetry import TransitionLog, TransitionRecord

__all__ = ["TransitionRunner"]


class TransitionRunner:
    """Running, recording and recovering a timeshare's transitions.

    Args:
        store: the timeshare's store, which moves the storages.
        config: the timeshare's settings (headroom, overlap cap, hand-over chunks, waits).
        roles: the timeshare's roles by name (the live mapping: roles added later are seen).
        log: where each move's record goes.
        live: ``live(role, optim=...)``: the role's storages now, as the store sees them.
        resident_keys: ``resident_keys(exclude=...)``: the storages resident roles hold.
        tick: the next value of the clock that orders eviction.

    :attr:`interrupted` is set before a move changes anything and cleared once the roles' flags
    agree with the store again: still set, an exception interrupted one (:meth:`recover`).
    The caller holds the timeshare's lock around every method.
    """

    def __init__(
        self,
        *,
        store: OffloadStore,
        config: TimeshareConfig,
        roles: Mapping[str, Role],
        log: TransitionLog,
        live: Callable[..., list[StateEntry]],
        resident_keys: Callable[..., set[int]],
        tick: Callable[[], int],
    ) -> None:
        self.store, self.config, self.roles, self.log = store, config, roles, log
        self._live, self._resident_keys, self._tick = live, resident_keys, tick
        self.interrupted = False

    def run(
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
        """Move ``evict`` out and ``incoming`` in, in one switch; record it. ``recovering``: a
        step of :meth:`recover` (the interrupted mark stays until it is done)."""
        # What the roles staying on the device hold: only an eviction needs it (collecting every
        # resident role's storages costs host time in proportion to their count).
        keep = self._resident_keys(exclude=evict) if evict else set()
        in_entries: list[StateEntry] = []
        if incoming is not None:
            in_entries, inc = self.incoming(incoming)
            keep.update(e.key for e in inc)
        out_entries, check = self.outgoing(evict, keep)
        what = f"loading role {incoming.name!r}" if incoming else "offload"
        frozen: set[int] = set()
        if incoming is not None and incoming.frozen:
            # Its parameters and buffers, but none a trained role also holds (a shared module).
            trained = {e.key for r in self.roles.values() if not r.frozen for e in self._live(r, optim=False)}
            frozen = {e.key for e in in_entries if e.kind != "grad" and e.key not in trained}

        def move_state() -> MoveResult:
            # A prefetch of another role gives its memory back first (its storages stay out).
            self.cancel_prefetch(keep={e.key for e in in_entries}, guarded=False)
            how = SwitchOptions(
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
            return self.store.switch(out_entries, in_entries, how)

        move = self.guarded(
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
            self.interrupted = False
        kind = "switch" if evict and incoming else ("reload" if incoming else "offload")
        return self.record(kind, tuple(r.name for r in evict), incoming.name if incoming else None, move)

    def incoming(self, role: Role) -> tuple[list[StateEntry], list[StateEntry]]:
        """(the role's storages that are out, all it brings in) for a transition loading it.
        Optimizer state comes in with the role only under "role" residency; otherwise it stays
        where it is (the step hooks move it), so it need not be looked at."""
        inc = self._live(role, optim=policy_for(role.optimizer_residency).moves_with_role)
        return [e for e in inc if self.store.is_offloaded(e.key)], inc

    def outgoing(self, evict: Sequence[Role], keep: set[int]) -> tuple[list[StateEntry], set[int]]:
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

    def cancel_prefetch(self, *, keep: set[int], guarded: bool = True) -> None:
        """Give back the memory of prefetched storages but those in ``keep``."""
        gone = self.store.prefetched_keys() - keep
        if gone:
            cancel = lambda: self.store.cancel_prefetch(only=gone)  # noqa: E731
            self.guarded(cancel, touches_model=True) if guarded else cancel()

    def guarded(self, move, *, touches_model: bool, recovering: bool = False, settled_by_caller: bool = False):
        """Run a store move. If it raises (anything, ``KeyboardInterrupt`` included), the store
        has already made every storage resident or tracked; when the move touched model state
        (params, buffers, grads) the roles' flags are then brought in line with the store
        (:meth:`recover`) before the exception goes on. ``settled_by_caller``: the caller
        still has flags to set after the move and clears the interrupted mark itself."""
        if touches_model:
            self.interrupted = True  # write-ahead: cleared only when the flags are right again
        try:
            result = move()
        except BaseException:
            if touches_model and not recovering:
                self.recover()
            raise
        if touches_model and not recovering and not settled_by_caller:
            self.interrupted = False
        return result

    def recover_if_interrupted(self) -> None:
        """:meth:`recover`, where a move was interrupted (here or in the store)."""
        if self.interrupted or self.store.interrupted:
            self.recover()

    def recover(self) -> None:
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
        self.interrupted = True
        self.store.recover()
        out, back = [], []
        for r in self.roles.values():
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
            self.run(out, None, recovering=True)
        for r in back:
            self.run([], r, recovering=True)
        self.interrupted = False

    def _drop_grads(self, role: Role, keep: set[int]) -> None:
        # grads="drop": free the role's grads once it is out, but never a grad that a role
        # staying (or coming) on the device holds.
        if role.grads != "drop":
            return
        for p, storage in role.grad_storages():
            if storage_key(storage) not in keep:
                p.grad = None

    def record(
        self, kind: str, roles_out: tuple[str, ...], role_in: str | None, move: MoveResult, note: str = ""
    ) -> TransitionRecord:
        """Add a store move to the records (:class:`~tidal.timeshare.telemetry.TransitionLog`; it
        warns if the driver did not get the freed memory back). The record's host time runs from
        the verb's start, or the previous record of the same verb, to now."""
        return self.log.record(kind, roles_out, role_in, move, note)
