"""Bringing a role, or its optimizer state, in ahead of its use, behind the work queued now:
:class:`Prefetching`, the part of :class:`~tidal.Timeshare` with ``prefetch`` and
``prefetch_optimizer``."""

from __future__ import annotations

import dataclasses
import time

from tidal.timeshare.evict import check_keep_free_bytes
from tidal.timeshare.role import Role
from tidal.timeshare.residency import policy_for
from tidal.timeshare.threads import serialised
from tidal.timeshare.telemetry import TransitionRecord

__all__ = ["Prefetching"]


class Prefetching:
    """``prefetch`` and ``prefetch_optimizer``, a mixin of :class:`~tidal.Timeshare`."""

    @serialised
    def prefetch(
        self,
        name: str,
        *,
        leave_free_bytes: int | None = None,
        limit_bytes: int | None = None,
        write_back: bool = True,
        keep_free_bytes: int | None = None,
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
          digest and copied by the switch. ``keep_free_bytes``: the roles a
          ``use(name, keep_free_bytes=...)`` with the same value would move out, judged from
          the free memory now (pass the value that ``use`` will get).

        A prefetch lasts until the next transition: ``use``/``load`` of ``name`` claims it, any
        other transition first gives its memory back (nothing lost).

        Memory cost: the device memory of the storages brought in, from this call on (the
        overlap the budget, ``leave_free_bytes`` and ``limit_bytes`` bound); no host memory
        beyond the roles' slots.

        Raises ``ValueError`` for an unknown role or a negative byte count (``TypeError`` for a
        ``keep_free_bytes`` not an int), ``RuntimeError`` inside a backward pass or after
        :meth:`close`. Returns the record (kind
        ``"prefetch"``: ``bytes_in`` queued, ``bytes_out`` written back, ``seconds`` the host
        time spent queueing), or None when nothing was queued (the role is resident, or
        nothing fits).
        """
        check_keep_free_bytes(keep_free_bytes)
        role, leave = self._begin_prefetch("prefetch", name, leave_free_bytes, limit_bytes)
        if role.resident:
            return None
        evict = self.evictions.choose(role, ignore_use=True, keep_free_bytes=keep_free_bytes)
        budget = self.config.budget_bytes
        if budget is not None:
            # Nothing goes out before use(): what comes in shares the budget with every resident role.
            resident = {e.key: e.nbytes for r in self._roles.values() if r.resident for e in self._live(r)}
            room = max(0, budget - sum(n for k, n in resident.items() if not self.store.is_offloaded(k)))
            limit_bytes = room if limit_bytes is None else min(limit_bytes, room)
        in_entries, inc = self.transitions.incoming(role)
        self.transitions.cancel_prefetch(keep={e.key for e in in_entries})
        t0 = time.perf_counter()
        inn = self.store.prefetch(in_entries, leave_free_bytes=leave, limit_bytes=limit_bytes)
        out = None
        if write_back:
            for r in evict:
                r.before_copy()  # the write-back waits for the current stream: it waits for the sources' own work
            out_entries = self.transitions.outgoing(evict, self.resident_keys(exclude=evict) | {e.key for e in inc})[0]
            out = self.store.write_back(out_entries) if out_entries else None
        if not (inn.bytes_in or (out is not None and out.bytes_out)):
            return None
        move = dataclasses.replace(
            inn,
            bytes_out=out.bytes_out if out is not None else 0,
            seconds=time.perf_counter() - t0,
            segments=inn.segments + (out.segments if out is not None else 0),
            queue_seconds=inn.queue_seconds + (out.queue_seconds if out is not None else 0.0),
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
        move = self.transitions.guarded(
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
        self.transitions.recover_if_interrupted()
        role = self.role(name)
        leave = self.config.headroom_bytes if leave_free_bytes is None else leave_free_bytes
        for what, v in (("leave_free_bytes", leave), ("limit_bytes", limit_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{what} must be >= 0, got {v}")
        return role, leave
