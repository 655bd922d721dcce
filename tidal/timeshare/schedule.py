"""What each phase of a step keeps free beside its role and what comes in behind it:
:class:`PhaseSchedule`, over a :class:`~tidal.timeshare.Timeshare` and the phases' memory
readings (:class:`~tidal.timeshare.phase_memory.PhaseMemory`).

A step of RL training runs the same phases in the same order every time (generation, the
scorings, the loss with its backward and optimizer step), so what a phase allocated the last
time it ran is a good guess of what it will allocate now. The schedule turns that reading into
the two decisions a timeshare leaves to its caller:

* **keep**: a turn moves out only what it takes to leave the phase's need free beside its role
  (:meth:`tidal.Timeshare.use`'s ``keep_free_bytes``), so roles that fit stay and cost no copy;
* **prefetch**: the next role (or the trained role's optimizer state) comes in behind the
  phase's compute, leaving the phase's need free (:meth:`tidal.Timeshare.prefetch`).

The TRL adapter, the GRPO recipe and a bare loop use the same object (``docs/timeshare.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from tidal.memory import phase_need_bytes
from tidal.timeshare.phase_memory import PhaseMemory

__all__ = ["PhaseSchedule", "ScheduleConfig", "StepPhases"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPhases:
    """The phases of one step as the schedule needs to know them.

    Attributes:
        order: the roles in the order a step computes with them, read as a cycle
            (:meth:`PhaseSchedule.after`); roles not registered are skipped.
        turn_phase: the phase a role's turn runs when it comes after a prefetch of it (default:
            the role's own name), so a prefetch writes back only what that turn will move out.
        generation: the phase that decodes (its KV cache grows in pieces that the allocator's
            fragments from its last run cannot hold), or None.
        loss: the trained role's loss phase, whose turn holds the role through ``backward``
            too; its blocks (activations, gradients) are large, so the allocator's fragments
            do not count as room beside it.
        backward: the backward (with the optimizer step after it), measured apart from
            ``loss``; None where the loss phase's reading holds it.
    """

    order: tuple[str, ...]
    turn_phase: Mapping[str, str] = dataclasses.field(default_factory=dict)
    generation: str | None = "generate"
    loss: str = "loss"
    backward: str | None = "backward"

    def __post_init__(self) -> None:
        if not self.order or len(set(self.order)) != len(self.order):
            raise ValueError(f"StepPhases.order must name each role once, got {self.order!r}")
        unknown = set(self.turn_phase) - set(self.order)
        if unknown:
            raise ValueError(f"StepPhases.turn_phase names roles not in order: {sorted(unknown)}")

    def phase_of(self, role: str) -> str:
        return self.turn_phase.get(role, role)

    def held(self, phase: str) -> tuple[str, ...]:
        """The phases a turn for ``phase`` holds its role through: the loss's with the backward."""
        if phase == self.loss and self.backward is not None:
            return (phase, self.backward)
        return (phase,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """How a :class:`PhaseSchedule` trades memory for time.

    Attributes:
        prefetch: keep what fits and bring the next role in behind compute; off, every turn
            moves every other role out (the timeshare's plain switch) and nothing comes ahead.
        prefetch_peak_bytes: the device's allocated bytes a prefetch may bring it up to (what a
            phase will still allocate counted; the allocator's fragments, free memory a large
            block cannot use, are left free beside it but do not count). None: free memory
            decides.
        unmeasured_keep_free_bytes: where the device has no allocator counters (the CPU), what
            a turn keeps free beside its role; None: every other role goes.
    """

    prefetch: bool = True
    prefetch_peak_bytes: int | None = None
    unmeasured_keep_free_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"ScheduleConfig.prefetch must be a bool, got {self.prefetch!r}")
        for name in ("prefetch_peak_bytes", "unmeasured_keep_free_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"ScheduleConfig.{name} must be an int >= 0 or None, got {v!r}")


class ScheduledTimeshare(Protocol):
    """What a :class:`PhaseSchedule` uses of a :class:`tidal.Timeshare`."""

    roles: Any
    ops: Any

    def is_resident(self, name: str) -> bool: ...
    def bytes_to_load(self, name: str) -> int: ...
    def prefetch(self, name: str, **kw: Any) -> Any: ...
    def prefetch_optimizer(self, name: str, **kw: Any) -> Any: ...


class PhaseSchedule:
    """The keep and prefetch decisions of a step's phases (see the module docstring).

    Args:
        timeshare: the roles' :class:`tidal.Timeshare`.
        phases: the step's roles and phases (:class:`StepPhases`).
        config: :class:`ScheduleConfig`.
        memory: the phases' readings; default :meth:`PhaseMemory.of` the timeshare's device
            (None off an accelerator: then the keep is ``unmeasured_keep_free_bytes`` and a
            prefetch leaves the timeshare's headroom).

    Each decision reads what the phase allocated the last time it ran, plus 10% and 256 MiB
    (:func:`tidal.memory.phase_need_bytes`): before a phase has run once, its turn moves every
    other role out and nothing is prefetched behind it. Memory cost: a few dictionaries.
    """

    def __init__(
        self,
        timeshare: ScheduledTimeshare,
        phases: StepPhases,
        *,
        config: ScheduleConfig | None = None,
        memory: PhaseMemory | None | str = "auto",
    ) -> None:
        if config is not None and not isinstance(config, ScheduleConfig):
            raise TypeError(f"config must be a tidal.timeshare.ScheduleConfig, got {type(config).__name__}")
        if not isinstance(phases, StepPhases):
            raise TypeError(f"phases must be a tidal.timeshare.StepPhases, got {type(phases).__name__}")
        self.timeshare, self.phases = timeshare, phases
        self.config = config or ScheduleConfig()
        self.memory: PhaseMemory | None = PhaseMemory.of(timeshare.device) if memory == "auto" else memory
        # Bytes the allocator's counters hold that are not on the device (an inference engine's
        # pool while it sleeps: its tensors stay allocated, their memory unmapped), left out of
        # what prefetch_peak_bytes is compared with; set by the engine's owner.
        self.outside_bytes: Callable[[], int] = lambda: 0
        self.depth = 0  # phases open now (a nested one makes no new room)
        self._gathered = (0, 0)  # bytes allocated up front by this generation and by the last

    # ---- turns ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, role: str | None, phase: str, *, keep_free_bytes: int | None | str = "schedule") -> Iterator[None]:
        """``with``: ``role`` resident for the block (None: no role, only the reading), its turn
        keeping free what :meth:`keep_free` says (or ``keep_free_bytes``). The outermost phase
        also marks where the device's peak is attributed: from its start until the next
        outermost phase starts (so the loss phase's peak includes the backward and the
        optimizer step that follow it)."""
        memory = self.memory
        outermost = self.depth == 0 and memory is not None
        keep = self.keep_free(role, phase) if keep_free_bytes == "schedule" and role is not None else keep_free_bytes
        if outermost:
            memory.start(phase)
        self.depth += 1
        try:
            if role is None:
                yield
                return
            with self.timeshare.use(role, keep_free_bytes=keep):
                if outermost:
                    # The phase's need is what it allocates beside what its switch left: the
                    # loss's activations fill the room of the reference its switch dropped (read
                    # from before the switch, they counted as nothing, and the next loss kept
                    # the reference where they did not fit: out of memory at 7B 64 x 256 on an
                    # H100, 2026-11-26).
                    memory.rebase()
                yield
        finally:
            self.depth -= 1

    def keep_free(self, role: str, phase: str) -> int | None:
        """The bytes the turn of ``role`` for ``phase`` keeps free beside it instead of switching
        every other role out: what the phase allocated the last time it ran (the loss's: with
        the backward after it, outside the allocator's fragments), plus 10% and 256 MiB. The
        roles that fit beside that stay on the device; the others go, least recently used first
        (a frozen role dropped without a copy). None (every other role goes) without prefetch,
        before the phase has run once, or where ``prefetch_peak_bytes`` leaves no room for that
        beside what is allocated now; 0 inside a phase that made its room already."""
        cfg, memory, ts = self.config, self.memory, self.timeshare
        if not cfg.prefetch or role not in ts.roles:
            return None
        if memory is None:
            return cfg.unmeasured_keep_free_bytes
        if self.depth > 0 and ts.is_resident(role):
            return 0  # inside a phase that made the room already (the loss's policy log-probs): move nothing
        # The loss's turn also holds the policy through the backward and the optimizer step
        # after it, a phase of its own: both count (their sum bounds what the turn allocates,
        # as the backward starts with what the loss left allocated).
        held = self.phases.held(phase)
        growths = [memory.growth.get(p) for p in held]
        if None in growths:
            return None
        need = phase_need_bytes(sum(growths))
        if cfg.prefetch_peak_bytes is not None:
            # The bound is on allocated bytes: the phase's need counts, the fragments below
            # (free memory, though of no use to large blocks) do not.
            coming = ts.bytes_to_load(role)  # what a prefetch brought in is allocated already
            ahead = 0
            if phase == self.phases.loss and self.phases.backward is not None and self._stepped_whole(role):
                # The backward's growth leaves out the optimizer state its prefetch brought in;
                # with "step" residency the step brings all of it in anyway, so it counts here.
                # (Streamed, the prefetch brings in only what the bound leaves beside the roles
                # kept, and the chunks after it are in the growth.)
                ahead = memory.brought_in.get(self.phases.backward, 0)
            if self._on_device() + coming + need + ahead > cfg.prefetch_peak_bytes:
                return None
        if phase == self.phases.loss:
            # The backward allocates large blocks: free pieces of the allocator's partly used
            # segments do not count as room for keeping a role beside it (Qwen2-7B, 64 x 256,
            # H100, 2026-11-26: 2.71 GiB of cached free memory could not hold a 612 MiB block),
            # only the driver's free memory and the whole free segments the allocator can give
            # back to it.
            return need + self.fragments(*held)
        return need

    def _stepped_whole(self, role: str) -> bool:
        """The role's optimizer step brings all of its state in (``"step"`` residency)."""
        try:
            return self.timeshare.role(role).optimizer_residency == "step"
        except (KeyError, ValueError):
            return False

    def after(self, role: str) -> str:
        """The role the step computes with after ``role``'s phase: the next registered role of
        :attr:`StepPhases.order`, read as a cycle."""
        order = [r for r in self.phases.order if r in self.timeshare.roles or r == role]
        if role not in order:
            raise ValueError(f"{role!r} is not a role of this step's order {self.phases.order!r}")
        return order[(order.index(role) + 1) % len(order)]

    # ---- ahead ---------------------------------------------------------------------------------
    def prefetch(self, phase: str, then: str, *, growth: int | None = None, write_back: bool = True) -> Any:
        """Start bringing role ``then`` in behind ``phase``: leaving free what ``phase``
        allocated the last time it ran less what of it is allocated already
        (:meth:`allocated_up_front`), or what it will still allocate where the caller knows it
        (``growth``: an inference engine's generation, whose weights and KV cache are in its
        own pool already), +10% and 256 MiB, and behind the generation the most the
        allocator's fragments reached in the last one; written back ahead is only what the
        turn of ``then`` will move out (:meth:`keep_free` of its turn). Under
        ``prefetch_peak_bytes`` it brings in at most the bound less what is allocated and what
        the phase will still allocate. ``write_back=False``: nothing is copied out ahead (behind
        a phase whose own small copies to the host would queue behind it: an inference
        engine's decode reads each step's tokens back). Returns the prefetch's record (None: nothing started,
        as without prefetch, with a single role, or before the phase has run once)."""
        ts = self.timeshare
        if not self.config.prefetch or then not in ts.roles or len(ts.roles) < 2:
            return None
        room = self._room(phase, growth, large_blocks=False)
        if room is None:
            return None
        leave, limit = room
        keep = self.keep_free(then, self.phases.phase_of(then))
        rec = ts.prefetch(then, leave_free_bytes=leave, limit_bytes=limit, keep_free_bytes=keep, write_back=write_back)
        self._count(rec)
        return rec

    def prefetch_optimizer(self, phase: str, role: str, *, growth: int | None = None) -> Any:
        """Start bringing ``role``'s optimizer state in behind ``phase`` (its backward), ahead
        of its step, leaving free what the phase allocates (``growth``, default its last
        reading) +10% and 256 MiB, and the allocator's fragments (:meth:`fragments`): the
        backward's large blocks cannot use them. Returns the prefetch's record, or None."""
        if not self.config.prefetch or role not in self.timeshare.roles:
            return None
        room = self._room(phase, growth, large_blocks=True)
        if room is None:
            return None
        leave, limit = room
        rec = self.timeshare.prefetch_optimizer(role, leave_free_bytes=leave, limit_bytes=limit)
        self._count(rec)
        return rec

    def _room(self, phase: str, growth: int | None, *, large_blocks: bool) -> tuple[int | None, int | None] | None:
        """(leave_free_bytes, limit_bytes) of a prefetch behind ``phase``; None: not yet."""
        memory = self.memory
        if memory is None:
            return None, None
        if growth is None:
            growth = memory.growth.get(phase)
            if growth is None:
                return None  # its needs are not known yet: measured this time, used the next
            if memory.phase == phase:
                # Started inside the phase: what it allocated already is not left free twice
                # (at 14B on 2 H100s the reference could not come in behind generation for it,
                # 2026-11-27).
                growth = max(0, growth - self.allocated_up_front(phase))
        need = phase_need_bytes(growth)
        leave = need
        if large_blocks:
            # Brought in as the backward starts, whose large blocks (the activations' and
            # weights' gradients) the free pieces of the allocator's partly used segments
            # cannot hold: as for the loss's keep, those do not count as the backward's room.
            leave += self.fragments(phase)
        elif phase == self.phases.generation:
            # Nor can the pieces the last generation's own growing KV cache left in them hold
            # its next blocks: a 32B shape's second generation on 4 H100s ran out of memory
            # asking for 158 MiB with 1.09 GiB of them free (2026-11-28). Those its prefetch
            # found there (the backward's) stay counted as room: its role's blocks are small.
            leave += memory.fragments.get(phase, 0)
        limit = None
        if self.config.prefetch_peak_bytes is not None:
            # The bound is on allocated bytes: what the phase will still allocate counts, the
            # fragments left free beside it do not (they are free memory, not allocated).
            # Counted here, the ~6 GiB of them a 1.5B step's backward leaves (read again in the
            # next generation) took as much of the reference out of the generation's prefetch
            # under a 17 GiB bound.
            limit = max(0, self.config.prefetch_peak_bytes - self._on_device() - need)
        return leave, limit

    def _on_device(self) -> int:
        """The allocator's allocated bytes that are on the device (less :attr:`outside_bytes`)."""
        return max(0, self.memory.allocated() - self.outside_bytes())

    def _count(self, rec: Any) -> None:
        if rec is not None and self.memory is not None:
            self.memory.prefetched(rec.bytes_in)

    # ---- readings --------------------------------------------------------------------------
    def gathered(self, nbytes: int) -> None:
        """This generation allocated ``nbytes`` before its first forward (an FSDP2 policy
        gathered whole for it; 0: gathered per unit, or not sharded): see
        :meth:`allocated_up_front`."""
        self._gathered = (nbytes, self._gathered[0])

    def allocated_up_front(self, phase: str) -> int:
        """What the running ``phase`` allocated before its first forward that its growth the
        last time held too: a policy gathered whole for generation, where the last generation
        gathered it as well (:meth:`gathered`). Nothing otherwise: a generation gathered now
        after one that gathered per unit has that growth still to come (its KV cache)."""
        now, last = self._gathered
        if phase != self.phases.generation or not now or now != last or self.memory is None:
            return 0
        return min(now, self.memory.grown())

    def fragments(self, *phases: str) -> int:
        """The room the allocator's fragments take from a large block: those there now, or, if
        more, the most they reached in ``phases`` the last time they ran (a backward that
        splits segments as it goes, FSDP2's, leaves pieces its later blocks cannot use: 2.92
        GiB of them when a 14B-shape step ran out of memory on an H100, 2026-11-27)."""
        now = self.timeshare.ops.fragmented_free_bytes()
        if self.memory is None:
            return now
        return max([now] + [self.memory.fragments.get(p, 0) for p in phases])

    def room_for_backward(self, role: str, need: int | None) -> None:
        """Right before ``role``'s backward, the loss's activations now allocated, move out
        what it takes to leave the backward's ``need``
        (:meth:`~tidal.timeshare.phase_memory.PhaseMemory.backward_need`), +10% and 256 MiB,
        free outside the allocator's fragments. A role the loss's turn kept on the last step's
        reading (a longer batch makes larger activations) goes now, a frozen one dropped
        without a copy; where the room is there, this reads the free memory and moves nothing."""
        ts = self.timeshare
        if not self.config.prefetch or need is None or role not in ts.roles or len(ts.resident_roles) < 2:
            return
        backward = self.phases.backward or self.phases.loss
        ts.load(role, keep_free_bytes=phase_need_bytes(need) + self.fragments(backward))
