"""Turns and phases of the RL loop: a role made resident for a phase, and what the phase cost.

A *turn* brings a role's state onto the device through a :class:`~tidal.Timeshare`, either
directly (roles of one process) or through a cross-process :class:`~tidal.distributed.GPULease`
(roles in separate processes on one GPU: the turn is granted only after the previous holder
confirmed its release, and leaving it offloads every role of this process). A *phase* is the
work done in a turn, measured: wall seconds, the switch's and the compute's allocator peaks,
driver-level used memory, bytes moved and transition seconds.

Used by :class:`tidal_recipes.grpo.GRPOTrainer` and by the remote role workers
(:mod:`tidal_recipes.grpo.workers`), so both report the same figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

from tidal.device import DeviceOps
from tidal.distributed.lease import GPULease, timeshare_callbacks
from tidal.memory import host_peak_rss_bytes, reset_host_peak_rss
from tidal.timeline import MemoryTimeline
from tidal.timeshare import Timeshare
from tidal.timeshare.schedule import PhaseSchedule

__all__ = ["RoleTurns", "Turn"]


@dataclasses.dataclass(kw_only=True)
class Turn:
    """One turn of a role: seconds to bring it in (including the wait for the lease), and,
    with a lease, the seconds its release took and the grant (who held the GPU before, how
    it ended, and the driver-level confirmation of its release)."""

    role: str
    load_s: float = 0.0
    release_s: float = 0.0
    waited_s: float = 0.0
    previous: dict | None = None


class RoleTurns:
    """Turns of the roles of one process, and the measurement of their phases.

    Args:
        ops: the device.
        timeline: where samples, phases and transition marks go.
        ts: the roles' Timeshare (None: every role stays resident, turns cost nothing).
        lease: the GPU's cross-process lease (None: roles of this process only).
        schedule: what each turn keeps free and what comes in behind its phase
            (:class:`tidal.timeshare.schedule.PhaseSchedule` over ``ts``; its memory readings
            follow the phases run here). None: every other role goes at each turn.
    """

    def __init__(
        self,
        ops: DeviceOps,
        timeline: MemoryTimeline,
        ts: Timeshare | None,
        lease: GPULease | None = None,
        *,
        schedule: PhaseSchedule | None = None,
    ) -> None:
        if lease is not None and ts is None:
            raise ValueError(
                "a lease hands the GPU over by offloading this process's roles through a Timeshare; give ts= as well"
            )
        if schedule is not None and (ts is None or schedule.timeshare is not ts):
            raise ValueError("schedule= must be a PhaseSchedule over the same Timeshare as ts=")
        if schedule is not None and lease is not None and schedule.config.prefetch:
            raise ValueError("prefetching the next role is not supported across processes (a lease)")
        self.ops, self.timeline, self.ts, self.lease, self.schedule = ops, timeline, ts, lease, schedule
        self.turns: list[Turn] = []

    @contextlib.contextmanager
    def turn(self, name: str, *, keep_free_bytes: int | None = None) -> Iterator[Turn]:
        """Role ``name`` resident for the block; ``keep_free_bytes``: its switch moves out only
        what it takes to leave that much free beside it (:meth:`tidal.Timeshare.use`)."""
        turn = Turn(role=name)
        if self.ts is None:
            yield turn
            return
        start = len(self.ts.records)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if self.lease is not None:
                # Granted only after the previous holder (another process) offloaded and
                # confirmed its release; leaving the turn offloads every role of this process.
                grant = stack.enter_context(self.lease.hold(name, **timeshare_callbacks(self.ts, name)))
                turn.waited_s, turn.previous = grant.waited_s, grant.previous
            else:
                self.ts.load(name, keep_free_bytes=keep_free_bytes)
            turn.load_s = time.perf_counter() - t0
            for rec in self.ts.records[start:]:
                self.timeline.mark(f"{rec.kind} -> {name}", bytes=rec.bytes_in + rec.bytes_out, seconds=rec.seconds)
            with self.ts.use(name, keep_free_bytes=keep_free_bytes):
                yield turn
            t_release = time.perf_counter()
        if self.lease is not None:
            turn.release_s = time.perf_counter() - t_release
            self.timeline.mark(f"release {name}", seconds=turn.release_s)
        self.turns.append(turn)

    @contextlib.contextmanager
    def phase(
        self,
        name: str,
        *,
        role: str,
        into: dict,
        step: int = -1,
        then: str | None = None,
    ) -> Iterator[None]:
        """A phase run in a turn of ``role``; its figures go to ``into[name]``: seconds, the
        peaks (allocator: of the switch and of the compute; driver-level used), what the phase
        left allocated, bytes moved (the switch that brought the role in, optimizer state
        moved around ``step()``, a prefetch, and with a lease the offload at its end) and
        transition seconds (bringing the role in, moving optimizer state, queueing a
        prefetch, releasing the lease: the time the step spends on transitions).

        With a ``schedule``, the turn keeps free what it says for the phase
        (:meth:`~tidal.timeshare.schedule.PhaseSchedule.keep_free`), and ``then``, the role of
        the next phase, is prefetched at the start of this one behind its compute
        (:meth:`~tidal.timeshare.schedule.PhaseSchedule.prefetch`); ``"prefetched_bytes"`` in
        the figures, which the peaks include, and ``"start_allocated_bytes"``, what was
        allocated before it."""
        schedule = self.schedule
        memory = schedule.memory if schedule is not None else None
        keep_free_bytes = schedule.keep_free(role, name) if schedule is not None else None
        if memory is not None:
            memory.start(name)
        start = len(self.ts.records) if self.ts is not None else 0
        host_peak_reset = reset_host_peak_rss()
        t0 = time.perf_counter()
        with self.timeline.phase(name, step=step) as span, self.turn(role, keep_free_bytes=keep_free_bytes) as turn:
            # Separate the switch's peak from the phase's own, for the planner's calibration.
            switch_peak = self.ops.peak_allocated_bytes()
            if memory is not None:
                memory.rebase()  # the phase's growth counted from what its switch left (it resets the peak)
            else:
                self.ops.reset_peak()
            alloc_start = self.ops.allocated_bytes()
            if then is not None and schedule is not None:
                schedule.prefetch(name, then)
            yield
            self.ops.synchronize()  # the compute peak must include the phase's queued kernels
            compute_peak = self.ops.peak_allocated_bytes()
            alloc_end = self.ops.allocated_bytes()
        recs = self.ts.records[start:] if self.ts is not None else []
        # The switch is timed by wall clock (it includes allocation and release); optimizer
        # moves inside step() by their records.
        in_step_s = sum(r.seconds for r in recs if r.kind.startswith("optim") or r.kind == "prefetch")
        peak = (
            span.peak_allocated_bytes
            if not self.ops.is_accelerator
            else max(span.peak_allocated_bytes, switch_peak, compute_peak)
        )
        into[name] = {
            "seconds": time.perf_counter() - t0,
            "peak_allocated_bytes": peak,
            "switch_peak_allocated_bytes": switch_peak,
            "compute_peak_allocated_bytes": compute_peak,
            "peak_driver_used_bytes": span.peak_driver_used_bytes,
            # what the phase left allocated (0 for the rollout: its KV cache died with it)
            "left_allocated_bytes": alloc_end - alloc_start,
            "start_allocated_bytes": alloc_start,
            "moved_bytes": sum(r.bytes_in + r.bytes_out for r in recs),
            # Of moved_bytes, what ran behind the phase's compute: the next role brought in
            # ahead, this role written back ahead of its offload.
            "prefetched_bytes": sum(r.bytes_in for r in recs if r.kind == "prefetch"),
            "written_back_bytes": sum(r.bytes_out for r in recs if r.kind == "prefetch"),
            "transition_seconds": turn.load_s + in_step_s + turn.release_s,
            # the process's peak resident host memory during the phase (pinned copies included);
            # None where the peak cannot be reset per phase
            "host_peak_rss_bytes": host_peak_rss_bytes() if host_peak_reset else None,
        }
        if self.lease is not None:
            into[name]["lease_waited_s"] = turn.waited_s
            into[name]["previous_holder"] = turn.previous
