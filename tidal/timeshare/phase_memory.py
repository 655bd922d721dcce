"""The device's allocated bytes per phase of a step: :class:`PhaseMemory`, read for a log's
peaks and for what each turn of a :class:`~tidal.timeshare.schedule.PhaseSchedule` keeps free
and each prefetch leaves free."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["PhaseMemory"]


class PhaseMemory:
    """The device's allocated bytes per phase of a step (in TRL's: generation, scoring, the loss,
    the backward with the optimizer step after it): the peak of each, for the log lines, and what
    each allocated the last time it ran, which a prefetch started in it leaves free.

    A phase runs from its :meth:`start` to the next phase's. Its growth is its peak less what
    was allocated at its start and less what prefetches started in it brought in (memory of
    the next phase, not its own). A log line (:meth:`take_peaks`) in the middle of a phase
    reads and resets the device's peak counter but not the phase: its growth is the highest
    reading over the whole phase, however many log lines fall in it.

    It also keeps, per phase, the most the allocator's fragments (free pieces of partly used
    segments, which a large block cannot use) reached while it ran: a phase that splits
    segments as it goes (FSDP2's per-unit gathers and reductions in the backward) needs room
    beyond its own growth for the pieces it leaves.

    ``allocated``, ``peak`` and ``reset`` read the device's allocator (on CUDA:
    ``torch.cuda.memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``),
    ``fragmented_peak`` the fragments' peak since the last reset (CUDA: the allocator's
    ``inactive_split_bytes.all.peak``; None: not read); :meth:`of` builds it for a device, None
    where the device has no such counters."""

    def __init__(
        self,
        allocated: Callable[[], int],
        peak: Callable[[], int],
        reset: Callable[[], None],
        fragmented_peak: Callable[[], int] | None = None,
    ) -> None:
        self.allocated, self._peak, self._reset = allocated, peak, reset
        self._fragmented_peak = fragmented_peak
        self.growth: dict[str, int] = {}  # phase -> bytes it allocated the last time it ran
        self.fragments: dict[str, int] = {}  # phase -> the fragments' peak the last time it ran
        self.brought_in: dict[str, int] = {}  # phase -> what prefetches started in it brought in, the last time
        self._peaks: dict[str, int] = {}  # phase -> peak since the last take_peaks()
        self._phase: str | None = None
        self._start = 0  # allocated at the running phase's start
        self._high = 0  # the running phase's highest peak reading so far
        self._prefetched = 0  # brought in by prefetches started in the running phase
        self._held_for_backward: int | None = None  # what the loss's forward held as the last backward started
        self._part: tuple[str, int] | None = None  # (name, allocated at its start) of a part being measured
        self._frag_high = 0  # the running phase's highest fragments reading so far

    @classmethod
    def of(cls, device: torch.device) -> "PhaseMemory | None":
        if device.type != "cuda":
            return None
        return cls(
            lambda: torch.cuda.memory_allocated(device),
            lambda: torch.cuda.max_memory_allocated(device),
            lambda: torch.cuda.reset_peak_memory_stats(device),
            lambda: int(torch.cuda.memory_stats(device).get("inactive_split_bytes.all.peak", 0)),
        )

    def _read(self) -> None:
        """Take the running phase's reading, and restart the device's peak counter."""
        if self._phase is not None:
            peak = self._peak()
            self._high = max(self._high, peak)
            self._peaks[self._phase] = max(self._peaks.get(self._phase, 0), peak)
            self.growth[self._phase] = max(0, self._high - self._start - self._prefetched)
            self.brought_in[self._phase] = self._prefetched
            if self._fragmented_peak is not None:
                self._frag_high = max(self._frag_high, self._fragmented_peak())
                self.fragments[self._phase] = self._frag_high
        self._reset()

    def start(self, phase: str) -> None:
        """Close the running phase's reading and start ``phase``'s."""
        self._read()
        self._phase, self._start, self._high, self._prefetched = phase, self.allocated(), 0, 0
        self._frag_high = 0

    def rebase(self, grown_bytes: int = 0) -> None:
        """Count the running phase's growth from what is allocated now: called once its turn's
        switch has run, so that what the switch freed (a role moved out) or brought in is not
        read as the phase's own need. The switch's peak stays in the phase's peak for the log;
        the phase's growth is first published when it is next read (a phase running for the
        first time has none yet: what is prefetched behind it waits for its measure).

        Also called where a phase runs again after an out-of-memory error, once the roles
        beside it (and what prefetches brought in) went: ``grown_bytes`` of what is allocated
        now is the phase's own, allocated before the part that ran again (an FSDP2 policy
        gathered for generation), and stays in its growth; what prefetches had brought in is
        gone and no longer subtracted."""
        if self._phase is not None:
            self._peaks[self._phase] = max(self._peaks.get(self._phase, 0), self._peak())
        self._reset()
        self._high = self.allocated()
        self._start = self._high - grown_bytes
        self._prefetched = 0

    @property
    def phase(self) -> str | None:
        """The running phase (None before the first :meth:`start`)."""
        return self._phase

    def grown(self) -> int:
        """What the running phase has allocated so far, from its start (or its switch's
        :meth:`rebase`), less what prefetches started in it brought in: the part of its growth
        in place already (an FSDP2 policy gathered for generation before its first forward)."""
        if self._phase is None:
            return 0
        return max(0, self.allocated() - self._start - self._prefetched)

    def backward_need(self) -> int | None:
        """What the backward (with the optimizer step after it) will allocate, called as it
        starts: its growth the last time, scaled up by how much more the loss's forward holds
        now than it did at the same point then (a longer batch: larger activations, and larger
        gradients of them; never scaled down). None before the backward has run once."""
        held = max(1, self.allocated() - self._start)  # the loss's forward, since its switch
        before, self._held_for_backward = self._held_for_backward, held
        growth = self.growth.get("backward")
        if growth is None:
            return None
        return growth if before is None or held <= before else growth * held // before

    def begin_part(self, name: str) -> None:
        """Measure ``name``, a part of the running phase (the optimizer step, inside the
        backward's phase), until :meth:`end_part`: the running phase keeps its reading."""
        self._read()  # the phase's peak so far is kept; the counter restarts for the part
        self._part = (name, self.allocated())

    def end_part(self) -> int:
        """End the part :meth:`begin_part` started: its growth (its peak less what was
        allocated at its start) goes in ``growth[name]`` and is returned. The device's peak
        counter is not reset: the running phase's next reading includes the part's peak."""
        assert self._part is not None, "end_part() without begin_part()"
        (name, base), self._part = self._part, None
        self.growth[name] = max(0, self._peak() - base)
        return self.growth[name]

    def prefetched(self, nbytes: int) -> None:
        """A prefetch started in the running phase brought ``nbytes`` in."""
        self._prefetched += nbytes

    def take_peaks(self) -> dict[str, int]:
        """Each phase's peak allocated bytes since the last call (the running one's so far)."""
        self._read()
        peaks, self._peaks = self._peaks, {}
        return peaks
